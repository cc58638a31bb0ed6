"""Host memory (RSS) growth of the step loop: MB per 1,000 steps.

Trains a tiny MLP (16 -> 32 relu -> 8, Adam, mse, batch 16) with plain Keras
(one device, no strategy), tfmp on a 1x1 mesh and tfmp on a 2x4
("batch" x "model") mesh of simulated devices, in `fit`, `train_on_batch` and
`predict`, and prints how much the process' resident memory grows per 1,000
steps after a warm-up: the median growth between RSS readings (from
/proc/self/statm) every `--every` steps. The first line names the
allocator the runs use: start the benchmark with
`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2` or
`MALLOC_ARENA_MAX=2` to compare; growth that stays on another allocator is
memory held, not fragmentation.

Every configuration runs in its own process (RSS is per process). Each run
prints `RESULT` lines for run_all.py: growth on the 2x4 mesh / growth of
plain Keras, with a floor of 1 MB per 1,000 steps under the baseline so that
a flat baseline does not turn noise into a large ratio.

Usage (from the repository root, on a shared machine under `nice -n 19`):

    python bench/memory_growth.py              # 2,000 measured steps per run
    python bench/memory_growth.py --quick      # 600
    python bench/memory_growth.py --steps-per-execution 8   # fit only
    python bench/memory_growth.py --modes graph_loop --steps-per-execution 8

`graph_loop` is a custom loop as TensorFlow's guides write it: a
`tf.function` whose `for _ in tf.range(k)` loop calls `strategy.run` on
`next(iterator)`, called once per k steps (k: `--steps-per-execution`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = ("keras", "1x1", "2x4")
MODES = ("fit", "train_on_batch", "predict", "graph_loop")
BATCH = 16
# Below this baseline growth (MB per 1,000 steps) the ratio's denominator is
# this floor: RSS moves by page-sized steps, and a flat baseline is noise.
BASELINE_FLOOR = 1.0


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def growth_per_1000(points: list[tuple[int, float]]) -> float:
    """MB per 1,000 steps: the median growth between consecutive samples.

    The median, not a line through all samples: glibc hands large freed
    blocks back now and then (RSS drops by ~100 MB in one interval, as `fit`
    frees a batch copy), which would swing a fitted line either way.
    """
    rates = sorted(
        1000 * (rss - previous_rss) / (step - previous_step)
        for (previous_step, previous_rss), (step, rss) in zip(points, points[1:])
    )
    return rates[len(rates) // 2]


def measure(config: str, mode: str, steps: int, warmup: int, every: int, spe: int) -> dict:
    """Runs one configuration in this process and returns its growth."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    import tfmp

    tfmp.simulate_devices(8)
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 16)).astype("float32")
    y = rng.normal(size=(BATCH, 8)).astype("float32")

    def build() -> keras.Model:
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(32, activation="relu", name="up"),
                keras.layers.Dense(8, name="down"),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=spe)
        return model

    if config == "keras":
        strategy = tf.distribute.get_strategy()
        model = build()
    else:
        shape = tuple(int(size) for size in config.split("x"))
        mesh = tfmp.DeviceMesh(shape, ("batch", "model"))
        layout_map = tfmp.LayoutMap(mesh)
        layout_map["up/kernel"] = (None, "model")
        layout_map["up/bias"] = ("model",)
        layout_map["down/kernel"] = ("model", None)
        strategy = tfmp.ModelParallelStrategy(mesh, layout_map)
        with strategy.scope():
            model = build()

    points: list[tuple[int, float]] = []

    class Sampler(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0

        def _sample(self, batch, logs=None):
            self.step += spe
            if self.step > warmup and self.step % every < spe:
                points.append((self.step, rss_mb()))

        on_train_batch_end = on_predict_batch_end = _sample

    total = warmup + steps
    if mode == "graph_loop":
        sampler = Sampler()
        train_steps = graph_loop(model, strategy, spe)
        iterator = iter(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors((x, y)).repeat()))
        for _ in range(total // spe):
            train_steps(iterator)
            sampler._sample(None)
    elif mode == "train_on_batch":
        sampler = Sampler()
        for _ in range(total):
            model.train_on_batch(x, y)
            sampler._sample(None)
    else:
        rows = total * BATCH
        xs, ys = np.tile(x, (total, 1))[:rows], np.tile(y, (total, 1))[:rows]
        if mode == "fit":
            model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0, callbacks=[Sampler()])
        else:
            model.predict(xs, batch_size=BATCH, verbose=0, callbacks=[Sampler()])
    return {"config": config, "mode": mode, "mb_per_1000": growth_per_1000(points),
            "rss_end_mb": points[-1][1]}


def graph_loop(model, strategy, steps: int):
    """A compiled function that trains `model` `steps` steps on batches it
    reads with `next(iterator)` in a `tf.range` loop."""
    import keras
    import tensorflow as tf

    def step_fn(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(labels, model(features, training=True)))
        gradients = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def train_steps(iterator):
        for _ in tf.range(steps):
            strategy.run(step_fn, args=(next(iterator),))

    return train_steps


def allocator() -> str:
    preload = os.environ.get("LD_PRELOAD", "")
    name = os.path.basename(preload) if preload else "glibc malloc"
    if "MALLOC_ARENA_MAX" in os.environ:
        name += f", MALLOC_ARENA_MAX={os.environ['MALLOC_ARENA_MAX']}"
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 measured steps per run")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--modes", nargs="*", default=list(MODES[:3]), choices=MODES)
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = 600 if args.quick else args.steps
    spe = args.steps_per_execution
    if args.one:
        print(json.dumps(measure(*args.one, steps, args.warmup, args.every, spe)))
        return
    modes = [mode for mode in args.modes if mode in ("fit", "graph_loop")] if spe > 1 else args.modes
    print(f"model: 16 -> 32 relu -> 8, Adam, mse, batch {BATCH}; {args.warmup} warm-up steps, "
          f"{steps} measured, RSS every {args.every}; steps_per_execution {spe}; "
          f"8 simulated CPU devices; allocator: {allocator()}")
    results: dict[tuple[str, str], float] = {}
    for mode in modes:
        for config in CONFIGS:
            command = [sys.executable, __file__, "--one", config, mode, "--steps", str(steps),
                       "--warmup", str(args.warmup), "--every", str(args.every),
                       "--steps-per-execution", str(spe)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"{config} {mode} failed:\n{done.stderr[-3000:]}")
            results[config, mode] = json.loads(done.stdout.strip().splitlines()[-1])["mb_per_1000"]
    print()
    print("| MB per 1,000 steps | " + " | ".join(CONFIGS) + " | 2x4 / keras |")
    print("|---|" + "---:|" * (len(CONFIGS) + 1))
    for mode in modes:
        ratio = results["2x4", mode] / max(results["keras", mode], BASELINE_FLOOR)
        row = " | ".join(f"{results[c, mode]:.2f}" for c in CONFIGS)
        print(f"| {mode} | {row} | {ratio:.1f} |")
    print()
    for mode in modes:
        ratio = results["2x4", mode] / max(results["keras", mode], BASELINE_FLOOR)
        status = "met" if ratio <= 2 else "missed"
        label = f"RSS growth 2x4 / keras (floor {BASELINE_FLOOR:g} MB), {mode}"
        if spe > 1:
            label += f", steps_per_execution {spe}"
        print(f'RESULT measure="{label}" ratio={ratio:.2f} target=<=2.00 status={status}')


if __name__ == "__main__":
    main()
