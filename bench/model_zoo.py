"""Speed users feel: ordinary Keras models, tfmp against Keras on JAX and plain Keras.

Trains seven small models built from code (no downloads), Adam, batch 32,
sparse categorical cross-entropy from logits:

- `convnet`: Conv2D 16 and 32 filters (3x3, relu), MaxPooling, Flatten,
  Dense 10, on 16x16x3 images;
- `resnet`: a Conv2D + BatchNormalization stem and 3 residual blocks (conv,
  BN, relu, conv, BN, add, relu; 16 filters), GlobalAveragePooling, Dense 10;
- `lstm`, `gru`: Embedding (vocabulary 512, 32 features) into two LSTM / GRU
  layers of 64 units over 32 tokens, Dense 10;
- `mlp`: a residual MLP, 2 blocks of Dense 64 -> 256 (relu) -> 64 added to
  their input, Dense 10;
- `transformer`: the `tfmp demo` LM (`tfmp.demo.build_transformer_lm` with
  bench/compare_jax.py's sizes: vocabulary 512, sequence 32, width 128, 8
  heads, FFN 512) on `tfmp.demo.next_token_data`;
- `kerashub`: `keras_hub.models.GPT2Backbone` from a tiny config (vocabulary
  512, 2 layers, hidden 64, 4 heads, FFN 256, sequence 32, no dropout) with a
  Dense vocabulary head, on `next_token_data`.

For each model, three layouts, each a pair of configurations:

- 2x4 and 8x1 ("batch", "model") meshes of 8 simulated CPU devices: tfmp
  (`tfmp.ModelParallelStrategy(mesh, layout_map="auto")`, KERAS_BACKEND=
  tensorflow, `tfmp.simulate_devices(8)`) against Keras on JAX
  (`keras.distribution.ModelParallel`, XLA_FLAGS=
  --xla_force_host_platform_device_count=8) with the layouts tfmp chose;
- 1x1: tfmp on a one-device mesh (no layout map) against plain Keras on
  TensorFlow, no strategy.

and two measures per pair:

1. steady step: the median step time of tfmp / of the reference. Target:
   <= 1.50 against JAX (2x4, 8x1); <= 1.20 against plain Keras (1x1).
2. first step: the wall time of the first `fit` call, of one step (tracing,
   compiling or laying out the step on the mesh, tfmp's "auto" planning
   included, and running it), tfmp / reference. Target: <= 2.00 against
   JAX; none on 1x1 (printed with target "-").

Method: as bench/compare_jax.py, whose helpers this script imports. Keras
fixes its backend per process, so each configuration runs in its own
subprocess of this script (`--child ...`), which prints JSON. The first
subprocess of a model builds it with seed 0 and saves its weights to a
temporary `.weights.h5`; every other one loads that file (checked: each
prints a fingerprint of its initial weights), and all train on the same
batches. Same layout rules on both sides: tfmp plans the layouts
(`layout_map="auto"`, at the first `fit`); its subprocess writes the layout
of every model variable (`tfmp.inspect.summary.placements`) to a file, and
the JAX subprocess gives each split variable its layout as a
`keras.distribution.LayoutMap` key matching exactly its path. The parent
checks that every variable got the same layout on both sides (JAX's
`sharding.spec`). So tfmp runs first in the first round of each mesh layout;
later rounds alternate the order. A weight tfmp stores split and gathers on
use (`tfmp.gather_on_use`) is stored split on JAX too, where XLA decides how
to compute with it.

A step's time is the gap between consecutive `on_train_batch_end` calls,
after reading the step's loss (which waits for the step). After the first
(one-step) `fit`, a warm-up `fit` runs, then the timed `fit`, whose first gap
is dropped. Both backends compile with Keras's defaults
(`jit_compile="auto"`). A configuration that fails (or runs past its time
limit) is reported as failed with its error's last line, and the script goes
on; its RESULT lines say `ratio=nan status=missed`.

Usage (from the repository root; needs `pip install "jax[cpu]"` and
keras-hub for `kerashub`):

    python bench/model_zoo.py                       # 3 warm-up + 20 steps x 2 rounds
    python bench/model_zoo.py --quick               # tiniest sizes, 1 round: a smoke run
    python bench/model_zoo.py --models convnet,lstm,mlp --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from compare_jax import (  # bench/compare_jax.py
    DROPPED_GAPS,
    FULL as LM_FULL,
    NUM_DEVICES,
    QUICK as LM_QUICK,
    SEED,
    StepRecorder,
    _axes,
    _status,
    _verdict,
    _versions,
    side_env,
)

MODELS = ("convnet", "resnet", "lstm", "gru", "mlp", "transformer", "kerashub")
MESH_AXES = ("batch", "model")
# layout -> (mesh shape, candidate side, reference side)
LAYOUTS = {
    "2x4": ((2, 4), "tf", "jax"),
    "8x1": ((8, 1), "tf", "jax"),
    "1x1": ((1, 1), "tfmp", "keras"),
}
SIDE_NAMES = {"tf": "tfmp", "jax": "Keras JAX", "tfmp": "tfmp 1x1", "keras": "Keras TF"}
STEADY_TARGET = {"2x4": 1.50, "8x1": 1.50, "1x1": 1.20}
FIRST_TARGET = {"2x4": 2.00, "8x1": 2.00, "1x1": None}
CLASSES = 10
BATCH = 32


@dataclasses.dataclass(frozen=True)
class Size:
    """The models' sizes."""

    image: int = 16
    filters: tuple[int, int] = (16, 32)
    res_blocks: int = 3
    vocab: int = 512
    seq_len: int = 32
    embed: int = 32
    rnn_units: int = 64
    mlp_width: int = 64
    mlp_hidden: int = 256
    hub_hidden: int = 64
    hub_heads: int = 4
    lm: object = LM_FULL


FULL = Size()
QUICK = Size(image=8, filters=(8, 16), res_blocks=2, vocab=64, seq_len=8, embed=8,
             rnn_units=8, mlp_width=16, mlp_hidden=32, hub_hidden=16, lm=LM_QUICK)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiniest sizes, few steps, 1 round")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)} (default: all)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated subset of {','.join(LAYOUTS)} (default: all)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 20; quick: 5)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per run (default 3; quick: 2)")
    parser.add_argument("--rounds", type=int, help="runs of each configuration (default 2; quick: 1)")
    parser.add_argument("--timeout", type=float,
                        help="seconds allowed per subprocess (default 1200; quick: 600)")
    # One configuration, in its own process:
    parser.add_argument("--child", choices=tuple(SIDE_NAMES), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=tuple(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)  # weights and layouts files
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    for value, known, what in ((args.models, MODELS, "model"), (args.layouts, LAYOUTS, "layout")):
        unknown = [v for v in value if v not in known]
        if unknown:
            parser.error(f"unknown {what}(s) {unknown}: choose from {', '.join(known)}")
    args.steps = args.steps or (5 if args.quick else 20)
    args.warmup = args.warmup or (2 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.timeout = args.timeout or (600 if args.quick else 1200)
    args.size = QUICK if args.quick else FULL
    return args


# --- the models and their data -----------------------------------------------


def build_model(name: str, size: Size):
    """One of the zoo's models, uncompiled."""
    import keras

    layers = keras.layers
    if name == "convnet":
        return keras.Sequential([
            keras.Input((size.image, size.image, 3)),
            layers.Conv2D(size.filters[0], 3, activation="relu", name="conv_1"),
            layers.Conv2D(size.filters[1], 3, activation="relu", name="conv_2"),
            layers.MaxPooling2D(name="pool"),
            layers.Flatten(name="flatten"),
            layers.Dense(CLASSES, name="head"),
        ], name="convnet")
    if name == "resnet":
        images = keras.Input((size.image, size.image, 3), name="images")
        width = size.filters[0]
        x = layers.Conv2D(width, 3, padding="same", name="stem_conv")(images)
        x = layers.ReLU(name="stem_relu")(layers.BatchNormalization(name="stem_bn")(x))
        for i in range(size.res_blocks):
            h = layers.Conv2D(width, 3, padding="same", name=f"block{i}_conv_1")(x)
            h = layers.ReLU()(layers.BatchNormalization(name=f"block{i}_bn_1")(h))
            h = layers.Conv2D(width, 3, padding="same", name=f"block{i}_conv_2")(h)
            h = layers.BatchNormalization(name=f"block{i}_bn_2")(h)
            x = layers.ReLU(name=f"block{i}_out")(layers.Add(name=f"block{i}_add")([x, h]))
        x = layers.GlobalAveragePooling2D(name="pool")(x)
        return keras.Model(images, layers.Dense(CLASSES, name="head")(x), name="resnet")
    if name in ("lstm", "gru"):
        cell = layers.LSTM if name == "lstm" else layers.GRU
        tokens = keras.Input((size.seq_len,), dtype="int32", name="tokens")
        x = layers.Embedding(size.vocab, size.embed, name="embedding")(tokens)
        x = cell(size.rnn_units, return_sequences=True, name=f"{name}_1")(x)
        x = cell(size.rnn_units, name=f"{name}_2")(x)
        return keras.Model(tokens, layers.Dense(CLASSES, name="head")(x), name=name)
    if name == "mlp":
        features = keras.Input((size.mlp_width,), name="features")
        x = features
        for i in range(2):
            h = layers.Dense(size.mlp_hidden, activation="relu", name=f"up_{i}")(x)
            h = layers.Dense(size.mlp_width, name=f"down_{i}")(h)
            x = layers.Add(name=f"residual_{i}")([x, h])
        return keras.Model(features, layers.Dense(CLASSES, name="head")(x), name="mlp")
    if name == "transformer":
        from tfmp.demo import build_transformer_lm

        return build_transformer_lm(**size.lm.model_kwargs())
    if name == "kerashub":
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=size.vocab, num_layers=2, num_heads=size.hub_heads,
            hidden_dim=size.hub_hidden, intermediate_dim=4 * size.hub_hidden, dropout=0.0,
            max_sequence_length=size.seq_len, name="gpt2",
        )
        inputs = {
            key: keras.Input((size.seq_len,), dtype="int32", name=key)
            for key in ("token_ids", "padding_mask")
        }
        logits = layers.Dense(size.vocab, name="lm_head")(backbone(inputs))
        return keras.Model(inputs, logits, name="gpt2_lm")
    raise ValueError(name)


def make_data(name: str, size: Size, rows: int):
    """`rows` inputs and integer targets for the model `name`."""
    import numpy as np

    from tfmp.demo import next_token_data

    rng = np.random.default_rng(SEED)
    labels = rng.integers(0, CLASSES, size=rows).astype("int32")
    if name in ("convnet", "resnet"):
        return rng.normal(size=(rows, size.image, size.image, 3)).astype("float32"), labels
    if name in ("lstm", "gru"):
        return rng.integers(0, size.vocab, size=(rows, size.seq_len)).astype("int32"), labels
    if name == "mlp":
        return rng.normal(size=(rows, size.mlp_width)).astype("float32"), labels
    if name == "transformer":
        return next_token_data(rows, size.lm.seq_len, size.lm.vocab_size, seed=SEED)
    x, y = next_token_data(rows, size.seq_len, size.vocab, seed=SEED)
    return {"token_ids": x, "padding_mask": np.ones_like(x)}, y


def _rows(x, start: int, stop: int):
    if isinstance(x, dict):
        return {key: value[start:stop] for key, value in x.items()}
    return x[start:stop]


# --- one configuration, in its own process -----------------------------------


def run_child(args: argparse.Namespace) -> dict:
    """Builds, loads (or saves) the initial weights, trains; returns the results."""
    import keras
    import numpy as np

    expected = "jax" if args.child == "jax" else "tensorflow"
    assert keras.backend.backend() == expected, keras.backend.backend()
    init = os.path.join(args.work, f"{args.model}.weights.h5")
    layouts_file = os.path.join(args.work, f"{args.model}-{args.layout}.layouts.json")
    scope, layouts_of = _setup(args.child, LAYOUTS[args.layout][0], layouts_file)
    keras.utils.set_random_seed(SEED)
    with scope:
        model = build_model(args.model, args.size)
        if os.path.exists(init):
            model.load_weights(init)
        else:
            model.save_weights(init)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    initial = model.get_weights()
    fingerprint = [
        float(sum(np.sum(w, dtype="float64") for w in initial)),
        float(sum(np.sum(np.square(w, dtype="float64")) for w in initial)),
    ]
    x, y = make_data(args.model, args.size, (1 + args.warmup + args.steps) * BATCH)
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    first = StepRecorder()
    started = time.perf_counter()
    model.fit(_rows(x, 0, BATCH), y[:BATCH], callbacks=[first], **fit)
    first_s = time.perf_counter() - started
    split = (1 + args.warmup) * BATCH
    warm = StepRecorder()
    model.fit(_rows(x, BATCH, split), y[BATCH:split], callbacks=[warm], **fit)
    timed = StepRecorder()
    model.fit(_rows(x, split, len(y)), y[split:], callbacks=[timed], **fit)
    layouts, gathered = layouts_of(model)
    if args.child == "tf" and not os.path.exists(layouts_file):
        with open(layouts_file, "w") as file:
            json.dump(layouts, file)
    return {
        "side": args.child,
        "backend": keras.backend.backend(),
        "jit_compile": bool(model.jit_compile),
        "first_s": first_s,
        "step_s": np.diff(timed.ends)[DROPPED_GAPS:].tolist(),
        "losses": first.step_losses() + warm.step_losses() + timed.step_losses(),
        "layouts": layouts,
        "gathered_on_use": gathered,
        "fingerprint": fingerprint,
    }


def _setup(side: str, shape: tuple[int, int], layouts_file: str):
    """The scope to build in and a function giving every model variable's
    layout (and the paths tfmp gathers on use), for one configuration."""
    import contextlib

    if side == "keras":
        return contextlib.nullcontext(), lambda model: ({}, [])
    if side == "jax":
        import jax
        import keras

        if not os.path.exists(layouts_file):
            raise RuntimeError(f"no layouts from the tfmp side in {layouts_file}: "
                               "the tfmp run of this model and mesh did not finish")
        with open(layouts_file) as file:
            planned = json.load(file)
        mesh = keras.distribution.DeviceMesh(shape, MESH_AXES, jax.devices()[:math.prod(shape)])
        layout_map = keras.distribution.LayoutMap(mesh)
        for path, axes in planned.items():
            if any(axes):  # Keras matches keys with re.fullmatch: exactly this path
                layout_map[re.escape(path)] = tuple(axes)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        )

        def jax_layouts(model):
            return {
                v.path: _axes(tuple(v.value.sharding.spec), len(v.shape))
                for v in model.variables
            }, []

        return contextlib.nullcontext(), jax_layouts

    import tfmp
    from tfmp.inspect.summary import placements

    if side == "tf":
        devices = tfmp.simulate_devices(NUM_DEVICES)
        mesh = tfmp.DeviceMesh(shape, MESH_AXES, devices[:math.prod(shape)])
        strategy = tfmp.ModelParallelStrategy(mesh, layout_map="auto")
    else:  # "tfmp": one device, no layout map
        strategy = tfmp.ModelParallelStrategy(tfmp.DeviceMesh(shape, MESH_AXES))

    def tf_layouts(model):
        rows = [row for row in placements(model) if not row.is_slot]
        return (
            {row.path: _axes(row.axes or (), len(row.shape)) for row in rows},
            [row.path for row in rows if row.gathered_on_use],
        )

    return strategy.scope(), tf_layouts


# --- the parent: every configuration, side by side ---------------------------


def child_command(args: argparse.Namespace, side: str, model: str, layout: str,
                  work: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--child", side, "--model", model,
               "--layout", layout, "--work", work, "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    return command + (["--quick"] if args.quick else [])


def run_subprocess(args: argparse.Namespace, side: str, model: str, layout: str,
                   work: str) -> dict:
    """One configuration's results, or {"error": its last line}."""
    started = time.perf_counter()
    label = f"{model} {layout} {SIDE_NAMES[side]}"
    print(f"  running {label} ...", end=" ", flush=True, file=sys.stderr)
    try:
        process = subprocess.run(
            child_command(args, side, model, layout, work), env=side_env(side),
            capture_output=True, text=True, timeout=args.timeout,
        )
    except subprocess.TimeoutExpired:
        result = {"error": f"timed out after {args.timeout:.0f} s"}
    else:
        if process.returncode != 0:
            result = {"error": f"exit {process.returncode}: {_error_line(process.stderr)}"}
        else:
            try:
                result = json.loads(process.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                result = {"error": "no JSON result: " + _error_line(process.stderr)}
    result["wall_s"] = time.perf_counter() - started
    print(f"{result['wall_s']:.0f} s" + (f", FAILED: {result['error']}" if "error" in result
                                         else ""), flush=True, file=sys.stderr)
    return result


def _error_line(stderr: str) -> str:
    """The exception line of the last traceback in `stderr` (else its last line)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if not line.startswith(" "):
                return line.strip()[:300]
    return (lines[-1].strip() if lines else "(no output)")[:300]


def measure(args: argparse.Namespace) -> dict[tuple[str, str], dict[str, list[dict]]]:
    """Per (model, layout): every side's results, one per round. tfmp runs
    first in a mesh layout's first round (it plans the layouts JAX is given);
    later rounds alternate."""
    runs: dict[tuple[str, str], dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as work:
        for model in args.models:
            for layout in args.layouts:
                _, candidate, reference = LAYOUTS[layout]
                sides = runs[model, layout] = {candidate: [], reference: []}
                for round_index in range(args.rounds):
                    order = (candidate, reference) if round_index % 2 == 0 else (
                        reference, candidate)
                    for side in order:
                        if side == "jax" and "error" in (sides["tf"] or [{"error": ""}])[0]:
                            sides[side].append({"error": "not run: the tfmp side failed"})
                            continue
                        sides[side].append(run_subprocess(args, side, model, layout, work))
    return runs


@dataclasses.dataclass
class Row:
    model: str
    layout: str
    measure: str  # "steady step" or "first step"
    candidate_s: float
    reference_s: float
    target: float | None
    failure: str = ""

    @property
    def ratio(self) -> float:
        return self.candidate_s / self.reference_s if not self.failure else math.nan

    @property
    def met(self) -> bool:
        return not self.failure and (self.target is None or self.ratio <= self.target)


def rows_of(model: str, layout: str, sides: dict[str, list[dict]]) -> tuple[list[Row], list[str]]:
    """The two rows of one (model, layout) and notes (failures, checks)."""
    _, candidate, reference = LAYOUTS[layout]
    notes = []
    failures = [
        f"{SIDE_NAMES[side]}: {run['error']}"
        for side in (candidate, reference) for run in sides[side] if "error" in run
    ]
    if failures:
        failure = failures[0]
        notes += [f"{model} {layout} FAILED: {line}" for line in dict.fromkeys(failures)]
        return [
            Row(model, layout, "steady step", math.nan, math.nan, STEADY_TARGET[layout], failure),
            Row(model, layout, "first step", math.nan, math.nan, FIRST_TARGET[layout], failure),
        ], notes
    cand, ref = sides[candidate], sides[reference]
    steady = [1e3 * statistics.median(t for run in runs for t in run["step_s"])
              for runs in (cand, ref)]
    first = [statistics.median(run["first_s"] for run in runs) for runs in (cand, ref)]
    a, b = cand[0]["fingerprint"], ref[0]["fingerprint"]
    if not all(abs(x - y) <= 1e-6 * max(1.0, abs(x)) for x, y in zip(a, b)):
        notes.append(f"{model} {layout}: initial weights differ (sum, sum of squares: "
                     f"{a} against {b})")
    loss_a, loss_b = cand[0]["losses"][0], ref[0]["losses"][0]
    if abs(loss_a - loss_b) > 1e-3 * max(1.0, abs(loss_a)):
        notes.append(f"{model} {layout}: first-step losses differ: {loss_a:.5f} against "
                     f"{loss_b:.5f}")
    failure = ""
    if reference == "jax":
        tf_layouts, jax_layouts = cand[0]["layouts"], ref[0]["layouts"]
        different = sorted(
            path for path in set(tf_layouts) | set(jax_layouts)
            if tf_layouts.get(path) != jax_layouts.get(path)
        )
        for path in different:
            notes.append(f"{model} {layout}: layout of {path}: tfmp {tf_layouts.get(path)}, "
                         f"jax {jax_layouts.get(path)}")
        if different:
            failure = f"{len(different)} variable(s) laid out differently on the two sides"
        split = sum(1 for axes in tf_layouts.values() if any(axes))
        gathered = cand[0]["gathered_on_use"]
        notes.append(f"{model} {layout}: {split} of {len(tf_layouts)} variables split, "
                     f"same on both sides: {not different}"
                     + (f"; tfmp gathers {len(gathered)} on use: {', '.join(gathered)}"
                        if gathered else ""))
    rows = [
        Row(model, layout, "steady step", steady[0], steady[1], STEADY_TARGET[layout]),
        Row(model, layout, "first step", first[0], first[1], FIRST_TARGET[layout]),
    ]
    if failure:
        for row in rows:
            row.failure = failure
    return rows, notes


def report(args: argparse.Namespace, runs: dict) -> None:
    size = args.size
    print(f"models: {', '.join(args.models)}; sizes: {size}; Adam, batch {BATCH}; "
          f"{args.rounds} round(s) x (1 first + {args.warmup} warm-up + {args.steps} timed) "
          f"steps per configuration")
    print(f"versions: {_versions()}; {os.cpu_count()} cores")
    rows, notes = [], []
    for (model, layout), sides in runs.items():
        more_rows, more_notes = rows_of(model, layout, sides)
        rows += more_rows
        notes += more_notes
    print()
    print("| model | layout | measure | tfmp | reference | ratio | target | result |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for row in rows:
        unit = "ms" if row.measure == "steady step" else "s"
        reference = SIDE_NAMES[LAYOUTS[row.layout][2]]
        target = "-" if row.target is None else f"<= {row.target:.2f}"
        result = "FAILED" if row.failure else ("-" if row.target is None else _verdict(row.met))
        print(f"| {row.model} | {row.layout} | {row.measure} ({unit}) | "
              f"{row.candidate_s:.2f} | {reference} {row.reference_s:.2f} | "
              f"{row.ratio:.3f} | {target} | {result} |")
    if notes:
        print()
        for note in notes:
            print(note)
    print()
    for row in rows:
        reference = "JAX" if LAYOUTS[row.layout][2] == "jax" else "keras"
        name = f"{row.model} {row.layout} {row.measure} tfmp/{reference}"
        if row.failure:
            name += " (failed: " + row.failure.replace('"', "'")[:160] + ")"
        target = "-" if row.target is None else f"<={row.target:.2f}"
        status = "missed" if row.failure else ("-" if row.target is None else _status(row.met))
        print(f'RESULT measure="{name}" ratio={row.ratio:.3f} target={target} status={status}')


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    report(args, measure(args))


if __name__ == "__main__":
    main()
