"""Throughput and activation memory of a 2-stage pipeline.

A stack of wide Dense layers is cut into 2 LayerGroups on a
("stage", "batch", "model") = (2, 1, 1) mesh: one device per stage. With
`--devices cpu` (the default) the host is split into 2 logical CPU devices and
TensorFlow runs each op on one thread (intra-op parallelism 1), so each stage
can hold one core. Side by side, in one run, it trains:

- the same model on one device, plain Keras, no micro-batches, with every
  thread pinned to one core (the baseline: one device, one core);
- the pipeline with m = 1, 2, 4, 8 micro-batches, with each schedule.

and prints each pipeline's speed-up over the baseline (median step time
ratio) next to the ideal p*m/(m+p-1) and their ratio; the target is >= 85% of
the ideal at m = 8. TensorFlow runs with two inter-op threads per stage:
each stage's part of the step holds a thread while it waits for the other's
activations.

Memory: each of gpipe, 1f1b and gpipe with recompute=True trains in a fresh
process, which reports the activation memory it measured: on GPU the peak of
each stage's device (`tf.config.experimental.get_memory_info`); on CPU, which
has no per-device allocator, how far the process's resident size (sampled
every millisecond) rose above its size before the timed steps (both stages
together; measured without oneDNN's caching allocator so that freed
activations leave the process). GPipe holds every micro-batch's activations
until the backward passes; 1F1B at most `p - k` micro-batches' on stage `k`;
recompute keeps only each micro-batch's stage input.

Usage (from the repository root):

    python bench/pipeline.py                 # 2 CPU devices
    python bench/pipeline.py --devices gpu   # 2 logical GPUs on the first GPU
    python bench/pipeline.py --quick         # a small model, a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STAGES = 2
MICROBATCHES = (1, 2, 4, 8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--memory-only", metavar="MODE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.width = args.width or (256 if args.quick else 1024)
    args.batch = args.batch or (64 if args.quick else 1024)
    args.steps = args.steps or (4 if args.quick else 10)
    return args


def setup(devices: str) -> None:
    import tensorflow as tf

    import tfmp

    if devices == "cpu":
        tf.config.threading.set_intra_op_parallelism_threads(1)
        # Each stage's part of the step holds a thread while it waits for the
        # other's activations: two threads per stage keep both cores working.
        tf.config.threading.set_inter_op_parallelism_threads(2 * STAGES)
        tfmp.simulate_devices(STAGES)
    else:
        gpu = tf.config.list_physical_devices("GPU")
        if not gpu:
            sys.exit("--devices gpu: no GPU found.")
        tfmp.simulate_devices(STAGES, "GPU", memory_limit_mb=16 * 1024)


def build(args: argparse.Namespace, recompute: bool = False):
    import keras

    import tfmp

    def stage(k: int):
        return tfmp.layers.LayerGroup(
            [
                keras.layers.Dense(args.width, activation="relu", name=f"dense_{k}_{i}")
                for i in range(args.layers_per_stage)
            ],
            stage=k,
            recompute=recompute,
            name=f"stage_{k}",
        )

    return keras.Sequential([keras.Input((args.width,)), stage(0), stage(1)], name="stack")


def data(args: argparse.Namespace):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * (args.steps + 2), args.width)).astype("float32")
    return x, x


def step_times(model, args: argparse.Namespace, dataset=None) -> list[float]:
    """Seconds of each training step after two warm-up steps."""
    import keras
    import tensorflow as tf

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # waits for the step
            self.times.append(time.perf_counter() - self.start)

    timer = Timer()
    if dataset is None:
        dataset = tf.data.Dataset.from_tensor_slices(data(args)).batch(args.batch)
    model.fit(dataset, epochs=1, verbose=0, callbacks=[timer])
    return timer.times[2:]


def compiled(model):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    return model


def pipeline(args: argparse.Namespace, num_microbatches: int, schedule: str = "gpipe", recompute: bool = False):
    import tfmp

    device_type = "GPU" if args.devices == "gpu" else "CPU"
    mesh = tfmp.DeviceMesh(
        (STAGES, 1, 1), ("stage", "batch", "model"), tfmp.list_devices(device_type)[:STAGES]
    )
    strategy = tfmp.ModelParallelStrategy(mesh, num_microbatches=num_microbatches, schedule=schedule)
    with strategy.scope():
        return compiled(build(args, recompute)), strategy


def throughput(args: argparse.Namespace) -> None:
    import tensorflow as tf

    import tfmp

    device_type = "GPU" if args.devices == "gpu" else "CPU"
    model = compiled(build(args))
    with tf.device(tfmp.list_devices(device_type)[0]), one_core(args.devices == "cpu"):
        baseline = statistics.median(step_times(model, args))
    print(f"2-stage pipeline, width {args.width}, {2 * args.layers_per_stage} Dense layers, "
          f"batch {args.batch}, {args.devices.upper()}; baseline (1 device) "
          f"{baseline * 1e3:.1f} ms/step")
    print(f"{'schedule':>8} {'m':>3} {'ms/step':>8} {'speed-up':>9} {'ideal':>6} {'of ideal':>9}")
    for schedule in ("gpipe", "1f1b"):
        for m in MICROBATCHES:
            if schedule == "1f1b" and m < STAGES:
                continue
            model, _ = pipeline(args, m, schedule)
            median = statistics.median(step_times(model, args))
            speedup = baseline / median
            ideal = STAGES * m / (m + STAGES - 1)
            verdict = ""
            if m == 8:
                verdict = "  target >= 85%: " + ("met" if speedup / ideal >= 0.85 else "missed")
            print(f"{schedule:>8} {m:>3} {median * 1e3:>8.1f} {speedup:>9.2f} {ideal:>6.2f} "
                  f"{speedup / ideal:>8.0%}{verdict}")


@contextlib.contextmanager
def one_core(active: bool):
    """Pins every thread of the process to one core in the block.

    The one-device baseline stands for one device, one core, as each stage
    has; TensorFlow's inter-op threads would otherwise spread it over both.
    """
    if not active:
        yield
        return
    everything = os.sched_getaffinity(0)
    _pin(set(sorted(everything)[:1]))
    try:
        yield
    finally:
        _pin(everything)


def _pin(cores: set[int]) -> None:
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cores)
        except OSError:  # the thread has ended
            pass


MEMORY_MODES = {"gpipe": ("gpipe", False), "1f1b": ("1f1b", False), "gpipe+recompute": ("gpipe", True)}


class RssSampler:
    """Samples the process's resident size every millisecond in the block."""

    def __enter__(self) -> "RssSampler":
        self.start = self.peak = _resident_bytes()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, _resident_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def memory_of_mode(args: argparse.Namespace, mode: str) -> dict:
    """Trains in this process and returns what it measured (run in a fresh process)."""
    import tensorflow as tf

    schedule, recompute = MEMORY_MODES[mode]
    model, strategy = pipeline(args, 8, schedule, recompute)
    devices = [mesh.dtensor_mesh.local_devices()[0] for mesh in strategy.stage_meshes.meshes]
    dataset = tf.data.Dataset.from_tensor_slices(data(args)).batch(args.batch).cache()
    model.fit(dataset, verbose=0)  # traces, and fills the cache: neither is measured
    if args.devices == "gpu":
        for device in devices:
            tf.config.experimental.reset_memory_stats(device)
    sampler = RssSampler()
    with sampler:
        step_times(model, args, dataset)
    result = {"rss_growth": sampler.peak - sampler.start}
    if args.devices == "gpu":
        result["peaks"] = [tf.config.experimental.get_memory_info(d)["peak"] for d in devices]
    return result


def memory(args: argparse.Namespace) -> None:
    # Batches 8x larger than the timed ones, so activations stand out of the
    # process's other memory.
    batch = 8 * args.batch
    per_stage = batch * args.width * 4 * args.layers_per_stage
    print(f"\nactivation memory, m = 8, batch {batch} (each in a fresh process); "
          f"one stage's layer outputs for the whole batch: {per_stage / 2**20:.0f} MiB")
    env = dict(os.environ)
    if args.devices == "cpu":
        # CPU memory is seen only as the process's resident size. oneDNN's
        # allocator and glibc keep freed memory mapped, which hides when
        # activations are freed: measure with plain malloc and unmapped frees.
        env.update(TF_ENABLE_ONEDNN_OPTS="0", MALLOC_MMAP_THRESHOLD_="65536")
    for mode in MEMORY_MODES:
        command = [sys.executable, __file__, "--memory-only", mode, "--devices", args.devices,
                   "--width", str(args.width), "--batch", str(batch), "--steps", "3",
                   "--layers-per-stage", str(args.layers_per_stage)]
        output = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
        result = json.loads(output.strip().splitlines()[-1])
        line = f"  {mode:<16} resident size grew by {result['rss_growth'] / 2**20:7.1f} MiB at peak"
        if "peaks" in result:
            line += "; stage peaks " + ", ".join(f"{p / 2**20:.1f} MiB" for p in result["peaks"])
        print(line)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.devices)
    if args.memory_only:
        print(json.dumps(memory_of_mode(args, args.memory_only)))
        return
    throughput(args)
    memory(args)


if __name__ == "__main__":
    main()
