"""Programs written for `keras.distribution` on JAX run unchanged on TensorFlow
through tfmp, with one device's numbers.

Each program is what Keras' distribution guide writes: a `DeviceMesh` over
`keras.distribution.list_devices()`, a `DataParallel` or a `ModelParallel`
with a Keras `LayoutMap` (keys matched against the whole variable path), set
with `set_distribution` or `with distribution.scope():`, and then the model
built, compiled and fitted with no strategy scope in sight. Each is compared
with plain one-device Keras from the same weights on the same batches: 37
samples at batch 8, so the last batch (5 rows) divides by no batch axis.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import (
    BatchLosses,
    build_mlp,
    compile_lm,
    compile_mlp,
    initial_weights,
    mlp_data,
    train,
)
from tfmp.demo import build_transformer_lm, next_token_data
from tfmp.strategy.variable import MeshVariable

N, BATCH, EPOCHS = 37, 8, 2


@pytest.fixture(autouse=True)
def no_distribution_left():
    """Every test starts and ends on plain Keras."""
    assert keras.distribution.distribution() is None
    yield
    keras.distribution.set_distribution(None)


def one_device(build, compile_fn, weights, x, y):
    """Plain Keras, no distribution: per-batch losses, final weights, predictions."""
    assert not tf.distribute.has_strategy()
    model = compile_fn(build())
    model.set_weights(weights)
    losses, _ = train(model, x, y, batch_size=BATCH, epochs=EPOCHS)
    return losses, model.get_weights(), model.predict(x, batch_size=BATCH, verbose=0)


def assert_matches(reference, losses, model, x, zero_gradient=None):
    """Per-batch losses, final weights and predictions agree with one device
    to 1e-5; prints the largest differences, for the report."""
    ref_losses, ref_weights, ref_predictions = reference
    assert len(losses) == len(ref_losses) == EPOCHS * -(-N // BATCH)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    weights = model.get_weights()
    for variable, want, got in zip(model.weights, ref_weights, weights, strict=True):
        # Adam turns a theoretically zero gradient (an attention key bias:
        # softmax ignores a constant added to every score) into steps of
        # float noise of size lr: such weights get an absolute floor of 1e-3,
        # as tests/helpers.py's assert_parity gives them.
        floor = 1e-3 if zero_gradient and zero_gradient in variable.path else 1e-5
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=floor, err_msg=variable.path)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(predictions, ref_predictions, rtol=1e-5, atol=1e-5)
    print(
        "max |difference| to one device:",
        {
            "loss": float(np.max(np.abs(np.subtract(losses, ref_losses)))),
            "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(ref_weights, weights)),
            "predictions": float(np.max(np.abs(predictions - ref_predictions))),
        },
    )


def specs(variable):
    return [None if s == "unsharded" else s for s in variable.value.layout.sharding_specs]


@pytest.fixture(scope="module")
def mlp():
    x, y = mlp_data(N)
    weights = initial_weights(build_mlp)
    return x, y, weights, one_device(build_mlp, compile_mlp, weights, x, y)


def test_data_parallel_on_eight_devices_matches_one_device(mlp):
    x, y, weights, reference = mlp

    devices = keras.distribution.list_devices()
    data_parallel = keras.distribution.DataParallel(devices=devices)
    keras.distribution.set_distribution(data_parallel)
    model = build_mlp()
    model.set_weights(weights)
    compile_mlp(model)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)  # as Keras' guide feeds it
    recorder = BatchLosses()
    model.fit(dataset, epochs=EPOCHS, verbose=0, callbacks=[recorder])

    assert_matches(reference, recorder.losses, model, x)
    assert len(devices) == keras.distribution.get_device_count() == 8
    for variable in model.weights:
        assert variable.value.layout.mesh.size == 8, variable.path
        assert specs(variable) == [None] * len(variable.shape), variable.path


def test_model_parallel_mlp_with_set_distribution_matches_one_device(mlp):
    x, y, weights, reference = mlp

    devices = keras.distribution.list_devices()
    device_mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    layout_map["mlp/up/output"] = ("batch", "model")  # a layer's output, as on JAX
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)
    model = build_mlp()
    model.set_weights(weights)
    compile_mlp(model)
    losses, _ = train(model, x, y, batch_size=BATCH, epochs=EPOCHS)

    assert_matches(reference, losses, model, x)
    for variable in model.weights:  # the layouts Keras' ModelParallel gives on JAX
        assert specs(variable) == list(distribution.get_variable_layout(variable).axes), variable.path
    assert specs(model.get_layer("up").kernel) == [None, "model"]
    assert specs(model.get_layer("down").bias) == [None]
    strategy = model.distribute_strategy
    assert isinstance(strategy, tfmp.ModelParallelStrategy)
    # Keras looked up the output's layout and laid the output out with it.
    assert strategy.layout_map.unmatched_keys() == []


class OwnLayoutDense(keras.layers.Layer):
    """A layer written for Keras on JAX that gives its kernel a layout of its
    own, `keras.Variable(..., layout=...)`."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = keras.Variable(
            keras.initializers.GlorotUniform(seed=3)((input_shape[-1], self.units)),
            name="kernel",
            layout=keras.distribution.TensorLayout((None, "model")),
        )

    def call(self, x):
        return keras.ops.matmul(x, self.kernel)


def build_own_layout_mlp():
    return keras.Sequential(
        [keras.Input((16,)), OwnLayoutDense(32, name="up"), keras.layers.Dense(8, name="down")],
        name="mlp",
    )


def test_rules_added_after_set_distribution_and_variable_layouts_apply_as_on_jax():
    """On JAX a variable's own `layout=` wins over the layout map, and the map
    is read as each variable is made, so rules added after `set_distribution`
    apply to a model built later."""
    x, y = mlp_data(N)
    weights = initial_weights(build_own_layout_mlp)
    reference = one_device(build_own_layout_mlp, compile_mlp, weights, x, y)

    layout_map = keras_layout_map({".*up/kernel": ("model", None)})  # the variable's own layout wins
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    layout_map[".*down/kernel"] = ("model", None)  # added after set_distribution
    model = build_own_layout_mlp()
    model.set_weights(weights)
    compile_mlp(model)
    losses, _ = train(model, x, y, batch_size=BATCH, epochs=EPOCHS)

    assert_matches(reference, losses, model, x)
    assert specs(model.get_layer("up").kernel) == [None, "model"]
    assert specs(model.get_layer("down").kernel) == ["model", None]
    assert set(model.distribute_strategy.layout_map) == {".*up/kernel", ".*down/kernel"}
    # `tf.keras.distribution` is Keras' own module: the same functions.
    assert tf.keras.distribution.set_distribution is keras.distribution.set_distribution


TRANSFORMER_RULES = {
    ".*token_embedding/embeddings": ("model", None),
    ".*(query|key|value)/kernel": (None, "model", None),
    ".*(query|key|value)/bias": ("model", None),
    ".*attention_output/kernel": ("model", None, None),
    ".*ffn_in/kernel": (None, "model"),
    ".*ffn_in/bias": ("model",),
    ".*ffn_out/kernel": ("model", None),
    ".*lm_head/kernel": (None, "model"),
    ".*lm_head/bias": ("model",),
}


def build_small_transformer():
    return build_transformer_lm(vocab_size=32, seq_len=4, d_model=16, num_heads=4, ffn_dim=32)


def test_model_parallel_transformer_in_distribution_scope_matches_one_device():
    x, y = next_token_data(N, seq_len=4, vocab_size=32, seed=1)
    weights = initial_weights(build_small_transformer)
    reference = one_device(build_small_transformer, compile_lm, weights, x, y)

    device_mesh = keras.distribution.DeviceMesh(
        (2, 4), ["batch", "model"], keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for key, axes in TRANSFORMER_RULES.items():
        layout_map[key] = axes
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        model = build_small_transformer()
        model.set_weights(weights)
        compile_lm(model)
        losses, _ = train(model, x, y, batch_size=BATCH, epochs=EPOCHS)
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()

    # Predictions after the scope still run on the mesh the model lives on.
    assert_matches(reference, losses, model, x, zero_gradient="key/bias")
    sharded = 0
    for variable in model.weights:
        assert specs(variable) == list(distribution.get_variable_layout(variable).axes), variable.path
        sharded += "model" in specs(variable)
    assert sharded == 13
    assert model.distribute_strategy.layout_map.unmatched_keys() == []


def test_distribute_tensor_places_a_tensor_with_its_layout():
    device_mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(device_mesh)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    layout = keras.distribution.TensorLayout(("batch", "model"), device_mesh)
    value = np.arange(32, dtype="float32").reshape(4, 8)

    placed = keras.distribution.distribute_tensor(tf.constant(value), layout)

    assert list(tf.experimental.dtensor.fetch_layout(placed).sharding_specs) == ["batch", "model"]
    shards = tf.experimental.dtensor.unpack(placed)
    np.testing.assert_array_equal(shards[1].numpy(), value[:2, 2:4])
    with pytest.raises(ValueError, match=r"layout \('batch',\) has 1 entries for a tensor of rank 2"):
        keras.distribution.distribute_tensor(tf.constant(value), ("batch",))


def test_set_distribution_none_returns_to_plain_keras(mlp):
    x, y, weights, reference = mlp
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    assert isinstance(tf.distribute.get_strategy(), tfmp.ModelParallelStrategy)

    keras.distribution.set_distribution(None)

    assert not tf.distribute.has_strategy()
    model = compile_mlp(build_mlp())
    model.set_weights(weights)
    losses, _ = train(model, x, y, batch_size=BATCH, epochs=EPOCHS)
    assert losses == reference[0]  # bit for bit: plain Keras' own code
    assert not isinstance(model.get_layer("up").kernel.value, MeshVariable)


def test_a_scope_inside_a_set_distribution_gives_it_back():
    outer = keras.distribution.DataParallel()
    keras.distribution.set_distribution(outer)
    outer_strategy = tf.distribute.get_strategy()
    inner = keras.distribution.ModelParallel(layout_map=keras_layout_map({}))

    with inner.scope():
        assert tf.distribute.get_strategy().mesh.axis_names == ("batch", "model")
        with inner.scope():  # entered again: the same strategy, so the same variables' mesh
            inner_strategy = tf.distribute.get_strategy()
        assert tf.distribute.get_strategy() is inner_strategy

    assert keras.distribution.distribution() is outer
    assert tf.distribute.get_strategy() is outer_strategy
    assert outer_strategy.mesh.shape == (8,) and outer_strategy.batch_axis == "batch"
    keras.distribution.set_distribution(None)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(RuntimeError, match="inside a `tf.distribute.Strategy` scope"):
            keras.distribution.set_distribution(inner)


def test_a_distribution_set_before_tfmp_is_imported_runs_on_the_mesh():
    from keras.src.backend.common import global_state

    from tfmp.strategy.keras_distribution import follow_distribution_set_before_import

    distribution = keras.distribution.DataParallel()
    # What Keras' own set_distribution does, before tfmp's import wraps it.
    global_state.set_global_attribute("distribution", distribution)
    assert not tf.distribute.has_strategy()

    follow_distribution_set_before_import()  # run by `import tfmp`

    assert keras.distribution.distribution() is distribution
    assert tf.distribute.get_strategy().mesh.shape == (8,)


# What cannot be honoured, and layout maps that match nothing ------------------


def keras_layout_map(rules):
    device_mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for key, axes in rules.items():
        layout_map[key] = axes
    return layout_map


def test_a_key_matching_part_of_a_path_warns_with_the_full_match_key(mlp):
    x, y, weights, _ = mlp
    layout_map = keras_layout_map({"up/kernel": (None, "model"), ".*down/kernel": ("model", None)})
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model = compile_mlp(build_mlp())
    model.set_weights(weights)

    with pytest.warns(UserWarning, match=r"\['up/kernel'\] matched no variable.*re\.fullmatch.*'mlp/up/kernel'; the key '\.\*up/kernel' would match"):
        model.fit(x[:16], y[:16], batch_size=BATCH, verbose=0)
    assert specs(model.get_layer("up").kernel) == [None, None]


def test_a_layout_map_matching_no_variable_is_an_error(mlp):
    x, y, weights, _ = mlp
    layout_map = keras_layout_map({"up/kernel": (None, "model"), "down/kernel": ("model", None)})
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model = compile_mlp(build_mlp())

    with pytest.raises(ValueError, match=r"no LayoutMap key matched any of the model's .*100% replicated.*'\.\*up/kernel' would match"):
        model.fit(x[:16], y[:16], batch_size=BATCH, verbose=0)


def test_require_match_false_trains_a_replicated_model_on_purpose(mlp):
    x, y, weights, _ = mlp
    layout_map = keras_layout_map({"up/kernel": (None, "model")})
    strategy = tfmp.ModelParallelStrategy.from_keras(
        keras.distribution.ModelParallel(layout_map=layout_map), require_match=False
    )
    with strategy.scope():
        model = compile_mlp(build_mlp())
    with pytest.warns(UserWarning, match=r"matched no variable"):
        model.fit(x[:16], y[:16], batch_size=BATCH, verbose=0)


class ShardsEverythingOnModel(keras.distribution.ModelParallel):
    def get_variable_layout(self, variable):
        return keras.distribution.TensorLayout((None,) * len(variable.shape), self.device_mesh)


@pytest.mark.parametrize(
    "value, error, message",
    [
        (
            lambda: ShardsEverythingOnModel(layout_map=keras_layout_map({})),
            ValueError,
            r"overrides \['get_variable_layout'\] of keras.distribution.ModelParallel",
        ),
        (lambda: "data_parallel", TypeError, r"takes a keras.distribution.ModelParallel or .*DataParallel, got str"),
    ],
    ids=["overridden-layouts", "not-a-distribution"],
)
def test_set_distribution_refuses_what_it_cannot_honour(value, error, message):
    with pytest.raises(error, match=message):
        keras.distribution.set_distribution(value())
    assert keras.distribution.distribution() is None
    assert not tf.distribute.has_strategy()


def test_initialize_needs_every_process_address():
    with pytest.raises(ValueError, match=r"needs 2 addresses"):
        keras.distribution.initialize("10.0.0.1:1234", num_processes=2, process_id=0)


def test_tfmp_layout_maps_keep_matching_anywhere_in_the_path():
    """tfmp's own LayoutMap searches (`re.search`): no full-match hint, and
    the same nothing-matched error, with its opt-out."""
    device_mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["gone/kernel"] = ("model", None)
    assert layout_map.check_matched() is False  # no variable yet: nothing to judge
    assert layout_map.match("mlp/up/kernel") == ("up/kernel", (None, "model"))
    with pytest.warns(UserWarning, match=r"\['gone/kernel'\] matched no variable") as caught:
        assert layout_map.check_matched()
    assert "fullmatch" not in str(caught[0].message)

    nothing = tfmp.LayoutMap(device_mesh)
    nothing["gone/kernel"] = ("model", None)
    assert nothing.match("mlp/up/kernel") is None
    with pytest.raises(ValueError, match=r"no LayoutMap key matched any of the model's 1 variables"):
        nothing.check_matched()
    nothing.require_match = False
    with pytest.warns(UserWarning, match=r"matched no variable"):
        nothing.check_matched()

    empty = tfmp.LayoutMap(device_mesh)
    assert empty.match("mlp/up/kernel") is None
    assert empty.check_matched()  # replicating everything is what an empty map asks for
