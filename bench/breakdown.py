"""Where the time of one training step goes: tfmp, plain Keras, Keras on JAX.

Trains the `tfmp demo` Transformer LM of bench/compare_jax.py (vocabulary 512,
sequence 32, width 128, 8 heads, FFN 512; Adam, batch 32 of `next_token_data`;
split by `tfmp.demo.MEGATRON_RULES`) and splits one `fit` step into its parts,
for these configurations (8 simulated CPU devices, all from the same weights):

- TF process (`tfmp.simulate_devices(8)`): plain Keras on one device, with
  `jit_compile=False` and `True`; tfmp on a 1x1 and a 2x4 ("batch", "model")
  mesh, and on 2x4 with `jit_compile=True` (`--with-8x1`: also 8x1);
- JAX process: Keras on JAX, `keras.distribution.ModelParallel` on the same
  2x4 mesh and layouts (`jit_compile="auto"`, which is XLA on JAX).

Method. After a warm-up fit and one untimed fit, every round runs per
configuration a plain `fit` (its step time: the gap between consecutive
`on_train_batch_end` calls, as bench/compare_jax.py times it) and an
instrumented `fit`, whose train function is wrapped to time, in the same
steps:

- input: `next()` on fit's iterator, i.e. what the step waits for its batch
  (tfmp: the wait for the batch, which its iterator cuts into device shards
  one step ahead in a thread, and the pack of those shards onto the mesh; JAX:
  the numpy batch and Keras' `_distribute_data`). The placing itself is timed
  on its own (tfmp: the cut);
- step fn, Python + dispatch: Keras' train function until it returns. tfmp
  (DTensor) and JAX dispatch asynchronously; plain Keras on TF returns when the
  step ends, so there the split comes from a TF profiler trace
  (`tf.profiler.experimental`, xplane parsed here);
- step fn, execution: from the return until the loss is ready on every device;
- fit loop: the rest of the step gap (Keras' loop, callbacks, logs).

Two estimates are shown inside the execution, not added: the step's
collectives (`tfmp.comm_report`: count, bytes, mesh axes) replayed alone as
all-reduces in one mesh function, less the same function without them; and
the mesh cost, step fn minus tfmp 1x1's. Medians over the steps of all rounds;
the rounds alternate the order of the configurations. A profile table gives
thread-milliseconds per step by kind (summed over threads: with 8 devices on
a few cores the sums exceed the wall time). jit_compile: the warm-up losses
against plain Keras (same weights, same batches), and whether the profile
shows an XLA executable. `use_xla_spmd` is tried on the CPU mesh.

Output: tables and informational `RESULT` lines (`target=- status=-`: the
issue sets no target for a breakdown).

Usage (from the repository root; the JAX part needs `pip install "jax[cpu]"`
and is skipped without it):

    python bench/breakdown.py             # 5 warm-up + 10 steps x 4 rounds
    python bench/breakdown.py --quick     # tiny LM, keras + tfmp 2x4 + JAX, 1 round
    python bench/breakdown.py --first-step  # the first step's parts (bench/first_step.py)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from compare_jax import FULL, QUICK  # the same LM, sizes and batches

SEED = 0
NUM_DEVICES = 8
MESH_AXES = ("batch", "model")
DROPPED_GAPS = 1  # per timed fit: the first gap after `fit` starts
PROFILED_STEPS = 5


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    mesh: tuple[int, int] | None  # None: plain Keras, no strategy
    jit: bool


def tf_configs(quick: bool, with_8x1: bool = False) -> list[Config]:
    configs = [
        Config("keras", None, False),
        Config("keras jit", None, True),
        Config("tfmp 1x1", (1, 1), False),
        Config("tfmp 8x1", (8, 1), False),
        Config("tfmp 2x4", (2, 4), False),
        Config("tfmp 2x4 jit", (2, 4), True),
    ]
    if quick:
        configs = [c for c in configs if c.name in ("keras", "tfmp 2x4")]
    elif not with_8x1:
        configs = [c for c in configs if c.name != "tfmp 8x1"]
    return configs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny LM, 1 round: a smoke run")
    parser.add_argument("--steps", type=int, help="timed steps per fit and round (10; quick 6)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per configuration (5; quick 2)")
    parser.add_argument("--rounds", type=int, help="rounds (4; quick 1)")
    parser.add_argument("--no-jax", action="store_true", help="skip Keras on JAX")
    parser.add_argument("--with-8x1", action="store_true",
                        help="also tfmp on an 8x1 mesh (data parallel only; about 30 s more)")
    parser.add_argument("--first-step", action="store_true",
                        help="instead: the first step's parts and each epoch's cost, for a convnet "
                        "and a BiLSTM (bench/first_step.py)")
    parser.add_argument("--side", choices=("tf", "jax"), help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)  # write the raw results (JSON)
    parser.add_argument("--load", help=argparse.SUPPRESS)  # report from raw results
    args = parser.parse_args(argv)
    args.steps = args.steps or (6 if args.quick else 10)
    args.warmup = args.warmup or (2 if args.quick else 5)
    args.rounds = args.rounds or (1 if args.quick else 4)
    args.size = QUICK if args.quick else FULL
    return args


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


class StepRecorder:
    """Keras callback (made once Keras is imported): time at each batch end,
    after reading its loss, and the running mean loss."""

    def __new__(cls):
        import keras

        class _Recorder(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.ends: list[float] = []
                self.means: list[float] = []

            def on_train_batch_end(self, batch, logs=None):
                self.means.append(float(logs["loss"]))  # waits for the step
                self.ends.append(time.perf_counter())

            def gaps(self) -> list[float]:
                return [b - a for a, b in zip(self.ends, self.ends[1:])][DROPPED_GAPS:]

            def step_losses(self) -> list[float]:
                return [
                    k * mean - (k - 1) * previous
                    for k, (mean, previous) in enumerate(
                        zip(self.means, [0.0] + self.means[:-1]), start=1
                    )
                ]

        return _Recorder()


def _data(args):
    from tfmp.demo import next_token_data

    size = args.size
    x, y = next_token_data(
        (args.warmup + args.steps) * size.batch, size.seq_len, size.vocab_size, seed=SEED
    )
    split = args.warmup * size.batch
    return (x[:split], y[:split]), (x[split:], y[split:])


def _adapter(x, y, batch):
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    return ArrayDataAdapter(x, y, batch_size=batch, shuffle=False)


# --- the TF process ------------------------------------------------------------


def run_tf(args: argparse.Namespace) -> dict:
    import tfmp

    devices = tfmp.simulate_devices(NUM_DEVICES)
    import keras
    import tensorflow as tf

    from tfmp.demo import build_transformer_lm, megatron_layout_map
    from tfmp.strategy.placement import pack

    size = args.size
    (xw, yw), (xt, yt) = _data(args)
    results: dict = {}
    state: dict = {}
    reference_weights = None
    for config in tf_configs(args.quick, args.with_8x1):
        strategy = None
        if config.mesh is not None:
            count = config.mesh[0] * config.mesh[1]
            mesh = tfmp.DeviceMesh(config.mesh, MESH_AXES, devices[:count])
            strategy = tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh))
        keras.utils.set_random_seed(SEED)
        scope = strategy.scope() if strategy else _null()
        with scope:
            model = build_transformer_lm(**size.model_kwargs())
            if reference_weights is None:
                reference_weights = model.get_weights()
                model.save_weights(args.init)
            else:
                model.load_weights(args.init)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=config.jit,
            )
        warm = StepRecorder()
        error = None
        try:
            model.fit(xw, yw, batch_size=size.batch, shuffle=False, verbose=0, callbacks=[warm])
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        results[config.name] = {
            "jit_compile": bool(model.jit_compile),
            "losses": warm.step_losses(),
            "error": error,
            "plain_fit": [], "fit": [], "next": [], "pack": [], "call": [], "step": [],
            "execution": [], "rest": [],
        }
        if error:
            continue
        # A second, untimed fit on the timed batches: the first fit after the
        # warm-up ran slower in median than later ones (tfmp 1x1: 86 against
        # 33-35 ms per step; plain Keras with jit_compile too).
        model.fit(xt, yt, batch_size=size.batch, shuffle=False, verbose=0)
        dataset = _adapter(xt, yt, size.batch).get_tf_dataset()
        with tf.device("CPU:0"):
            host_batches = list(dataset)
        placer = strategy.extended.placer if strategy else None
        placed = [pack(placer.split_batch(b, is_last_batch=False)) for b in host_batches] \
            if placer else host_batches
        state[config.name] = (model, dataset, host_batches, placer, placed, strategy)

    for round_index in range(args.rounds):
        names = list(state) if round_index % 2 == 0 else list(state)[::-1]
        for name in names:
            model, _, _, placer, _, _ = state[name]
            result = results[name]
            if not args.quick:
                timed = StepRecorder()
                model.fit(xt, yt, batch_size=size.batch, shuffle=False, verbose=0,
                          callbacks=[timed])
                result["plain_fit"] += timed.gaps()
            with _instrumented_tf(model, placer) as parts:
                timed = StepRecorder()
                model.fit(xt, yt, batch_size=size.batch, shuffle=False, verbose=0,
                          callbacks=[timed])
            _add_parts(result, timed.gaps(), parts)

    results["_xla_spmd"] = _try_xla_spmd(devices)
    # tfmp.simulate_devices(8) sets it to max(1, cores // 8) unless set before.
    results["_intra_op_threads"] = tf.config.threading.get_intra_op_parallelism_threads()
    for name, (model, _, _, _, placed, strategy) in state.items():
        results[name]["profile"] = _profile_tf(model, placed[0])
        if strategy is not None and strategy.mesh.dtensor_mesh.num_local_devices() > 1:
            results[name]["collectives"] = _replay_collectives(model, strategy, args.rounds)
    return results


def _try_xla_spmd(devices) -> str:
    """What DTensor says to a mesh of these CPU devices with `use_xla_spmd`."""
    from tensorflow.experimental import dtensor

    try:
        dtensor.create_mesh([("batch", 2), ("model", 4)], devices=devices, use_xla_spmd=True)
    except Exception as exc:  # noqa: BLE001 - reported
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _add_parts(result: dict, gaps: list[float], parts: dict) -> None:
    """Appends a timed fit's step gaps and the parts of the same steps."""
    n = len(gaps)
    if not n:
        return
    steps = {key: values[-n:] for key, values in parts.items()}
    result["fit"] += gaps
    for key, values in steps.items():
        result[key] += values
    # Per-step differences (medians of differences, not differences of medians).
    result["execution"] += [a - b for a, b in zip(steps["step"], steps["call"])]
    result["rest"] += [g - a - b for g, a, b in zip(gaps, steps["next"], steps["step"])]


@contextlib.contextmanager
def _instrumented_tf(model, placer):
    """Times the parts of every step of the `fit`s in the block.

    The model's train function is replaced by one that takes the batch from
    fit's iterator itself (`next`: the host read, and for tfmp the pack onto
    the mesh; the cut into shards before it is timed on its own), calls Keras' train function on it (`call`:
    until it returns) and waits for the loss on every device (`step`: from the
    call to the loss). Plain Keras then reads its batch eagerly rather than
    inside its step graph.
    """
    from tensorflow.experimental import dtensor

    parts: dict = {"next": [], "pack": [], "call": [], "step": []}
    original = model.train_function
    if placer is not None:
        split_batch = placer.split_batch

        def timed_split_batch(*args, **kwargs):
            start = time.perf_counter()
            shards = split_batch(*args, **kwargs)
            parts["pack"].append(time.perf_counter() - start)
            return shards

        placer.split_batch = timed_split_batch

    def train_function(iterator):
        start = time.perf_counter()
        batch = next(iterator)
        fed = time.perf_counter()
        logs = original([batch])
        returned = time.perf_counter()
        loss = logs["loss"]
        for component in dtensor.unpack(loss) if dtensor.is_dtensor(loss) else [loss]:
            component.numpy()
        done = time.perf_counter()
        parts["next"].append(fed - start)
        parts["call"].append(returned - fed)
        parts["step"].append(done - fed)
        return logs

    model.train_function = train_function
    try:
        yield parts
    finally:
        model.train_function = original
        if placer is not None:
            del placer.split_batch


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _profile_tf(model, batch) -> dict:
    """Thread-ms per step by kind, from a TF profiler trace of the step function."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(PROFILED_STEPS):
            _sync(model.train_function([batch])["loss"])
        tf.profiler.experimental.stop()
        path = sorted(glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb"))[-1]
        space = xplane_pb2.XSpace()
        with open(path, "rb") as file:
            space.ParseFromString(file.read())
    totals: collections.Counter = collections.Counter()
    xla = False
    for plane in space.planes:
        names = plane.event_metadata
        for line in plane.lines:
            thread = line.name.split("/")[0]
            for event in line.events:
                name = names[event.metadata_id].name
                ms = event.duration_ps / 1e9
                if "CpuExecutable" in name or "ThunkExecutor" in name or "XlaRun" in name:
                    xla = True
                if thread == "python":
                    if name == "one_step_on_data":
                        totals["python_call"] += ms
                    elif name == "TFE_Py_ExecuteCancelable":
                        totals["c_call"] += ms
                    elif name in ("EagerKernelExecute",):
                        totals["python_waits_execution"] += ms
                    elif name == "CpuExecutable::ExecuteAsyncOnStream":
                        totals["xla_executable"] += ms
                elif thread == "collective_ops":
                    if _op_type(name):
                        totals["collective_completion"] += ms
                elif thread.startswith("tf_Compute") or thread.startswith("tf_inter"):
                    kind = _op_type(name)
                    if name == "ExecutorState::Process":
                        totals["executor_busy"] += ms
                    elif name == "CollectiveOpV2Kernel::Run" or (kind or "").startswith("Collective"):
                        totals["collective_launch"] += ms
                    elif kind and kind not in ("StatefulPartitionedCall", "PartitionedCall"):
                        totals["kernels"] += ms
    per_step = {key: value / PROFILED_STEPS for key, value in totals.items()}
    python = per_step.get("python_call", 0.0) - per_step.get("c_call", 0.0)
    dispatch = per_step.get("c_call", 0.0) - per_step.get("python_waits_execution", 0.0) \
        - per_step.get("xla_executable", 0.0)
    return {
        "python": python,
        "dispatch": max(dispatch, 0.0),
        "kernels": per_step.get("kernels", 0.0),
        "collective_launch": per_step.get("collective_launch", 0.0),
        "executor": max(
            per_step.get("executor_busy", 0.0) - per_step.get("kernels", 0.0)
            - per_step.get("collective_launch", 0.0), 0.0),
        "collective_completion": per_step.get("collective_completion", 0.0),
        "xla_executable": per_step.get("xla_executable", 0.0),
        "xla": xla,
    }


def _op_type(event_name: str) -> str | None:
    """`scope/op:Type` -> `Type` (TF op events); None for other events."""
    if "::" in event_name or ":" not in event_name:
        return None
    return event_name.rsplit(":", 1)[1]


def _replay_collectives(model, strategy, rounds: int) -> dict:
    """Wall ms of the step's collectives (tfmp.comm_report) run alone."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    import tfmp
    from tfmp.strategy.placement import to_layout

    report = tfmp.comm_report(model, print_fn=lambda _: None)
    mesh = strategy.mesh.dtensor_mesh
    sharded, replicated = [], []
    for collective in report.collectives:
        axes = tuple(collective.axes)
        if not axes or collective.bytes <= 0:
            continue
        length = max(1, collective.bytes // 4)
        shape = [mesh.dim_size(axis) for axis in axes] + [length]
        value = np.ones(shape, np.float32)
        sharded.append(to_layout(value, dtensor.Layout(list(axes) + [dtensor.UNSHARDED], mesh)))
        replicated.append(to_layout(value, dtensor.Layout.replicated(mesh, len(shape))))
    if not sharded:
        return {"count": 0, "bytes": 0, "ms": 0.0}

    @tf.function
    def reduce_all(values):
        # A sum over the split dimensions: DTensor all-reduces over those axes.
        outputs = [tf.reduce_sum(v, axis=list(range(v.shape.rank - 1))) for v in values]
        return tf.add_n([o[0] for o in outputs])

    def timed(values) -> list[float]:
        for _ in range(2):
            _sync(reduce_all(values))
        times = []
        for _ in range(5 * rounds):
            start = time.perf_counter()
            _sync(reduce_all(values))
            times.append(time.perf_counter() - start)
        return times

    with_collectives, without = [], []
    for _ in range(2):
        with_collectives += timed(sharded)
        without += timed(replicated)
    return {
        "count": len(sharded),
        "bytes": int(sum(c.bytes for c in report.collectives)),
        "ms": max(_median_ms(with_collectives) - _median_ms(without), 0.0),
        "with_ms": _median_ms(with_collectives),
        "without_ms": _median_ms(without),
    }


def _sync(value) -> None:
    """Waits for a (D)Tensor on every device it lives on."""
    from tensorflow.experimental import dtensor

    for component in dtensor.unpack(value) if dtensor.is_dtensor(value) else [value]:
        component.numpy()


# --- the JAX process -------------------------------------------------------------


def run_jax(args: argparse.Namespace) -> dict:
    import jax
    import keras

    from tfmp.demo import MEGATRON_RULES, build_transformer_lm

    size = args.size
    mesh = keras.distribution.DeviceMesh((2, 4), MESH_AXES, jax.devices()[:NUM_DEVICES])
    layout_map = keras.distribution.LayoutMap(mesh)
    for rule, axes in MEGATRON_RULES.items():
        layout_map[f".*(?:{rule}).*"] = axes  # Keras: re.fullmatch; tfmp: re.search
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    keras.utils.set_random_seed(SEED)
    model = build_transformer_lm(**size.model_kwargs())
    model.load_weights(args.init)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    (xw, yw), (xt, yt) = _data(args)
    warm = StepRecorder()
    model.fit(xw, yw, batch_size=size.batch, shuffle=False, verbose=0, callbacks=[warm])
    model.fit(xt, yt, batch_size=size.batch, shuffle=False, verbose=0)  # as on TF
    result = {"jit_compile": bool(model.jit_compile), "losses": warm.step_losses(),
              "plain_fit": [], "fit": [], "next": [], "pack": [], "call": [], "step": [],
              "execution": [], "rest": []}
    for _ in range(args.rounds):
        if not args.quick:
            timed = StepRecorder()
            model.fit(xt, yt, batch_size=size.batch, shuffle=False, verbose=0,
                      callbacks=[timed])
            result["plain_fit"] += timed.gaps()
        with _instrumented_jax(model) as parts:
            timed = StepRecorder()
            model.fit(xt, yt, batch_size=size.batch, shuffle=False, verbose=0,
                      callbacks=[timed])
        _add_parts(result, timed.gaps(), parts)
    return {"keras-jax 2x4": result}


@contextlib.contextmanager
def _instrumented_jax(model):
    """As `_instrumented_tf`: `next` reads the host batch and puts it on the
    mesh (Keras' `_distribute_data`, timed on its own until the arrays are
    ready); `call` is the jitted step until it returns (JAX dispatches
    asynchronously); `step` lasts until its outputs and new state are ready."""
    import jax
    from keras.src.backend.jax import trainer

    parts: dict = {"next": [], "pack": [], "call": [], "step": []}
    original, distribute_data = model.train_function, trainer._distribute_data  # noqa: SLF001

    def timed_distribute_data(*args, **kwargs):
        start = time.perf_counter()
        placed = jax.block_until_ready(distribute_data(*args, **kwargs))
        parts["pack"].append(time.perf_counter() - start)
        return placed

    def train_function(state, iterator):
        start = time.perf_counter()
        batch = next(iterator)
        fed = time.perf_counter()
        logs, state = original(state, iter([batch]))
        returned = time.perf_counter()
        jax.block_until_ready((logs, state))
        done = time.perf_counter()
        parts["next"].append(fed - start)
        parts["call"].append(returned - fed)
        parts["step"].append(done - fed)
        return logs, state

    trainer._distribute_data = timed_distribute_data  # noqa: SLF001
    model.train_function = train_function
    try:
        yield parts
    finally:
        model.train_function = original
        trainer._distribute_data = distribute_data  # noqa: SLF001


# --- the parent ------------------------------------------------------------------


def side_command(args: argparse.Namespace, side: str, init: str) -> tuple[list[str], dict]:
    command = [sys.executable, os.path.abspath(__file__), "--side", side, "--init", init,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rounds", str(args.rounds)] + (["--quick"] if args.quick else []) \
        + (["--with-8x1"] if args.with_8x1 else [])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if side == "jax":
        flags = env.get("XLA_FLAGS", "")
        env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={NUM_DEVICES}".strip())
    else:
        env["KERAS_BACKEND"] = "tensorflow"
    return command, env


def run_sides(args: argparse.Namespace, sides: list[str], init: str) -> dict:
    """Runs each side in its own process, one after the other (the TF side
    writes the initial weights), and merges their results."""
    results = {}
    for side in sides:
        started = time.perf_counter()
        command, env = side_command(args, side, init)
        process = subprocess.run(command, env=env, capture_output=True, text=True)
        if process.returncode != 0:
            sys.stderr.write(process.stderr[-5000:])
            sys.exit(f"breakdown: the {side} side failed (exit {process.returncode}).")
        results.update(json.loads(process.stdout.strip().splitlines()[-1]))
        print(f"({side} process: {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return results


def breakdown_rows(name: str, results: dict) -> list[tuple[str, float]]:
    """(part, ms) rows of one configuration, medians over the same steps; the
    last row is the step. Rows starting with "-" are estimates inside the row
    above them, not added."""
    result = results[name]
    fit = _median_ms(result["fit"])
    step = _median_ms(result["step"])
    rows = [("input: next() on fit's iterator (the wait for the batch)", _median_ms(result["next"]))]
    if result["pack"]:
        rows.append(("- place on the mesh, per batch (JAX: inside next(); tfmp: the shards' cut, in its prefetch thread)",
                     _median_ms(result["pack"])))
        # Asynchronous dispatch: the call returns before the step ends.
        rows.append(("step fn: Python + dispatch (until the call returns)",
                     _median_ms(result["call"])))
        rows.append(("step fn: execution (compute, collectives, executor)",
                     _median_ms(result["execution"])))
    else:  # plain Keras on TF: the call returns when the step ends; split by the profile
        profile = result["profile"]
        front = profile["python"] + profile["dispatch"]
        rows.append(("step fn: Python + dispatch (profile)", front))
        rows.append(("step fn: execution (compute, collectives, executor)", step - front))
    if "collectives" in result:
        rows.append(("- of which: the step's collectives replayed alone", result["collectives"]["ms"]))
    one_device = results.get("tfmp 1x1")
    if name.startswith("tfmp") and name != "tfmp 1x1" and one_device and one_device["step"]:
        rows.append(("- of which: mesh cost (step fn - tfmp 1x1 step fn)",
                     step - _median_ms(one_device["step"])))
    rows.append(("fit loop: Keras loop, callbacks, logs (rest)", _median_ms(result["rest"])))
    rows.append(("fit step", fit))
    return rows


def report(args: argparse.Namespace, results: dict) -> None:
    from importlib import metadata

    notes = {k: v for k, v in results.items() if k.startswith("_")}
    results = {k: v for k, v in results.items() if not k.startswith("_")}

    size = args.size
    names = ("tensorflow", "keras", "jax")
    versions = ", ".join(
        f"{n} {metadata.version(n)}" for n in names if importlib.util.find_spec(n)
    )
    print(f"model: tfmp demo Transformer LM {size.model_kwargs()}, Adam, batch {size.batch}; "
          f"{args.rounds} round(s) x {args.steps} timed steps per fit, {args.warmup} warm-up")
    print(f"versions: {versions}; {NUM_DEVICES} simulated CPU devices on {os.cpu_count()} "
          f"cores (TF intra-op threads: {notes.get('_intra_op_threads', '?')}, set by "
          "tfmp.simulate_devices); ms are medians from this run only\n")
    reference = results["keras"]["losses"]
    print("| configuration | fit step ms, plain | fit step ms, timed parts | step fn ms "
          "| jit_compile | XLA ran | max loss diff vs keras (warm-up steps) |")
    print("|---|---:|---:|---:|---|---|---:|")
    for name, result in results.items():
        if result.get("error"):
            print(f"| {name} | - | - | - | {result['jit_compile']} | - | error: {result['error']} |")
            continue
        fit = _median_ms(result["fit"])
        plain = _median_ms(result["plain_fit"]) if result["plain_fit"] else fit
        step = _median_ms(result["step"])
        xla = result.get("profile", {}).get("xla", "jax" in name)
        diff = max(abs(a - b) for a, b in zip(result["losses"], reference))
        print(f"| {name} | {plain:.2f} | {fit:.2f} | {step:.2f} | {result['jit_compile']} "
              f"| {xla} | {diff:.1e} |")

    for name, result in results.items():
        if result.get("error"):
            continue
        rows = breakdown_rows(name, results)
        fit = rows[-1][1]
        print(f"\n{name}: where one fit step goes\n")
        print("| part | ms | share of fit step |")
        print("|---|---:|---:|")
        for part, ms in rows:
            print(f"| {part} | {ms:.2f} | {100 * ms / fit:.0f}% |")
        if "collectives" in result:
            c = result["collectives"]
            print(f"\ncollectives replayed: {c['count']} collectives, {c['bytes']:,} bytes/device "
                  f"(tfmp.comm_report); {c.get('with_ms', 0):.2f} ms with, "
                  f"{c.get('without_ms', 0):.2f} ms without")
    if "_xla_spmd" in notes:
        print(f"\nuse_xla_spmd=True on a 2x4 CPU mesh: {notes['_xla_spmd']}")
    profiled = {n: r["profile"] for n, r in results.items() if r.get("profile")}
    if profiled:
        print("\nprofile of the step function (TF profiler), thread-ms per step summed over "
              "threads (8 devices share the cores: sums exceed wall time)\n")
        keys = [("kernels", "op kernels (compute)"),
                ("collective_launch", "collective op kernels (launch)"),
                ("collective_completion", "collectives, start to done (incl. waits for peers)"),
                ("executor", "TF executor bookkeeping"),
                ("xla_executable", "XLA executable"),
                ("dispatch", "dispatch (eager C++ / DTensor)"),
                ("python", "Python")]
        print("| kind | " + " | ".join(profiled) + " |")
        print("|---|" + "---:|" * len(profiled))
        for key, label in keys:
            print(f"| {label} | " + " | ".join(f"{p[key]:.2f}" for p in profiled.values()) + " |")

    print()
    tfmp_name = "tfmp 2x4"
    if tfmp_name in results and not results[tfmp_name].get("error"):
        rows = dict(breakdown_rows(tfmp_name, results))
        fit = rows["fit step"]
        for part, label in (
            ("input: next() on fit's iterator (the wait for the batch)", "input wait"),
            ("- place on the mesh, per batch (JAX: inside next(); tfmp: the shards' cut, in its prefetch thread)",
             "pack per batch"),
            ("step fn: Python + dispatch (until the call returns)", "Python + dispatch"),
            ("step fn: execution (compute, collectives, executor)", "execution"),
            ("- of which: the step's collectives replayed alone", "collectives replayed alone"),
            ("- of which: mesh cost (step fn - tfmp 1x1 step fn)", "mesh cost vs 1x1"),
            ("fit loop: Keras loop, callbacks, logs (rest)", "fit loop"),
        ):
            if part in rows:
                _result(f"breakdown tfmp 2x4: {label} / fit step", rows[part] / fit)
    pairs = [("tfmp 2x4", "keras-jax 2x4", "fit step tfmp 2x4 / keras-jax 2x4", "fit"),
             ("tfmp 2x4", "keras-jax 2x4", "step fn tfmp 2x4 / keras-jax 2x4", "step"),
             ("tfmp 1x1", "keras", "step fn tfmp 1x1 / keras", "step"),
             ("tfmp 2x4 jit", "tfmp 2x4", "step fn tfmp 2x4 jit / no jit", "step"),
             ("keras jit", "keras", "step fn keras jit / no jit", "step")]
    for a, b, label, key in pairs:
        if all(n in results and not results[n].get("error") for n in (a, b)):
            _result(label, _median_ms(results[a][key]) / _median_ms(results[b][key]))


def _result(measure: str, ratio: float) -> None:
    print(f'RESULT measure="{measure}" ratio={ratio:.3f} target=- status=-')


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.first_step:
        import first_step

        first_step.main(["--quick"] if args.quick else [])
        return
    if args.side == "tf":
        print(json.dumps(run_tf(args)))
        return
    if args.side == "jax":
        print(json.dumps(run_jax(args)))
        return
    if args.load:
        with open(args.load) as file:
            report(args, json.load(file))
        return
    with tempfile.TemporaryDirectory() as folder:
        init = os.path.join(folder, "initial.weights.h5")
        sides = ["tf"]
        if not args.no_jax and importlib.util.find_spec("jax"):
            sides.append("jax")
        else:
            print("(Keras on JAX skipped: jax is not installed or --no-jax)\n")
        results = run_sides(args, sides, init)
    if args.dump:
        with open(args.dump, "w") as file:
            json.dump(results, file)
    report(args, results)


if __name__ == "__main__":
    main()
