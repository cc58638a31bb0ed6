"""tfmp on TensorFlow against Keras's own model parallelism on JAX.

Trains the `tfmp demo` Transformer LM (`tfmp.demo.build_transformer_lm`, here
vocabulary 512, sequence 32, width 128, 8 heads, FFN 512; Adam, batch 32 of
`next_token_data`) on a ("batch", "model") = 2x4 mesh of 8 simulated CPU
devices, split by the same rules (`tfmp.demo.MEGATRON_RULES`), two ways in one
run of this script:

- JAX: `keras.distribution.ModelParallel` with a `keras.distribution.LayoutMap`
  (KERAS_BACKEND=jax, XLA_FLAGS=--xla_force_host_platform_device_count=8);
- TF: `tfmp.ModelParallelStrategy` (KERAS_BACKEND=tensorflow,
  `tfmp.simulate_devices(8)`).

Keras fixes its backend per process, so each side runs in a subprocess of this
script (`--side jax` / `--side tf`) that prints JSON; the parent prints:

1. step time: median step time of tfmp / of JAX. Target: <= 1.00.
2. memory: elements of parameters + optimizer variables on the fullest
   device, tfmp (`tfmp.inspect.summary.placements`) / JAX (the addressable
   shards of every model and optimizer variable). Target: <= 1.00. Elements,
   not bytes, because Keras itself picks the optimizer's step counter's dtype
   per backend (int64 on TensorFlow, int32 on JAX): the bytes are printed too,
   with every variable whose bytes differ and why.
3. the loss of every step on both sides, side by side, and the largest
   difference. With Adam (the default) the curves agree at step 1 and then
   part: Keras's TF backend hands Adam the embedding's gradient as
   `tf.IndexedSlices` and squares it row by row without first summing the rows
   of repeated token ids, so its second moment (and update) differs from the
   dense one JAX uses. Plain Keras on TF gives tfmp's losses. With
   `--optimizer sgd`, which is linear in the gradient, the curves agree.

Method: the first subprocess builds the model with seed 0 and saves its
weights to a temporary `.weights.h5`; every run loads that file, so both sides
start from the same weights (checked: each side prints a fingerprint of its
initial weights) and train on the same batches in the same order. The parent
also checks that every variable got the same layout on both sides. Keras 3's
`LayoutMap` matches keys with `re.fullmatch`, tfmp's with `re.search`, so on
JAX each rule `r` is given as `.*(?:r).*`, which matches the same paths.

Threads: `tfmp.simulate_devices(8)` sets TensorFlow's intra-op threads to
max(1, cores // 8) (1 on a machine of up to 15 cores) unless the program set
them; the TF side prints the number. JAX keeps XLA's defaults (its single-
threaded Eigen, `--xla_cpu_multi_thread_eigen=false`, was not faster here).

A step's time is the gap between consecutive `on_train_batch_end` calls, after
reading the step's loss (which waits for the step): it includes feeding the
batch. A warm-up `fit` per process traces/compiles the step first. Both sides
compile with Keras's defaults (`jit_compile="auto"`). The sides run in
alternating order over rounds (fresh processes each time) to cancel drift on a
shared machine. Per-step losses are recovered from Keras's running epoch mean
(`k * mean_k - (k - 1) * mean_{k-1}`), good to about 1e-5.

Usage (from the repository root; needs `pip install "jax[cpu]"`):

    python bench/compare_jax.py                # 5 warm-up + 40 steps x 2 rounds
    python bench/compare_jax.py --quick        # the tiny demo LM: a smoke run
    python bench/compare_jax.py --steps 60 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

SEED = 0
MESH_SHAPE = (2, 4)
MESH_AXES = ("batch", "model")
NUM_DEVICES = MESH_SHAPE[0] * MESH_SHAPE[1]
DROPPED_GAPS = 1  # per timed fit: the first gap after `fit` starts
STEP_TARGET = 1.00
MEMORY_TARGET = 1.00
SIDES = ("jax", "tf")


@dataclasses.dataclass(frozen=True)
class Size:
    """The LM's sizes (arguments of `build_transformer_lm`) and the batch size."""

    vocab_size: int
    seq_len: int
    d_model: int
    num_heads: int
    ffn_dim: int
    batch: int

    def model_kwargs(self) -> dict:
        kwargs = dataclasses.asdict(self)
        del kwargs["batch"]
        return kwargs


FULL = Size(vocab_size=512, seq_len=32, d_model=128, num_heads=8, ffn_dim=512, batch=32)
QUICK = Size(vocab_size=64, seq_len=8, d_model=32, num_heads=8, ffn_dim=64, batch=32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke run")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 40; quick: 8)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per run (default 5; quick: 2)")
    parser.add_argument("--rounds", type=int, help="runs of each side (default 2; quick: 1)")
    parser.add_argument(
        "--optimizer", choices=("adam", "sgd"), default="adam",
        help="adam (default) or sgd, whose losses agree between the sides (see above)",
    )
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)  # initial weights file
    args = parser.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 40)
    args.warmup = args.warmup or (2 if args.quick else 5)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.size = QUICK if args.quick else FULL
    return args


# --- one side, in its own process --------------------------------------------


def run_side(args: argparse.Namespace) -> dict:
    """Builds, (loads or saves the initial weights), trains; returns the results."""
    import keras
    import numpy as np

    from tfmp.demo import build_transformer_lm, next_token_data

    assert keras.backend.backend() == {"jax": "jax", "tf": "tensorflow"}[args.side]
    size = args.size
    side = _jax_side if args.side == "jax" else _tf_side
    scope, layouts_of, per_device_of, per_variable_of = side()
    keras.utils.set_random_seed(SEED)
    with scope:
        model = build_transformer_lm(**size.model_kwargs())
        if os.path.exists(args.init):
            model.load_weights(args.init)
        else:
            model.save_weights(args.init)
        optimizer = (
            keras.optimizers.Adam(1e-3) if args.optimizer == "adam"
            else keras.optimizers.SGD(0.1, momentum=0.9)
        )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    initial = model.get_weights()
    fingerprint = [
        float(sum(np.sum(w, dtype="float64") for w in initial)),
        float(sum(np.sum(np.square(w, dtype="float64")) for w in initial)),
    ]
    x, y = next_token_data(
        (args.warmup + args.steps) * size.batch, size.seq_len, size.vocab_size, seed=SEED
    )
    split = args.warmup * size.batch
    warm = StepRecorder()
    model.fit(x[:split], y[:split], batch_size=size.batch, shuffle=False, verbose=0,
              callbacks=[warm])
    timed = StepRecorder()
    model.fit(x[split:], y[split:], batch_size=size.batch, shuffle=False, verbose=0,
              callbacks=[timed])
    per_device = per_device_of(model)
    return {
        "side": args.side,
        "backend": keras.backend.backend(),
        "jit_compile": bool(model.jit_compile),
        "step_s": np.diff(timed.ends)[DROPPED_GAPS:].tolist(),
        "losses": warm.step_losses() + timed.step_losses(),
        "max_bytes": max(total["bytes"] for total in per_device.values()),
        "max_elements": max(total["elements"] for total in per_device.values()),
        "variables": per_variable_of(model),
        "layouts": layouts_of(model),
        "fingerprint": fingerprint,
        "intra_op_threads": _intra_op_threads(args.side),
    }


def _intra_op_threads(side: str) -> int | None:
    """TF's intra-op threads on the TF side (`tfmp.simulate_devices(8)` sets
    max(1, cores // 8) unless the program set them); None on JAX."""
    if side != "tf":
        return None
    import tensorflow as tf

    return tf.config.threading.get_intra_op_parallelism_threads()


class StepRecorder:
    """A Keras callback (made on first use, once Keras is imported): the time
    at the end of every batch, after reading its loss, and the running loss."""

    def __new__(cls):
        import keras

        class _Recorder(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.ends: list[float] = []
                self.means: list[float] = []

            def on_train_batch_end(self, batch, logs=None):
                self.means.append(float(logs["loss"]))  # waits for the step
                self.ends.append(time.perf_counter())

            def step_losses(self) -> list[float]:
                """Each step's loss, from the running means of the epoch."""
                return [
                    k * mean - (k - 1) * previous
                    for k, (mean, previous) in enumerate(
                        zip(self.means, [0.0] + self.means[:-1]), start=1
                    )
                ]

        return _Recorder()


def _jax_side():
    """The scope to build in, and per-variable layouts / per-device bytes, on JAX."""
    import contextlib

    import jax
    import keras

    from tfmp.demo import MEGATRON_RULES

    mesh = keras.distribution.DeviceMesh(MESH_SHAPE, MESH_AXES, jax.devices()[:NUM_DEVICES])
    layout_map = keras.distribution.LayoutMap(mesh)
    for rule, axes in MEGATRON_RULES.items():
        # Keras matches keys with re.fullmatch, tfmp with re.search.
        layout_map[f".*(?:{rule}).*"] = axes
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )

    def variables(model):
        return list(model.variables) + list(model.optimizer.variables)

    def layouts(model) -> dict:
        return {
            v.path: _axes(tuple(v.value.sharding.spec), len(v.shape))
            for v in model.variables
        }

    def per_device(model) -> dict:
        totals: dict[str, dict[str, int]] = {}
        for variable in variables(model):
            for shard in variable.value.addressable_shards:
                total = totals.setdefault(str(shard.device), {"bytes": 0, "elements": 0})
                total["bytes"] += shard.data.nbytes
                total["elements"] += shard.data.size
        return totals

    def per_variable(model) -> dict:
        return {
            v.path: {
                "elements": max(shard.data.size for shard in v.value.addressable_shards),
                "dtype": v.dtype,
                "itemsize": v.value.dtype.itemsize,
            }
            for v in variables(model)
        }

    return contextlib.nullcontext(), layouts, per_device, per_variable


def _tf_side():
    """The scope to build in, and per-variable layouts / per-device bytes, with tfmp."""
    import tfmp
    from tfmp.demo import megatron_layout_map
    from tfmp.inspect.summary import placements

    devices = tfmp.simulate_devices(NUM_DEVICES)
    mesh = tfmp.DeviceMesh(MESH_SHAPE, MESH_AXES, devices)
    strategy = tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh))

    def layouts(model) -> dict:
        return {
            row.path: _axes(row.axes or (), len(row.shape))
            for row in placements(model)
            if not row.is_slot
        }

    def per_device(model) -> dict:
        totals: dict[str, dict[str, int]] = {}
        for row in placements(model):
            for device in row.devices:
                total = totals.setdefault(device, {"bytes": 0, "elements": 0})
                total["bytes"] += row.shard_bytes
                total["elements"] += math.prod(row.shard_shape)
        return totals

    def per_variable(model) -> dict:
        dtypes = {v.path: v.dtype for v in model.variables + model.optimizer.variables}
        return {
            row.path: {
                "elements": math.prod(row.shard_shape),
                "dtype": dtypes[row.path],
                "itemsize": row.itemsize,
            }
            for row in placements(model)
        }

    return strategy.scope(), layouts, per_device, per_variable


def _variable_differences(jax_vars: dict, tf_vars: dict) -> list[str]:
    """A line for every variable whose largest shard differs between the sides."""
    lines = []
    for path in sorted(set(jax_vars) | set(tf_vars)):
        jax_var, tf_var = jax_vars.get(path), tf_vars.get(path)
        if jax_var == tf_var:
            continue
        if jax_var and tf_var and jax_var["elements"] == tf_var["elements"]:
            count = tf_var["elements"]
            lines.append(
                f"{path}: {count:,} element{'s' * (count != 1)} per device on both sides; "
                f"Keras stores it as {tf_var['dtype']} on TensorFlow, {jax_var['dtype']} on JAX"
            )
        else:
            lines.append(f"{path} per device differs: tf {tf_var}, jax {jax_var}")
    return lines


def _axes(spec: tuple, rank: int) -> list:
    """A layout as one mesh axis name (or None) per dimension."""
    spec = list(spec) + [None] * (rank - len(spec))
    return [axis if axis is None or isinstance(axis, str) else "+".join(axis) for axis in spec]


# --- the parent: both sides, side by side ------------------------------------


def side_command(args: argparse.Namespace, side: str, init: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--side", side, "--init", init,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--optimizer", args.optimizer]
    return command + (["--quick"] if args.quick else [])


def side_env(side: str) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if side == "jax":
        flags = env.get("XLA_FLAGS", "")
        env.update(
            KERAS_BACKEND="jax",
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={NUM_DEVICES}".strip(),
        )
    else:
        env["KERAS_BACKEND"] = "tensorflow"
    return env


def run_subprocess(args: argparse.Namespace, side: str, init: str) -> dict:
    started = time.perf_counter()
    process = subprocess.run(
        side_command(args, side, init), env=side_env(side), capture_output=True, text=True
    )
    if process.returncode != 0:
        sys.stderr.write(process.stderr[-5000:])
        sys.exit(f"compare_jax: the {side} side failed (exit {process.returncode}).")
    result = json.loads(process.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def measure(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every side's results, one per round, in alternating order."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as folder:
        init = os.path.join(folder, "initial.weights.h5")
        for round_index in range(args.rounds):
            for side in SIDES if round_index % 2 == 0 else SIDES[::-1]:
                runs[side].append(run_subprocess(args, side, init))
    return runs


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    jax_runs, tf_runs = runs["jax"], runs["tf"]
    versions = _versions()
    size = args.size
    print(
        f"model: tfmp demo Transformer LM {size.model_kwargs()}, {args.optimizer}, batch "
        f"{size.batch}; 2x4 ('batch', 'model') mesh of 8 CPU devices; {args.rounds} "
        f"round(s) x {args.warmup} warm-up + {args.steps} timed steps per side"
    )
    print(f"versions: {versions}; jit_compile: jax "
          f"{jax_runs[0]['jit_compile']}, tf {tf_runs[0]['jit_compile']}; TF intra-op "
          f"threads: {tf_runs[0].get('intra_op_threads')} (of {os.cpu_count()} cores)")
    _check_same_start_and_layouts(jax_runs[0], tf_runs[0])
    print()

    jax_ms = 1e3 * statistics.median(t for run in jax_runs for t in run["step_s"])
    tf_ms = 1e3 * statistics.median(t for run in tf_runs for t in run["step_s"])
    step_ratio = tf_ms / jax_ms
    per_round = [
        statistics.median(t["step_s"]) / statistics.median(j["step_s"])
        for t, j in zip(tf_runs, jax_runs)
    ]
    jax_bytes, tf_bytes = jax_runs[0]["max_bytes"], tf_runs[0]["max_bytes"]
    jax_elements, tf_elements = jax_runs[0]["max_elements"], tf_runs[0]["max_elements"]
    memory_ratio = tf_elements / jax_elements
    print("| measure | tfmp (TF) | Keras (JAX) | ratio | per-round ratios | target | result |")
    print("|---|---:|---:|---:|---|---:|---|")
    print(
        f"| median step ms | {tf_ms:.2f} | {jax_ms:.2f} | {step_ratio:.3f} | "
        f"{min(per_round):.3f}-{max(per_round):.3f} | <= {STEP_TARGET:.2f} | "
        f"{_verdict(step_ratio <= STEP_TARGET)} |"
    )
    print(
        f"| elements on fullest device (params + optimizer) | {tf_elements:,} | "
        f"{jax_elements:,} | {memory_ratio:.6f} | | <= {MEMORY_TARGET:.2f} | "
        f"{_verdict(memory_ratio <= MEMORY_TARGET)} |"
    )
    print(
        f"| bytes on fullest device (params + optimizer) | {tf_bytes:,} | {jax_bytes:,} "
        f"| {tf_bytes / jax_bytes:.6f} | | - | |"
    )
    if step_ratio > 1:
        print(f"\ntfmp's step is {100 * (step_ratio - 1):.0f}% slower than JAX's.")
    for line in _variable_differences(jax_runs[0]["variables"], tf_runs[0]["variables"]):
        print(line)

    print("\nloss per step (steps 1-" f"{args.warmup} are the warm-up), round 1:\n")
    print("| step | loss_jax | loss_tf | difference |")
    print("|---:|---:|---:|---:|")
    pairs = list(zip(jax_runs[0]["losses"], tf_runs[0]["losses"]))
    for step, (loss_jax, loss_tf) in enumerate(pairs, start=1):
        print(f"| {step} | {loss_jax:.5f} | {loss_tf:.5f} | {loss_tf - loss_jax:+.1e} |")
    largest = max(abs(a - b) for a, b in pairs)
    repeat = all(
        run["losses"] == runs[side][0]["losses"] for side in SIDES for run in runs[side]
    )
    print(f"\nlargest loss difference: {largest:.2e}; later rounds repeat round 1's "
          f"losses exactly: {repeat}")
    if args.optimizer == "adam" and largest > 1e-3:
        print("(Keras's TF backend applies Adam to the embedding's sparse gradient "
              "without first summing repeated token ids, JAX to a dense one: the "
              "curves part from step 2 on. --optimizer sgd compares the sides on "
              "equal terms.)")

    print()
    print(f'RESULT measure="step time tfmp/JAX" ratio={step_ratio:.3f} '
          f"target=<={STEP_TARGET:.2f} status={_status(step_ratio <= STEP_TARGET)}")
    print(f'RESULT measure="memory per device tfmp/JAX (elements)" ratio={memory_ratio:.6f} '
          f"target=<={MEMORY_TARGET:.2f} status={_status(memory_ratio <= MEMORY_TARGET)}")


def _check_same_start_and_layouts(jax_run: dict, tf_run: dict) -> None:
    a, b = jax_run["fingerprint"], tf_run["fingerprint"]
    same_start = all(abs(x - y) <= 1e-6 * max(1.0, abs(x)) for x, y in zip(a, b))
    different = sorted(
        path for path in set(jax_run["layouts"]) | set(tf_run["layouts"])
        if jax_run["layouts"].get(path) != tf_run["layouts"].get(path)
    )
    print(f"same initial weights: {same_start} (sum, sum of squares: jax {a[0]:.6f}, "
          f"{a[1]:.6f}; tf {b[0]:.6f}, {b[1]:.6f}); same layouts: {not different}")
    for path in different:
        print(f"  layout of {path}: jax {jax_run['layouts'].get(path)}, "
              f"tf {tf_run['layouts'].get(path)}")
    if not same_start or different:
        sys.exit("compare_jax: the two sides do not train the same model.")


def _versions() -> str:
    from importlib import metadata

    names = ("tensorflow", "keras", "jax", "jaxlib")
    return ", ".join(f"{name} {metadata.version(name)}" for name in names)


def _verdict(met: bool) -> str:
    return "pass" if met else "FAIL"


def _status(met: bool) -> str:
    return "met" if met else "missed"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.side:
        print(json.dumps(run_side(args)))
        return
    report(args, measure(args))


if __name__ == "__main__":
    main()
