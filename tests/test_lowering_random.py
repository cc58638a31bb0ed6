"""Random draws on a mesh are the ones one device draws for the whole tensor."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import assert_parity, mesh, rules
from tfmp.forward import MicrobatchedStep, forward_on
from tfmp.strategy.variable import MeshVariable

# Every random layer gets a `seed=` of its own: SeedGenerator states are no
# part of `get_weights`, so this is how both runs start them alike.


def build_regularized() -> keras.Model:
    """Every noise layer, on an activation split over batch and "model", and
    attention dropout on probabilities split over heads."""
    x = inputs = keras.Input((4, 16))
    x = keras.layers.Dense(32, activation="relu", name="up")(x)
    for layer in (
        keras.layers.Dropout(0.3, seed=1),
        keras.layers.SpatialDropout1D(0.3, seed=2),
        keras.layers.GaussianNoise(0.2, seed=3),
        keras.layers.GaussianDropout(0.3, seed=4),
        keras.layers.AlphaDropout(0.3, seed=5),
    ):
        x = layer(x)
    x = keras.layers.MultiHeadAttention(8, 4, dropout=0.3, seed=6, name="attention")(x, x)
    return keras.Model(inputs, keras.layers.Dense(8, name="down")(x), name="regularized")


def build_augmented() -> keras.Model:
    """Augmentation layers on a batch of images, and SpatialDropout2D on
    channels split over "model". (RandomRotation, RandomZoom and
    RandomTranslation transform with `ImageProjectiveTransformV3`, and
    RandomCrop slices at a traced offset: DTensor lays out neither.)"""
    return keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.RandomFlip(seed=11),
            keras.layers.RandomContrast(0.3, seed=12),
            keras.layers.RandomBrightness(0.3, value_range=(0.0, 1.0), seed=13),
            keras.layers.Dense(8, activation="relu", name="up"),
            keras.layers.SpatialDropout2D(0.3, seed=14),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4, name="down"),
        ],
        name="augmented",
    )


DENSE_SPLIT = {"up/kernel": (None, "model"), "up/bias": ("model",), "down/kernel": ("model", None)}
HEADS_SPLIT = {
    "attention/(query|key|value)/kernel": (None, "model", None),
    "attention/attention_output/kernel": ("model", None, None),
}


def data(x_shape, y_shape, n=24):
    rng = np.random.default_rng(0)
    return (
        rng.uniform(size=(n, *x_shape)).astype("float32"),
        rng.normal(size=(n, *y_shape)).astype("float32"),
    )


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)])
def test_noise_layers_match_one_device(mesh_shape):
    # atol: the attention key bias, whose exact gradient is zero, moves by float noise.
    split = rules({**DENSE_SPLIT, **HEADS_SPLIT})
    assert_parity(build_regularized, split, *data((4, 16), (4, 8)), mesh_shape=mesh_shape, atol=1e-4)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)])
def test_augmentation_layers_match_one_device(mesh_shape):
    assert_parity(build_augmented, rules(DENSE_SPLIT), *data((6, 6, 3), (4,)), mesh_shape=mesh_shape)


def build_pipeline() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((16,)),
            tfmp.layers.LayerGroup(
                [keras.layers.Dense(32, activation="relu", name="up"), keras.layers.Dropout(0.3, seed=1)],
                stage=0,
            ),
            tfmp.layers.LayerGroup(
                [keras.layers.GaussianNoise(0.2, seed=2), keras.layers.Dense(8, name="down")], stage=1
            ),
        ]
    )


def test_pipeline_stage_draws_match_one_device():
    """A stage draws on its own sub-mesh. One microbatch: with more, each
    microbatch draws anew for its rows, which one device with the whole
    batch does not."""
    strategy = tfmp.ModelParallelStrategy(
        tfmp.DeviceMesh((2, 2, 2), ("stage", "batch", "model")),
        {"up/kernel": (None, "model"), "down/kernel": ("model", None)},
        num_microbatches=1,
    )
    x, y = data((16,), (8,), n=32)
    assert_parity(build_pipeline, None, x, y, strategy=strategy, steps=2, loss_atol=0, batch_size=16)


@pytest.fixture(scope="module")
def strategy():
    """A (2, 4) mesh's strategy (creating it installs tfmp's lowerings)."""
    device_mesh = mesh((2, 4))
    return tfmp.ModelParallelStrategy(device_mesh, tfmp.LayoutMap(device_mesh))


def draws(x, seed):
    """A draw of each kind random layers make, every one laid out like `x`
    (split over batch and "model"), so that DTensor would split the draw:
    `x * 0 + draw` is `draw` bitwise."""
    zeros = x * 0
    shape = tf.shape(x)
    return {
        "uniform": zeros + keras.random.uniform(shape, seed=seed),
        "normal": zeros + keras.random.normal(shape, 1.0, 2.0, seed=seed),
        "truncated_normal": zeros + keras.random.truncated_normal(shape, seed=seed),
        "randint": tf.cast(zeros, "int32") + keras.random.randint(shape, 0, 100, seed=seed),
        "dropout": keras.random.dropout(x, 0.5, seed=seed),
        "dropout_by_row": keras.random.dropout(x, 0.5, noise_shape=(None, 1), seed=seed),
        "shuffle_rows": keras.random.shuffle(x, seed=seed),
        "shuffle_columns": keras.random.shuffle(x, axis=1, seed=seed),
        "int_seed": zeros + keras.random.uniform(shape, seed=5),
        # Ops DTensor has no layout rule for, run replicated (tfmp._env.REPLICATED_OPS).
        "gamma": zeros + keras.random.gamma(shape, 2.0, seed=seed),
        "binomial": zeros + keras.random.binomial(shape, 5.0, 0.5, seed=seed),
        "beta": zeros + keras.random.beta(shape, 2.0, 3.0, seed=seed),
        "categorical": tf.cast(zeros, "int32")
        + keras.random.categorical(x, x.shape[-1], dtype="int32", seed=seed),
    }


def traced_draws(seed, dtensor_mesh):
    """`draws` as a function traced as a layer's forward pass on `dtensor_mesh`."""

    @tf.function
    def traced(x):
        with forward_on(dtensor_mesh):
            return draws(x, seed)

    return traced


def test_draws_on_the_mesh_are_one_devices_bitwise(strategy):
    device_mesh = strategy.extended.home_mesh.dtensor_mesh
    x = np.arange(32, dtype="float32").reshape(4, 8) / 10
    off_mesh = traced_draws(keras.random.SeedGenerator(7), None)
    with strategy.scope():
        seed = keras.random.SeedGenerator(7)
    assert isinstance(seed.state.value, MeshVariable)
    on_mesh = traced_draws(seed, device_mesh)
    split = dtensor.relayout(
        dtensor.copy_to_mesh(tf.constant(x), dtensor.Layout.replicated(device_mesh, 2)),
        dtensor.Layout(["batch", "model"], device_mesh),
    )
    for _ in range(2):  # the second round draws from the advanced seed states
        want, got = off_mesh(tf.constant(x)), on_mesh(split)
        for name, value in got.items():
            whole = dtensor.relayout(value, dtensor.Layout.replicated(device_mesh, 2))
            for copy in dtensor.unpack(whole):
                np.testing.assert_array_equal(copy, want[name], err_msg=name)


def test_categorical_in_pipeline_microbatches_is_a_clear_error(strategy):
    """A micro-batch holds only its rows of the logits: one device's draw for
    the whole batch cannot be made from them."""
    step = MicrobatchedStep(count=2, rows=4)
    traced = tf.function(lambda: keras.random.categorical(tf.zeros((4, 3)), 2, seed=1))
    with forward_on(strategy.extended.home_mesh.dtensor_mesh), step.microbatch(0):
        with pytest.raises(ValueError, match="keras.random.categorical in pipeline micro-batches"):
            traced()
