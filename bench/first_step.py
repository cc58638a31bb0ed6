"""Where the first training step's time goes, and what later epochs cost.

`python bench/breakdown.py --first-step` (or this file): for a convnet fit
with `validation_split` (2x4, `layout_map="auto"`) and a 2-layer
bidirectional LSTM over padded, masked sequences (2x4 and 8x1), each also
on one device with plain Keras: 37 rows at batch 8, 3 epochs. Per model:

- Python tracing: the time inside the model's `train_step` while Keras
  traces its step function (the forward and backward graph, the optimizer's
  update, the metrics);
- of which tfmp's lowering rewrites: the time inside the Keras ops that
  `tfmp.lowering` replaces, while they build their replacement;
- DTensor's SPMD expansion, function instantiation and the first run: the
  first step less the tracing and less a steady step (the functions DTensor
  laid out in the step are counted: its function cache's misses);
- first collective: a tiny mesh function's first call with an all-reduce
  over each mesh axis, less the same with none (the collective groups
  are set up once per process, before the models run here);
- each epoch's time and DTensor layouts, and a steady step (median).

Each step is waited for (its loss read) before the next begins. Output:
one table per model, and informational `RESULT` lines.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

ROWS, BATCH, EPOCHS = 37, 8, 3


def _models(quick: bool):
    import keras

    units, steps = (4, 5) if quick else (16, 10)

    def convnet():
        return keras.Sequential([
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ], name="convnet")

    def bilstm():
        tokens = keras.Input((steps,), dtype="int32")
        x = keras.layers.Embedding(100, units, mask_zero=True)(tokens)
        x = keras.layers.Bidirectional(keras.layers.LSTM(units, return_sequences=True))(x)
        x = keras.layers.Bidirectional(keras.layers.LSTM(units))(x)
        return keras.Model(tokens, keras.layers.Dense(4)(x), name="bilstm")

    return {"convnet": convnet, "bilstm": bilstm}, steps


def _data(name: str, steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, ROWS)
    if name == "convnet":
        return rng.normal(size=(ROWS, 16, 16, 3)).astype("float32"), y
    tokens = rng.integers(1, 100, size=(ROWS, steps))
    tokens[np.arange(steps) >= rng.integers(2, steps + 1, size=ROWS)[:, None]] = 0
    return tokens.astype("int32"), y


def _layouts_made() -> int:
    from tensorflow.dtensor.python import api as dtensor_api

    return dtensor_api._dtensor_device()._get_stats()["function_manager.miss"]  # noqa: SLF001


@contextlib.contextmanager
def _timed_lowerings(seconds: collections.Counter):
    """Adds the time inside tfmp's lowered Keras ops (outermost calls only)
    to `seconds["lowering"]`."""
    from tfmp.lowering import registry

    depth = [0]
    patched = []
    for lowering in registry.lowerings():
        if not lowering.in_installed_library():
            continue
        module = lowering.owner()
        original = getattr(module, lowering.attribute)

        @functools.wraps(original)
        def timed(*args, original=original, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0 and registry.forward_mesh() is not None:
                    seconds["lowering"] += time.perf_counter() - start

        setattr(module, lowering.attribute, timed)
        patched.append((module, lowering.attribute, original))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def _first_collective_s(mesh) -> float:
    """First call of a mesh function with an all-reduce over every mesh axis,
    less the first call of the same function on replicated input (none)."""
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    def first_call(layout) -> float:
        value = dtensor.call_with_layout(tf.ones, layout, shape=[8, 8])
        function = tf.function(lambda v: tf.reduce_sum(v))
        start = time.perf_counter()
        float(dtensor.unpack(function(value))[0])
        return time.perf_counter() - start

    dtensor_mesh = mesh.dtensor_mesh
    axes = dtensor_mesh.dim_names
    sharded = dtensor.Layout([axes[0], axes[1]], dtensor_mesh)
    return first_call(sharded) - first_call(dtensor.Layout.replicated(dtensor_mesh, 2))


class _Steps:
    """Per epoch: seconds and DTensor layouts; per step: seconds (each step
    waited for); and the time inside `train_step` while it is traced."""

    def __init__(self, model, on_mesh: bool, lowering_s: collections.Counter):
        import keras

        self.on_mesh = on_mesh
        # Per trace of `train_step`: its seconds, and the lowerings' in it.
        self.traces: list[tuple[float, float]] = []
        self.step_s: list[float] = []
        self.epochs: list[tuple[float, int]] = []
        step = model.train_step

        def traced(data):
            start, lowered = time.perf_counter(), lowering_s["lowering"]
            try:
                return step(data)
            finally:
                self.traces.append((time.perf_counter() - start, lowering_s["lowering"] - lowered))

        model.train_step = traced
        outer = self

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                outer._epoch = (time.perf_counter(), outer._layouts())

            def on_epoch_end(self, epoch, logs=None):
                began, layouts = outer._epoch
                outer.epochs.append((time.perf_counter() - began, outer._layouts() - layouts))

            def on_train_batch_begin(self, batch, logs=None):
                outer._step = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                float(logs["loss"])
                outer.step_s.append(time.perf_counter() - outer._step)

        self.callback = Callback()

    def _layouts(self) -> int:
        return _layouts_made() if self.on_mesh else 0


def run(name: str, shape, quick: bool) -> dict:
    import keras
    import tensorflow as tf

    import tfmp

    builders, steps = _models(quick)
    strategy = None
    if shape is not None:
        mesh = tfmp.DeviceMesh(shape, ("batch", "model"))
        strategy = tfmp.ModelParallelStrategy(mesh, "auto" if name == "convnet" else None)
    keras.utils.set_random_seed(0)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = builders[name]()
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = _data(name, steps)
    seconds: collections.Counter = collections.Counter()
    steps_seen = _Steps(model, strategy is not None, seconds)
    layouts_before = _layouts_made() if strategy else 0
    with _timed_lowerings(seconds):
        model.fit(
            x, y, batch_size=BATCH, epochs=EPOCHS, validation_split=0.25, verbose=0,
            callbacks=[steps_seen.callback],
        )
    per_epoch = len(steps_seen.step_s) // EPOCHS
    steady = statistics.median(steps_seen.step_s[per_epoch:])
    first = steps_seen.step_s[0]
    trace_s, lowering_s = steps_seen.traces[0]
    return {
        "first step s": first,
        "python tracing s": trace_s,
        "of which lowering rewrites s": lowering_s,
        "expansion + instantiation + first run s": first - trace_s - steady,
        "traces of train_step": len(steps_seen.traces),
        "steady step ms": 1000 * steady,
        "epochs s": [round(seconds_, 2) for seconds_, _ in steps_seen.epochs],
        "layouts per epoch": [layouts for _, layouts in steps_seen.epochs],
        "layouts in fit": (_layouts_made() - layouts_before) if strategy else 0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models: a smoke run")
    args = parser.parse_args(argv)
    import tfmp

    tfmp.simulate_devices(8)
    print(f"first collective on a 2x4 mesh: {_first_collective_s(tfmp.DeviceMesh((2, 4), ('batch', 'model'))):.3f} s")
    for name, shape in (("convnet", None), ("convnet", (2, 4)), ("bilstm", None), ("bilstm", (2, 4)), ("bilstm", (8, 1))):
        where = "keras, one device" if shape is None else f"tfmp {shape[0]}x{shape[1]}"
        result = run(name, shape, args.quick)
        print(f"\n{name}, {where}")
        for key, value in result.items():
            print(f"  {key}: {value if not isinstance(value, float) else round(value, 3)}")
        print(f'RESULT measure="first step s, {name} {where}" ratio={result["first step s"]:.3f} target=- status=-')


if __name__ == "__main__":
    main()
