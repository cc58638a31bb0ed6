"""Throughput and activation memory of a 2-stage pipeline.

A stack of wide Dense layers is cut into 2 LayerGroups on a
("stage", "batch", "model") = (2, 1, 1) mesh: one device per stage.

How the speed-up is measured, and why this way. The ideal speed-up of p
stages with m micro-batches, p*m/(m+p-1), assumes that each stage is one
device that runs one op at a time, and that the baseline is one such device.
With `--devices cpu` (the default) the host is split into 2 logical CPU
devices, TensorFlow runs each op on one thread (intra-op parallelism 1), and
the 2 stages share the machine's cores. The logical devices share one pool of
TensorFlow threads, though, so a device is not bound to one core: a Dense
layer's two backward matmuls (the kernel's gradient and the input's) run at
once on two cores. Measured that way, the m=1 pipeline (where no overlap is
possible) ran 1.36x faster than the one-device baseline pinned to one core
(4 layers: 11 matmuls one after the other, 8 steps with those pairs side by
side: 11/8 = 1.375), which inflated every "of ideal" figure by that factor.
So here:

- the layers are `SerialDense`: Keras Dense layers whose backward pass
  computes the input's gradient after the kernel's, so that each stage (and
  the baseline) computes one matmul at a time, as one device does; and tfmp
  runs each stage's passes one at a time, in its schedule's order, for gpipe
  as for 1f1b (a stage free to run several passes at once would borrow the
  other stage's core, which the ideal does not count). The pipeline and the
  baseline train the same model with the same thread settings, in the same
  process; nothing is pinned;
- the baseline is that model on one device, plain Keras, no micro-batches;
  the m=1 pipeline runs the same ops one after the other, so it reads ~1.00
  against it (checked: within 0.90-1.10);
- each configuration (the baseline; gpipe with m = 1, 2, 4, 8; 1f1b with
  m = 2, 4, 8; the same layers data-parallel on the stages' devices) runs
  once untimed (its first steps ran up to 40% slower than later ones), then
  is timed once per round (median step time after two warm-up steps), rounds
  alternate the order, and each ratio is taken within a round, so that a
  change of the machine's load moves a round's times together. Printed: min
  / median / max over the rounds of the speed-up over the baseline, over the
  m=1 pipeline, the fraction of the ideal, and the fraction of the ideal on
  this machine's devices (below); the target is a median >= 85% at m = 8,
  for both schedules. `RESULT` lines (read by bench/run_all.py) give those
  medians and the m=1 check;
- the ideal assumes devices that do not slow each other down. Two logical
  devices on this machine's 2 cores do: trained data-parallel (the same
  layers and batch, no bubble, one small all-reduce) they ran 1.54-1.79x (four runs)
  faster than one device, not 2x, as two cores share caches and memory
  bandwidth. `ideal_here` is the ideal with every pass that overlaps
  another's running that much slower, measured in the same round; it reads
  the ideal on devices that share nothing (separate GPUs).

The stages do equal work in each phase: every layer computes its input's
gradient, the first one's too (its bias gradient waits for it), so each
stage runs 2 matmuls per micro-batch forward and 4 backward. An earlier
balance, stage 0's first layer reading inputs 1.5 times as wide in place of
computing its input's gradient, evened the stages' totals (3 + 3 matmuls
each) but not their phases (2.5 + 3.5 against 2 + 4): GPipe, which runs all
forwards then all backwards, then went at the slower stage's pace in each
phase, and the profile showed the faster stage waiting 1.3-1.9 ms before
each pass; at m = 8 GPipe read 71-73% of the ideal against 1F1B's 79-80% (two runs). On 2 cores the 2
stages overlap fully
only if nothing else runs: the step's Python, the input pipeline and other
processes take cores from the stages, and the ideal is then out of reach
(the min over rounds shows it).

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
SCHEDULES = ("gpipe", "1f1b")
BASELINE = ("one device", 0)
FIRST = ("gpipe", 1)  # the m=1 pipeline: no overlap is possible
# The same layers data-parallel over the stages' devices: what p devices of
# this machine deliver when nothing but the machine is shared.
DATA_PARALLEL = ("data parallel", 0)
TARGET = 0.85  # of the ideal speed-up, at m = 8
# The m=1 pipeline over one device: ~1.00 when the baseline is comparable.
M1_RANGE = (0.90, 1.10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-only", metavar="MODE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.width = args.width or (256 if args.quick else 1024)
    args.batch = args.batch or (64 if args.quick else 1024)
    args.steps = args.steps or (3 if args.quick else 4)
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


def serial_dense():
    """The `SerialDense` layer class (defined here, where Keras is imported:
    a memory run sets its environment before it imports TensorFlow)."""
    import keras
    import tensorflow as tf

    def plus_zero_times_an_element(value, other):
        """`value` plus zero times one element of `other`: computed once
        `other` is (a non-finite element counts as zero)."""
        first = tf.reshape(tf.slice(other, [0] * other.shape.rank, [1] * other.shape.rank), [])
        return value + tf.where(tf.math.is_finite(first), first, 0.0) * 0.0

    @tf.custom_gradient
    def dense(inputs, kernel, bias):
        def gradient(upstream):
            kernel_gradient = tf.matmul(inputs, upstream, transpose_a=True)
            # The input's gradient starts once the kernel's is done ...
            upstream = plus_zero_times_an_element(upstream, kernel_gradient)
            input_gradient = tf.matmul(upstream, kernel, transpose_b=True)
            # ... and the bias' waits for the input's, so that every layer
            # computes one, the model's first layer too.
            bias_gradient = plus_zero_times_an_element(tf.reduce_sum(upstream, 0), input_gradient)
            return input_gradient, kernel_gradient, bias_gradient

        return tf.matmul(inputs, kernel) + bias, gradient

    class SerialDense(keras.layers.Dense):
        """A Dense layer whose backward pass runs one matmul at a time, so
        that a stage, like the one-device baseline, keeps one core busy, and
        always computes its input's gradient, so that every layer does the
        same work forward and backward."""

        def call(self, inputs):
            return self.activation(dense(inputs, self.kernel, self.bias))

    return SerialDense


def build(args: argparse.Namespace, recompute: bool = False, grouped: bool = True):
    """The stack, its layers in one LayerGroup per stage (`grouped`) or
    in a plain Sequential."""
    import keras

    import tfmp

    dense = serial_dense()

    def stage(k: int) -> list:
        return [
            dense(args.width, activation="relu", name=f"dense_{k}_{i}")
            for i in range(args.layers_per_stage)
        ]

    if not grouped:
        return keras.Sequential(
            [keras.Input((args.width,))] + [layer for k in range(STAGES) for layer in stage(k)],
            name="stack",
        )
    groups = [
        tfmp.layers.LayerGroup(stage(k), stage=k, recompute=recompute, name=f"stage_{k}")
        for k in range(STAGES)
    ]
    return keras.Sequential([keras.Input((args.width,))] + groups, name="stack")


def data(args: argparse.Namespace):
    import numpy as np

    rng = np.random.default_rng(0)
    rows = args.batch * (args.steps + 2)
    x = rng.normal(size=(rows, args.width)).astype("float32")
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


def timers(args: argparse.Namespace) -> dict:
    """For each configuration (BASELINE, or a pipeline's (schedule, m)), a
    function that trains it for a few steps and returns the median step time."""
    import tensorflow as tf

    import tfmp

    device_type = "GPU" if args.devices == "gpu" else "CPU"
    device = tfmp.list_devices(device_type)[0]
    baseline = compiled(build(args))

    def on_one_device() -> float:
        with tf.device(device):
            return statistics.median(step_times(baseline, args))

    mesh = tfmp.DeviceMesh(
        (STAGES, 1), ("batch", "model"), tfmp.list_devices(device_type)[:STAGES]
    )
    with tfmp.ModelParallelStrategy(mesh).scope():
        data_parallel = compiled(build(args, grouped=False))

    functions = {
        BASELINE: on_one_device,
        DATA_PARALLEL: lambda: statistics.median(step_times(data_parallel, args)),
    }
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            if schedule == "1f1b" and m < STAGES:  # 1F1B needs m >= p
                continue
            model, _ = pipeline(args, m, schedule)
            functions[schedule, m] = lambda model=model: statistics.median(step_times(model, args))
    return functions


def rounds_of_times(args: argparse.Namespace) -> dict:
    """Each configuration's median step time in each round.

    A round times every configuration once, back to back, so that a change
    of the machine's load between rounds moves all of a round's times
    together; every other round runs them in reverse order, so that none
    always comes first.
    """
    functions = timers(args)
    order = list(functions)
    times = {config: [] for config in order}
    for function in functions.values():  # untimed: tracing, and the first steps' allocations
        function()
    for index in range(args.rounds):
        for config in order if index % 2 == 0 else reversed(order):
            times[config].append(functions[config]())
    return times


def spread(values: list[float]) -> tuple[float, float, float]:
    """Min, median and max."""
    return min(values), statistics.median(values), max(values)


def throughput(args: argparse.Namespace) -> None:
    times = rounds_of_times(args)
    baseline = times.pop(BASELINE)
    # Per round: how much faster the stages' devices train the same layers
    # data-parallel than one device (p if the devices shared nothing).
    devices_speedup = [b / t for b, t in zip(baseline, times.pop(DATA_PARALLEL))]
    print(f"{STAGES}-stage pipeline, width {args.width}, {STAGES * args.layers_per_stage} "
          f"SerialDense layers, batch {args.batch}, {args.devices.upper()}; one device "
          f"{statistics.median(baseline) * 1e3:.1f} ms/step (median of {args.rounds} rounds, "
          "after an untimed one)")
    print(f"the same layers data-parallel on the {STAGES} devices: "
          f"{_row(spread(devices_speedup))} x one device (min / median / max): what "
          f"{STAGES} devices of this machine deliver, against {STAGES} in the ideal")
    print(f"min / median / max over {args.rounds} rounds of each round's ratio of median step "
          "times; vs m=1: over the gpipe m=1 pipeline; ideal: p*m/(m+p-1); of ideal here: "
          "of the ideal with the stages' overlapped passes as slow as that round's "
          "data-parallel devices (ideal_here)")
    print(f"{'schedule':>8} {'m':>2} {'ms/step':>8}  {'vs 1 device':^14}  {'vs m=1':^14}  "
          f"{'ideal':>5}  {'of ideal':^14}  {'of ideal here':^14}")
    results = []
    for (schedule, m), rounds in times.items():
        ideal = STAGES * m / (m + STAGES - 1)
        speedups = [b / t for b, t in zip(baseline, rounds)]
        speedup = spread(speedups)
        over_first = spread([f / t for f, t in zip(times[FIRST], rounds)])
        of_ideal = tuple(value / ideal for value in speedup)
        of_ideal_here = spread(
            [s / ideal_here(m, d / STAGES) for s, d in zip(speedups, devices_speedup)]
        )
        print(f"{schedule:>8} {m:>2} {statistics.median(rounds) * 1e3:>8.1f}  {_row(speedup)}  "
              f"{_row(over_first)}  {ideal:>5.2f}  {_row(of_ideal, '>4.0%')}  "
              f"{_row(of_ideal_here, '>4.0%')}")
        results += verdicts(schedule, m, speedup, of_ideal, of_ideal_here)
    print("\n".join(results))


def ideal_here(m: int, efficiency: float) -> float:
    """The ideal speed-up of the pipeline on devices that each run at
    `efficiency` of their lone speed while others run too.

    A pass of one micro-batch on one stage takes a slot; in slot t of a
    phase (forward or backward), min(t, p, m, m + p - t) stages run at once.
    A slot where one stage runs takes 1, one where several run 1 /
    efficiency (exact for 2 stages; for more it assumes that 2 stages at once
    slow down as much as all p). With efficiency 1 this is p*m/(m+p-1).
    """
    slots = m + STAGES - 1
    time = sum(
        1.0 if min(t, STAGES, m, m + STAGES - t) == 1 else 1.0 / efficiency
        for t in range(1, slots + 1)
    )
    return STAGES * m / time


def verdicts(
    schedule: str, m: int, speedup: tuple, of_ideal: tuple, of_ideal_here: tuple
) -> list[str]:
    """The `RESULT` lines of one configuration: the m=1 pipeline against one
    device (~1.00 when the baseline is comparable), and m = 8 against the
    ideal, plain and scaled by what this machine's devices deliver. Each
    judges the median over the rounds."""
    if (schedule, m) == FIRST:
        low, high = M1_RANGE
        met = low <= speedup[1] <= high
        return [result_line("m=1 pipeline / one device", speedup, f"{low:.2f}-{high:.2f}", met)]
    if m == MICROBATCHES[-1]:
        return [
            result_line(f"speed-up / ideal, {schedule}, m={m}", of_ideal, f">={TARGET:.2f}",
                        of_ideal[1] >= TARGET),
            result_line(f"speed-up / ideal on this machine's devices, {schedule}, m={m}",
                        of_ideal_here, f">={TARGET:.2f}", of_ideal_here[1] >= TARGET),
        ]
    return []


def _row(values: tuple[float, ...], spec: str = "4.2f") -> str:
    return " ".join(format(value, spec) for value in values)


def result_line(measure: str, values: tuple, target: str, met: bool) -> str:
    """A `RESULT` line, which `bench/run_all.py` reads: the median over the
    rounds, which `met` judges, with the min and max in the measure."""
    low, median, high = values
    return (f'RESULT measure="{measure} (median of rounds; min {low:.2f}, max {high:.2f})" '
            f"ratio={median:.2f} target={target} status={'met' if met else 'missed'}")


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
