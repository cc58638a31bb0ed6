"""Step-time overhead of tfmp's monitoring callbacks, with default settings.

Trains the `tfmp demo` Transformer LM on a 2x4 ("batch" x "model") mesh of
simulated CPU devices, one epoch with `DeviceMemoryMonitor()` and
`GradientSyncMonitor()` and one without per round, on the same model, in
alternating order. Prints the median over rounds of each round's ratio of
median step times with / without. Target: <= 1.02. Step time is the gap
between consecutive batch ends, so the callbacks' own work is inside it.

Usage (from the repository root):

    python bench/callbacks.py              # 8 rounds x 2 sides x 1 epoch of 32 steps
    python bench/callbacks.py --rounds 1   # a quick look
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmp  # noqa: E402

import argparse  # noqa: E402

import devices as bench_devices  # noqa: E402  (bench/devices.py)

# --devices cpu|gpu is read here: the devices must be made before any TensorFlow op.
_flags = argparse.ArgumentParser(add_help=False)
bench_devices.add_argument(_flags)
DEVICES = bench_devices.setup(_flags.parse_known_args()[0].devices, 8)

import statistics  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data  # noqa: E402

BATCH = 32
DROPPED_GAPS = 2  # per fit: the first step gaps include tracing


class StepTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.ends: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def build(strategy: tfmp.ModelParallelStrategy, weights: list) -> keras.Model:
    with strategy.scope():
        model = build_transformer_lm()
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def step_times(model: keras.Model, data: tuple, callbacks: list) -> list[float]:
    timer = StepTimer()
    model.fit(*data, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks + [timer])
    return np.diff(timer.ends)[DROPPED_GAPS:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_devices.add_argument(parser)
    parser.add_argument("--rounds", type=int, default=8)
    rounds = parser.parse_args().rounds
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"), DEVICES)
    strategy = tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh))
    keras.utils.set_random_seed(0)
    weights = build_transformer_lm().get_weights()
    data = next_token_data(32 * BATCH, seq_len=8, vocab_size=64)
    # One model for both sides: two instances of the same model differed by
    # up to 4% in step time with the same callbacks.
    model = build(strategy, weights)
    monitors = [tfmp.callbacks.DeviceMemoryMonitor(), tfmp.callbacks.GradientSyncMonitor()]
    step_times(model, data, monitors)  # untimed: traces, and the monitors' first epoch end
    times = {"without": [], "with": []}
    ratios = []
    for index in range(rounds):
        sides = [("without", []), ("with", monitors)]
        medians = {}
        for name, callbacks in sides if index % 2 == 0 else sides[::-1]:
            gaps = step_times(model, data, callbacks)
            times[name] += gaps
            medians[name] = statistics.median(gaps)
        ratios.append(medians["with"] / medians["without"])
    without = statistics.median(times["without"]) * 1e3
    with_monitors = statistics.median(times["with"]) * 1e3
    ratio = statistics.median(ratios)
    print(f"model: tfmp demo LM, 2x4 mesh, batch {BATCH}; {rounds} rounds, each one epoch of "
          "32 steps per side, in alternating order; ratio: median over rounds of each round's "
          f"ratio of median step times (min {min(ratios):.3f}, max {max(ratios):.3f})")
    print()
    print("| callbacks | median step ms | ratio | target | result |")
    print("|---|---:|---:|---:|---|")
    print(f"| none | {without:.2f} | | | |")
    print(
        f"| DeviceMemoryMonitor + GradientSyncMonitor | {with_monitors:.2f} | "
        f"{ratio:.3f} | <= 1.02 | {'pass' if ratio <= 1.02 else 'FAIL'} |"
    )


if __name__ == "__main__":
    main()
