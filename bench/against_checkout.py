"""The zoo's models on this checkout of tfmp against another, side by side in one run.

The models of bench/model_zoo.py (its full sizes, or `--quick` ones; Adam,
batch 32) on meshes of 8 simulated CPU devices with `layout_map="auto"`
(1x1: a one-device mesh, no layout map): the first `fit` of one step and
the median later step, each configuration in a fresh process, this
checkout's and the baseline's alternating round by round, from the same
weights and batches (the losses printed must agree where the change keeps
numbers). The models are built by this checkout's bench/model_zoo.py on
both sides; only the tfmp imported differs.

    git worktree add /tmp/baseline <commit>
    python bench/against_checkout.py --baseline /tmp/baseline --models lstm,gru [--rounds 2] [--seq-len 128]

docs/performance.md has the numbers of the runs it made.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
WARM_STEPS, TIMED_STEPS = 4, 24


def child(model_name: str, shape: str, quick: bool, seq_len: int | None) -> dict:
    import dataclasses
    import time

    import tfmp

    tfmp.simulate_devices(8)
    import keras
    import numpy as np

    sys.path.insert(0, str(HERE))
    import model_zoo

    size = model_zoo.QUICK if quick else model_zoo.FULL
    if seq_len:
        size = dataclasses.replace(size, seq_len=seq_len)
    batch = model_zoo.BATCH
    keras.utils.set_random_seed(model_zoo.SEED)
    mesh_shape = tuple(int(s) for s in shape.split("x"))
    mesh = tfmp.DeviceMesh(mesh_shape, model_zoo.MESH_AXES)
    layout_map = None if mesh_shape == (1, 1) else "auto"
    with tfmp.ModelParallelStrategy(mesh, layout_map=layout_map).scope():
        model = model_zoo.build_model(model_name, size)
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = model_zoo.make_data(model_name, size, (1 + WARM_STEPS + TIMED_STEPS) * batch)
    rows = model_zoo._rows  # noqa: SLF001 (the zoo's own slicing of dict inputs)
    fit = dict(batch_size=batch, verbose=0, shuffle=False)
    started = time.perf_counter()
    model.fit(rows(x, 0, batch), y[:batch], **fit)
    first = time.perf_counter() - started
    warm = (1 + WARM_STEPS) * batch
    model.fit(rows(x, batch, warm), y[batch:warm], **fit)

    class Ends(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    ends = Ends()
    history = model.fit(rows(x, warm, len(y)), y[warm:], callbacks=[ends], **fit)
    return {"first_s": first, "step_ms": 1000 * float(np.median(np.diff(ends.times))),
            "loss": history.history["loss"][-1]}


def run(tree: pathlib.Path, model_name: str, shape: str, quick: bool, seq_len: int | None) -> dict:
    environment = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, __file__, "--child", model_name, shape] + (["--quick"] if quick else [])
    command += ["--seq-len", str(seq_len)] if seq_len else []
    result = subprocess.run(command, env=environment, cwd=tree, capture_output=True, text=True,
                            timeout=1200)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{model_name} {shape} in {tree} failed:\n{result.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=pathlib.Path, help="another checkout of tfmp")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="lstm,gru", help="bench/model_zoo.py's model names")
    parser.add_argument("--meshes", default="8x1,2x4", help="e.g. 8x1,2x4,1x1")
    parser.add_argument("--quick", action="store_true", help="the zoo's tiniest sizes")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the zoo's)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(*options.child, options.quick, options.seq_len)))
        return
    if options.baseline is None:
        parser.error("--baseline: give another checkout of tfmp to compare with (git worktree add ...)")
    trees = {"this": HERE.parent, "baseline": options.baseline.resolve()}
    for model_name in options.models.split(","):
        for shape in options.meshes.split(","):
            runs = {name: [] for name in trees}
            for round_ in range(options.rounds):
                order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
                for name in order:
                    runs[name].append(run(trees[name], model_name, shape, options.quick, options.seq_len))
            for measure, unit in (("step_ms", "ms"), ("first_s", "s")):
                this, base = (statistics.median(r[measure] for r in runs[n]) for n in trees)
                print(f"{model_name} {shape} {measure}: this {this:.2f} {unit}, baseline {base:.2f} "
                      f"{unit}, losses {runs['this'][0]['loss']:.6f} / {runs['baseline'][0]['loss']:.6f}")
                print(f'RESULT measure="{model_name} {shape} {measure} this/baseline" '
                      f"ratio={this / base:.3f} target=- status=-", flush=True)


if __name__ == "__main__":
    main()
