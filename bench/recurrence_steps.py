"""Recurrent models' steps against another checkout of tfmp, side by side in one run.

The zoo's recurrent classifiers (bench/model_zoo.py's full sizes: Embedding
of 512 x 32, two LSTM or GRU layers of 64 units over 32 tokens, Dense 10;
Adam, batch 32) on 8x1 and 2x4 meshes of 8 simulated CPU devices
(`layout_map="auto"`): the first `fit` of one step and the median later
step, each configuration in a fresh process, this checkout's and the
baseline's alternating round by round, from the same weights and batches
(the losses printed must agree).

    git worktree add /tmp/baseline <commit>
    python bench/recurrence_steps.py --baseline /tmp/baseline [--rounds 2]

docs/performance.md has the numbers of a run.
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
ROWS, BATCH, TOKENS, UNITS, VOCAB = 32 * 30, 32, 32, 64, 512


def child(cell: str, shape: str) -> dict:
    import time

    import tfmp

    tfmp.simulate_devices(8)
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    mesh = tfmp.DeviceMesh(tuple(int(s) for s in shape.split("x")), ("batch", "model"))
    with tfmp.ModelParallelStrategy(mesh, layout_map="auto").scope():
        layer = keras.layers.LSTM if cell == "lstm" else keras.layers.GRU
        tokens = keras.Input((TOKENS,), dtype="int32")
        x = keras.layers.Embedding(VOCAB, 32)(tokens)
        x = layer(UNITS)(layer(UNITS, return_sequences=True)(x))
        model = keras.Model(tokens, keras.layers.Dense(10)(x))
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(ROWS, TOKENS)).astype("int32")
    y = rng.integers(0, 10, size=(ROWS,)).astype("int32")
    fit = dict(batch_size=BATCH, verbose=0, shuffle=False)
    started = time.perf_counter()
    model.fit(x[:BATCH], y[:BATCH], **fit)
    first = time.perf_counter() - started
    model.fit(x[BATCH:5 * BATCH], y[BATCH:5 * BATCH], **fit)

    class Ends(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    ends = Ends()
    history = model.fit(x[5 * BATCH:], y[5 * BATCH:], callbacks=[ends], **fit)
    return {"first_s": first, "step_ms": 1000 * float(np.median(np.diff(ends.times))),
            "loss": history.history["loss"][-1]}


def run(tree: pathlib.Path, cell: str, shape: str) -> dict:
    environment = dict(os.environ, PYTHONPATH=str(tree))
    result = subprocess.run(
        [sys.executable, __file__, "--child", cell, shape], env=environment, cwd=tree,
        capture_output=True, text=True, timeout=1200,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{cell} {shape} in {tree} failed:\n{result.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=pathlib.Path, help="another checkout of tfmp")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cells", default="gru,lstm")
    parser.add_argument("--meshes", default="8x1,2x4")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(*options.child)))
        return
    if options.baseline is None:
        parser.error("--baseline: give another checkout of tfmp to compare with (git worktree add ...)")
    trees = {"this": HERE.parent, "baseline": options.baseline.resolve()}
    for cell in options.cells.split(","):
        for shape in options.meshes.split(","):
            runs = {name: [] for name in trees}
            for round_ in range(options.rounds):
                order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
                for name in order:
                    runs[name].append(run(trees[name], cell, shape))
            for measure, unit in (("step_ms", "ms"), ("first_s", "s")):
                this, base = (statistics.median(r[measure] for r in runs[n]) for n in trees)
                print(f"{cell} {shape} {measure}: this {this:.2f} {unit}, baseline {base:.2f} {unit}, "
                      f"losses {runs['this'][0]['loss']:.6f} / {runs['baseline'][0]['loss']:.6f}")
                print(f'RESULT measure="{cell} {shape} {measure} this/baseline" ratio={this / base:.3f} '
                      "target=- status=-", flush=True)


if __name__ == "__main__":
    main()
