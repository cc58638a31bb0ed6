"""Step-time overhead of tfmp against plain Keras and `tf.distribute`.

Trains one MLP (Input 256 -> Dense 1024 relu -> Dense 1024 relu -> Dense 256,
mse loss, Adam, batch 256, synthetic data) under four configurations in one
process, and prints the ratio of median step times for two comparisons:

1. tfmp on a 1x1 mesh, no layout map / plain Keras without a strategy: the cost
   of running through DTensor on one device. Target: <= 1.05.
2. tfmp on an 8x1 mesh (data parallel over the "batch" axis) /
   `tf.distribute.MirroredStrategy` over the same 8 devices. Target: <= 1.00.
3. tfmp on the 8x1 mesh with `steps_per_execution=8` (8 steps per function
   call) / MirroredStrategy as in 2. Target: <= 1.00. (Keras 3.15's
   MirroredStrategy fails with `steps_per_execution` > 1 on numpy inputs on
   these devices: "You must feed a value for placeholder tensor" in its
   `multi_step_on_iterator`.)

The host CPU is split into 8 logical devices with `tfmp.simulate_devices(8)`,
so the 8-device numbers measure framework overhead (dispatch, input splitting,
gradient all-reduce) rather than a parallel speed-up.

Method: every configuration starts from the same initial weights and trains on
the same batches. A warm-up fit per configuration traces the step function;
then the configurations run in interleaved rounds (order reversed every other
round, to cancel drift on a shared machine). A step's time is the gap between
consecutive `on_train_batch_end` calls (divided by `steps_per_execution`,
as Keras calls it once per execution), so it includes feeding the batch; the
first gaps of every round are dropped. Ratios compare medians from this run
only, never stored numbers.

Usage (from the repository root):

    python bench/overhead.py                 # 30 steps x 3 rounds
    python bench/overhead.py --quick         # tiny smoke run
    python bench/overhead.py --steps 50 --rounds 5
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

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

SEED = 0
WARMUP_STEPS = 5  # per configuration, before any round: includes tracing
DROPPED_GAPS = 2  # per round: the first step gaps after `fit` starts


@dataclasses.dataclass(frozen=True)
class Size:
    """Widths of the MLP and the (global) batch size."""

    features: int
    hidden: int
    outputs: int
    batch: int


FULL = Size(features=256, hidden=1024, outputs=256, batch=256)
QUICK = Size(features=32, hidden=64, outputs=32, batch=64)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """`candidate`'s median step time over `baseline`'s, and the target ratio."""

    candidate: str
    baseline: str
    target: float


COMPARISONS = (
    Comparison("tfmp 1x1", "keras", target=1.05),
    Comparison("tfmp 8x1", "mirrored 8", target=1.00),
    Comparison("tfmp 8x1 spe 8", "mirrored 8", target=1.00),
)


class StepTimer(keras.callbacks.Callback):
    """Records `time.perf_counter()` at the end of every execution of
    `steps_per_execution` training steps."""

    def __init__(self, steps_per_execution: int):
        super().__init__()
        self.steps_per_execution = steps_per_execution

    def on_train_begin(self, logs=None):
        self.ends: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def step_times(self) -> list[float]:
        """Seconds per step between consecutive executions' ends, without the
        first gaps."""
        gaps = np.diff(self.ends) / self.steps_per_execution
        return gaps[DROPPED_GAPS:].tolist()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_devices.add_argument(parser)
    parser.add_argument(
        "--steps", type=int, help="measured steps per round (default 30; quick: 8)"
    )
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds (default 3; quick: 2)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model and few steps: a CI smoke run"
    )
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.quick else 30)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.size = QUICK if args.quick else FULL
    return args


def strategies() -> dict[str, tuple[tf.distribute.Strategy | None, int]]:
    """The configurations by name: a strategy (None trains without one) and
    `steps_per_execution`."""
    data_parallel = tfmp.ModelParallelStrategy(
        tfmp.DeviceMesh((8, 1), ("batch", "model"), devices=DEVICES)
    )
    return {
        "keras": (None, 1),
        "tfmp 1x1": (tfmp.ModelParallelStrategy(
            tfmp.DeviceMesh((1, 1), ("batch", "model"), devices=DEVICES[:1])), 1),
        "tfmp 8x1": (data_parallel, 1),
        "mirrored 8": (tf.distribute.MirroredStrategy(
            DEVICES, cross_device_ops=bench_devices.mirrored_cross_device_ops()), 1),
        "tfmp 8x1 spe 8": (data_parallel, 8),
    }


def build_mlp(size: Size) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((size.features,)),
            keras.layers.Dense(size.hidden, activation="relu", name="dense_1"),
            keras.layers.Dense(size.hidden, activation="relu", name="dense_2"),
            keras.layers.Dense(size.outputs, name="dense_3"),
        ],
        name="mlp",
    )


def build_on(
    strategy: tf.distribute.Strategy | None,
    steps_per_execution: int,
    size: Size,
    weights: list[np.ndarray],
) -> keras.Model:
    """A compiled MLP with `weights`, in `strategy`'s scope if there is one."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = build_mlp(size)
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3), loss="mse",
            steps_per_execution=steps_per_execution,
        )
    return model


def synthetic_data(size: Size, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """`steps` batches of normal inputs and targets."""
    rng = np.random.default_rng(SEED)
    n = steps * size.batch
    x = rng.normal(size=(n, size.features)).astype("float32")
    y = rng.normal(size=(n, size.outputs)).astype("float32")
    return x, y


def fit_steps(
    model: keras.Model, x: np.ndarray, y: np.ndarray, batch: int, executions: int
) -> list[float]:
    """Trains `executions` times `steps_per_execution` steps; returns the
    kept step times."""
    timer = StepTimer(model.steps_per_execution)
    n = executions * model.steps_per_execution * batch
    model.fit(
        x[:n], y[:n], batch_size=batch, epochs=1, shuffle=False, verbose=0,
        callbacks=[timer],
    )
    return timer.step_times()


def measure(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """Step times in seconds of every configuration, one list per round."""
    size = args.size
    keras.utils.set_random_seed(SEED)
    weights = build_mlp(size).get_weights()
    models = {
        name: build_on(strategy, steps_per_execution, size, weights)
        for name, (strategy, steps_per_execution) in strategies().items()
    }

    def executions(model: keras.Model, steps: int) -> int:
        return -(-steps // model.steps_per_execution) + DROPPED_GAPS + 1

    most = max(executions(m, args.steps) * m.steps_per_execution for m in models.values())
    x, y = synthetic_data(size, max(most, WARMUP_STEPS * 8))
    for model in models.values():
        fit_steps(model, x, y, size.batch, executions(model, WARMUP_STEPS))
    times: dict[str, list[list[float]]] = {name: [] for name in models}
    for round_index in range(args.rounds):
        order = list(models) if round_index % 2 == 0 else list(models)[::-1]
        for name in order:
            model = models[name]
            times[name].append(
                fit_steps(model, x, y, size.batch, executions(model, args.steps))
            )
    return times


def median_ms(rounds: list[list[float]]) -> float:
    return 1e3 * statistics.median(t for steps in rounds for t in steps)


def report(args: argparse.Namespace, times: dict[str, list[list[float]]]) -> None:
    """Prints the machine, versions and the comparison table."""
    size = args.size
    print(
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; python {platform.python_version()}, "
        f"tensorflow {tf.__version__}, keras {keras.__version__}, "
        f"tfmp {tfmp.__version__}"
    )
    print(
        f"model: {size.features} -> {size.hidden} relu -> {size.hidden} relu -> "
        f"{size.outputs}, Adam, mse, batch {size.batch}; {args.rounds} rounds x "
        f"{args.steps} steps per config, {bench_devices.describe()}"
    )
    print()
    print(
        "| comparison | candidate ms | baseline ms | ratio | per-round ratios "
        "| target | result |"
    )
    print("|---|---:|---:|---:|---|---:|---|")
    for comparison in COMPARISONS:
        candidate = median_ms(times[comparison.candidate])
        baseline = median_ms(times[comparison.baseline])
        ratio = candidate / baseline
        per_round = [
            statistics.median(c) / statistics.median(b)
            for c, b in zip(times[comparison.candidate], times[comparison.baseline])
        ]
        passed = ratio <= comparison.target
        print(
            f"| {comparison.candidate} / {comparison.baseline} | {candidate:.2f} "
            f"| {baseline:.2f} | {ratio:.3f} | {min(per_round):.3f}-"
            f"{max(per_round):.3f} | <= {comparison.target:.2f} "
            f"| {'pass' if passed else 'FAIL'} |"
        )


def main() -> None:
    args = parse_args()
    report(args, measure(args))


if __name__ == "__main__":
    main()
