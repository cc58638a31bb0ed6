"""ParallelConv2D: parity with keras.layers.Conv2D for every split."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import assert_parity, mesh
from tfmp.lowering.conv import conv


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("strides,dilation", [(1, 1), (2, 1), (1, 2)])
def test_tap_lowering_matches_tf_convolution(padding, strides, dilation):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 7, 9, 3)), tf.float32)
    kernel = tf.constant(rng.normal(size=(3, 3, 3, 4)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, kernel])
        want = tf.nn.convolution(x, kernel, strides, padding.upper(), dilations=dilation)
        got = conv(x, kernel, strides, padding, "channels_last", dilation)
        want_loss, got_loss = tf.reduce_sum(want**2), tf.reduce_sum(got**2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(tape.gradient(got_loss, [x, kernel]), tape.gradient(want_loss, [x, kernel])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


def build_cnn() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 4)),
            tfmp.layers.ParallelConv2D(8, 3, padding="same", split="filters", activation="relu", name="filters"),
            tfmp.layers.ParallelConv2D(8, 3, padding="same", split="channels", activation="relu", name="channels"),
            tfmp.layers.ParallelConv2D(8, 3, strides=2, padding="same", split="spatial", name="spatial"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3, name="out"),
        ],
        name="cnn",
    )


def compile_cnn(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
def test_cnn_parity(shape):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, 8, 8, 4)).astype("float32")
    y = rng.normal(size=(48, 3)).astype("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = assert_parity(
            build_cnn, None, x, y, strategy=tfmp.ModelParallelStrategy(mesh(shape)),
            compile_fn=compile_cnn, steps=6, loss_atol=0, prediction_atol=1e-5, batch_size=8,
        )
    assert any("split='spatial') gathers its input's height" in str(w.message) for w in caught)
    specs = {layer.name: layer.kernel.value.layout.sharding_specs for layer in model.layers[:3]}
    assert specs["filters"][3] == "model" and specs["channels"][2] == "model"
    assert model.get_layer("spatial").kernel.value.layout.is_fully_replicated()


def test_off_the_mesh_it_is_conv2d():
    layer = tfmp.layers.ParallelConv2D(4, 3, strides=2, padding="same", split="channels")
    plain = keras.layers.Conv2D(4, 3, strides=2, padding="same")
    layer.build((None, 9, 9, 2))
    plain.build((None, 9, 9, 2))
    plain.set_weights(layer.get_weights())
    x = np.random.default_rng(2).normal(size=(2, 9, 9, 2)).astype("float32")
    np.testing.assert_array_equal(layer(x).numpy(), plain(x).numpy())
    assert tfmp.layers.ParallelConv2D.from_config(layer.get_config()).split == "channels"


def test_bad_split_is_an_error():
    with pytest.raises(ValueError, match=r"split='rows'.*'filters', 'channels', 'spatial'"):
        tfmp.layers.ParallelConv2D(4, 3, split="rows")
    with pytest.raises(ValueError, match="padding 'valid' or 'same'"):
        tfmp.layers.ParallelConv2D(4, 3, padding=((1, 1), (1, 1)))
    with pytest.raises(ValueError, match="channels_last"):
        tfmp.layers.ParallelConv2D(4, 3, data_format="channels_first")
