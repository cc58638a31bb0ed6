"""Models, data and the single-device reference runs that parity tests compare to."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import keras
import tensorflow as tf
import numpy as np

import tfmp
from tfmp import integrations
from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data

MESH_SHAPES = [(1, 1), (8, 1), (2, 4), (1, 8)]
SEED = 7


class PatchesHeld:
    """Holds tfmp's patches and lowerings in while it lives, as a strategy
    does: for tests that trace on a mesh with no strategy."""

    def __init__(self):
        integrations.install(self)


def run_in_fresh_process(program: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `program` with `python -c` in the tests' folder (`import conftest`
    splits the CPU as here), in a session of its own: whatever it leaves
    running (forked readers) is killed with it, at the end or the timeout."""
    process = subprocess.Popen(
        [sys.executable, "-c", program],
        cwd=pathlib.Path(__file__).parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def summary_events(logdir) -> dict:
    """{tag: [(step, value), ...]} of every TensorBoard event file under
    `logdir`, in the order they were written."""
    written = {}
    for path in sorted(pathlib.Path(logdir).glob("**/events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                written.setdefault(value.tag, []).append((event.step, tf.make_ndarray(value.tensor)))
    return written


def mesh(shape, axis_names=None) -> tfmp.DeviceMesh:
    """A mesh whose last axes are ("stage", "batch", "model"), by default."""
    axis_names = axis_names or ("stage", "batch", "model")[-len(shape):]
    return tfmp.DeviceMesh(shape, axis_names)


def build_mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="up"),
            keras.layers.Dense(8, name="down"),
        ],
        name="mlp",
    )


def mlp_layout_map(device_mesh: tfmp.DeviceMesh) -> tfmp.LayoutMap:
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    return layout_map


def mlp_data(n: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = rng.normal(size=(n, 8)).astype("float32")
    return x, y


def compile_mlp(model: keras.Model) -> keras.Model:
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def lm_data(n: int = 64):
    return next_token_data(n, seq_len=8, vocab_size=64, seed=1)


def compile_lm(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def demo_lm_like_one_device(strategy, compile_fn, rows: int = 37, batch_size: int = 8, seq_len: int = 8, **lm_kwargs):
    """`assert_parity` of the demo LM under `strategy`: `rows` sequences
    (37 at batch 8 end on a batch the batch axis does not divide), 2 epochs,
    evaluate and predict. Returns the mesh model."""
    from tfmp.demo import build_transformer_lm

    x, y = next_token_data(rows, seq_len, 64)
    return assert_parity(
        lambda: build_transformer_lm(seq_len=seq_len, **lm_kwargs),
        x=x,
        y=y,
        strategy=strategy,
        compile_fn=compile_fn,
        batch_size=batch_size,
        epochs=2,
        steps=2 * -(-rows // batch_size),
        evaluate=True,
    )


def build_layers_lm(num_layers: int = 1) -> keras.Model:
    """A Transformer LM made of tfmp's parallel layers: no LayoutMap needed."""
    tokens = keras.Input((8,), dtype="int32")
    x = tfmp.layers.VocabParallelEmbedding(64, 32, name="embed")(tokens)
    for i in range(num_layers):
        suffix = "" if i == 0 else f"_{i}"
        attention = tfmp.layers.ParallelMultiHeadAttention(8, 4, name=f"attention{suffix}")
        x = keras.layers.LayerNormalization(name=f"norm_1{suffix}")(
            x + attention(x, x, use_causal_mask=True)
        )
        h = tfmp.layers.ColumnParallelDense(64, activation="gelu", name=f"ffn_in{suffix}")(x)
        h = tfmp.layers.RowParallelDense(32, name=f"ffn_out{suffix}")(h)
        x = keras.layers.LayerNormalization(name=f"norm_2{suffix}")(x + h)
    head = keras.layers.Dense(64, name="head")
    logits = tfmp.layers.Sharded(head, {"kernel": (None, True), "bias": (True,)})(x)
    return keras.Model(tokens, logits, name="layers_lm")


def empty_layout_map(device_mesh: tfmp.DeviceMesh) -> tfmp.LayoutMap:
    return tfmp.LayoutMap(device_mesh)


MODELS = {
    "mlp": (build_mlp, mlp_layout_map, compile_mlp, mlp_data),
    "transformer": (build_transformer_lm, megatron_layout_map, compile_lm, lm_data),
    "layers": (build_layers_lm, empty_layout_map, compile_lm, lm_data),
}


class BatchLosses(keras.callbacks.Callback):
    """Records the loss Keras logs after every training batch."""

    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def initial_weights(build) -> list[np.ndarray]:
    keras.utils.set_random_seed(SEED)
    return build().get_weights()


def train(model, x, y, **fit_kwargs):
    """Fits without shuffling; returns per-batch losses and the History."""
    recorder = BatchLosses()
    fit_kwargs.setdefault("batch_size", 16)
    callbacks = [recorder, *fit_kwargs.pop("callbacks", [])]
    history = model.fit(x, y, shuffle=False, verbose=0, callbacks=callbacks, **fit_kwargs)
    return recorder.losses, history


def rows_reversed_within_batches(rows: int, batch_size: int) -> np.ndarray:
    """The order that reverses each batch's rows: the same batches, summed
    over the batch in another float order (a noise yardstick's run)."""
    return np.concatenate(
        [np.arange(start, min(start + batch_size, rows))[::-1] for start in range(0, rows, batch_size)]
    )


def build_on(strategy, name, weights):
    """Builds and compiles model `name` in the strategy's scope (None: no strategy)."""
    build, _, compile_fn, _ = MODELS[name]
    with (strategy or tf.distribute.get_strategy()).scope():
        model = build()
        model.set_weights(weights)
        return compile_fn(model)


def layouts_made() -> int:
    """How many functions DTensor has laid out for a mesh so far (misses of
    its function cache: a new trace, or another layout, shape or folded
    constant of one)."""
    from tensorflow.dtensor.python import api as dtensor_api

    return dtensor_api._dtensor_device()._get_stats()["function_manager.miss"]  # noqa: SLF001


def assert_weights_close(expected, actual, rtol=1e-5, atol=1e-5):
    """Equal within 1e-5; `atol` covers weights whose exact gradient is zero
    (the attention key bias), which move only by float noise."""
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def strategy_on(shape, layout_map_fn=None, **strategy_kwargs) -> tfmp.ModelParallelStrategy:
    """A ModelParallelStrategy on a `mesh(shape)`, with the LayoutMap
    `layout_map_fn(mesh)` gives (None: only the layers' declared layouts)."""
    device_mesh = mesh(shape)
    layout_map = layout_map_fn(device_mesh) if layout_map_fn else None
    return tfmp.ModelParallelStrategy(device_mesh, layout_map, **strategy_kwargs)


def assert_parity(
    build,
    layout_map_fn=None,
    x=None,
    y=None,
    mesh_shape=(2, 4),
    loss="mse",
    steps=3,
    atol=1e-5,
    zero_gradient=None,
    *,
    strategy=None,
    compile_fn=None,
    loss_atol=1e-6,
    prediction_atol=None,
    evaluate=False,
    zero_gradient_atol=1e-3,
    noise_yardstick=False,
    **fit_kwargs,
):
    """Fits `build()` on one device and under a strategy from the same
    weights (seed 7) and the same batches; per-step losses, the History,
    final weights and predictions agree to 1e-5. Returns the mesh model.

    The strategy is `strategy`, else one on a `mesh_shape` ("batch", "model")
    mesh with the LayoutMap `layout_map_fn(mesh)` (or "auto"). Both models
    are compiled by `compile_fn`, else with Adam(0.01) and `loss`.
    `fit_kwargs` go to both `fit`s (epochs, sample_weight, validation, ...);
    without a `batch_size`, `x` is cut into `steps` batches. Either way
    exactly `steps` batch losses are compared.

    Weights whose path matches the regex `zero_gradient` have an exactly
    zero gradient in theory (an attention key bias: softmax ignores a
    constant added to every score), which Adam turns into steps of float
    noise; they are compared with an absolute floor of `zero_gradient_atol`
    (3 Adam steps at 0.01 move a weight by up to 0.03); the others with `atol`. Predictions
    get `prediction_atol`, by default 1e-5 of the output scale: shards sum in
    another order than one device. With `evaluate`, `evaluate`'s results are
    compared too. The largest differences are printed, for the report.

    With `noise_yardstick`, a third run on one device trains in float64 (the
    exact answer, up to float64 noise); a weight may then differ by up to
    twice one device's distance from it on that weight, where that exceeds
    `atol`: the batch axis's shards and their all-reduce sum the batch in
    another order, and Adam turns a gradient that nearly cancels into a step
    whose size that order moves."""
    weights = initial_weights(build)
    if compile_fn is None:

        def compile_fn(model):
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
            return model

    # Random layers' seed generators take their seeds from the global seed
    # as they are built: the same for both models.
    keras.utils.set_random_seed(SEED)
    reference = build()
    reference.set_weights(weights)
    compile_fn(reference)
    if strategy is None:
        strategy = strategy_on(mesh_shape, layout_map_fn)
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        model = build()
        model.set_weights(weights)
        compile_fn(model)
    if "batch_size" not in fit_kwargs:
        fit_kwargs["batch_size"] = len(tf.nest.flatten(x)[0]) // steps
    ref_losses, ref_history = train(reference, x, y, **fit_kwargs)
    losses, history = train(model, x, y, **fit_kwargs)
    noise = [0.0] * len(reference.weights)
    if noise_yardstick:
        keras.config.set_dtype_policy("float64")
        try:
            exact = build()
            exact.set_weights(weights)
            compile_fn(exact)
        finally:
            keras.config.set_dtype_policy("float32")
        train(exact, x, y, **fit_kwargs)
        noise = [float(np.max(np.abs(a - b))) for a, b in zip(exact.get_weights(), reference.get_weights())]

    assert len(losses) == len(ref_losses) == steps
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=loss_atol)
    assert history.history.keys() == ref_history.history.keys()
    for key, values in ref_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=loss_atol, err_msg=key)
    ref_final, final = reference.get_weights(), model.get_weights()
    for variable, want, got, moved in zip(model.weights, ref_final, final, noise, strict=True):
        floor = zero_gradient_atol if zero_gradient and re.search(zero_gradient, variable.path) else atol
        floor = max(floor, 2 * moved)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=floor, err_msg=variable.path)
    batch_size = fit_kwargs["batch_size"]
    if evaluate:
        ref_results = reference.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        results = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        assert results.keys() == ref_results.keys()
        for key, value in ref_results.items():
            np.testing.assert_allclose(results[key], value, rtol=1e-5, err_msg=key)
    ref_predictions = reference.predict(x, batch_size=batch_size, verbose=0)
    predictions = model.predict(x, batch_size=batch_size, verbose=0)
    if prediction_atol is None:
        prediction_atol = 1e-5 * max(1.0, float(np.max(np.abs(ref_predictions))))
    np.testing.assert_allclose(predictions, ref_predictions, rtol=1e-5, atol=prediction_atol)
    differences = {
        "loss": float(np.max(np.abs(np.subtract(losses, ref_losses)))),
        "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(ref_final, final)),
        "predictions": float(np.max(np.abs(predictions - ref_predictions))),
    }
    if noise_yardstick:
        differences["weights, one device to float64"] = max(noise)
    print(f"max |difference| to one device: {differences}")
    return model


def rules(axes_by_key: dict):
    """A layout_map_fn from a dict of LayoutMap rules."""

    def layout_map_fn(device_mesh):
        layout_map = tfmp.LayoutMap(device_mesh)
        for key, axes in axes_by_key.items():
            layout_map[key] = axes
        return layout_map

    return layout_map_fn


class MinimalCell(keras.layers.Layer):
    """An Elman cell written as a plain Keras layer."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.recurrent_kernel = self.add_weight(
            shape=(self.units, self.units), name="recurrent_kernel"
        )

    def call(self, inputs, states):
        output = keras.ops.tanh(inputs @ self.kernel + states[0] @ self.recurrent_kernel)
        return output, [output]


def table_row(text: str, start: str) -> list[str]:
    """The cells of the first row of a tfmp table (`tfmp.summary`,
    `tfmp.comm_report`) in `text` that starts with `start`; cells are apart by
    two spaces or more."""
    row = next(line.strip() for line in text.splitlines() if line.strip().startswith(start))
    return re.split(r"\s{2,}", row)


def assert_trained_like_one_process(out_dir, input_mode: str = "global") -> None:
    """What tests/programs/train_mlp.py wrote in `out_dir` from several
    clients equals one process training the same MLP: losses, history,
    weights, the saved model and its backup."""
    x, y = mlp_data(64)
    device_mesh = mesh((2, 4))
    same = np.testing.assert_array_equal
    if input_mode == "per_client":
        # The clients interleave along a 4x2 mesh's batch axis: positions 0..3
        # hold client 0's first 4 rows, client 1's first 4, client 0's next 4, ...
        device_mesh = mesh((4, 2))
        order = np.concatenate([np.arange(0, 4), np.arange(8, 12), np.arange(4, 8), np.arange(12, 16)])
        x, y = (a.reshape(-1, 16, a.shape[-1])[:, order].reshape(a.shape) for a in (x, y))
        # Two clients' all-reduce of the 4x2 layout adds in another order than one process'.
        same = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
    model = build_on(tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh)), "mlp", initial_weights(build_mlp))
    losses, history = train(model, x, y)
    with open(os.path.join(out_dir, "result.json")) as result:
        got = json.load(result)
    same(got["losses"], losses)
    for key, values in history.history.items():
        same(got["history"][key], values)
    saved = np.load(os.path.join(out_dir, "weights.npz"))
    for i, weight in enumerate(model.get_weights()):
        same(saved[f"arr_{i}"], weight)
    # One file and its checksum, and one committed backup, written whole by
    # client 0 from the values both clients gathered.
    assert sorted(os.listdir(out_dir)) == ["backup", "model.keras", "model.keras.sha256", "result.json", "weights.npz"]
    backup = os.path.join(out_dir, "backup", "ckpt-1")
    assert sorted(os.listdir(backup)) == [
        "commit", "latest.weights.h5", "latest.weights.h5.sha256", "training_metadata.json",
    ]
    restored = build_on(None, "mlp", initial_weights(build_mlp))
    restored.load_weights(os.path.join(backup, "latest.weights.h5"))
    for want, got_weight in zip(model.get_weights(), restored.get_weights()):
        same(got_weight, want)
    loaded = keras.models.load_model(os.path.join(out_dir, "model.keras"))
    for want, got_weight in zip(model.get_weights(), loaded.get_weights()):
        same(got_weight, want)
