"""Image warps and crops on a mesh give Keras' own numbers on one device.

The warps run TensorFlow's own kernel (`ImageProjectiveTransformV3`),
replicated by DTensor's switch (`tfmp._env.REPLICATED_OPS`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import PatchesHeld, assert_parity, mesh, rules
from tfmp.forward import forward_on

RNG = np.random.default_rng(0)
IMAGES = RNG.normal(size=(9, 7, 9, 2)).astype("float32")
IDENTITY = np.array([1, 0, 0, 0, 1, 0, 0, 0], "float32")
TRANSFORMS = np.concatenate(
    [
        # Rotations, zooms and shears (as Keras' affine layers make them).
        IDENTITY + RNG.normal(scale=[0.6, 0.6, 3, 0.6, 0.6, 3, 0, 0], size=(3, 8)).astype("float32"),
        # Whole and half-pixel shifts: coordinates on pixels and on rounding ties.
        [[1, 0, -2.5, 0, 1, 1.5, 0, 0], [1, 0, 0.5, 0, 1, -0.5, 0, 0], [0.5, 0, 0, 0, 0.5, 0, 0, 0]],
        # Coordinates several image sizes away, where reflect and wrap fold.
        [[3, 0.2, -40, 0.1, 2.5, 25, 0, 0], [-2, 0, 30, 0, -3, -20, 0, 0], [1, 0, 100, 0, 1, -100, 0, 0]],
    ]
).astype("float32")
UPSTREAM = RNG.normal(size=IMAGES.shape).astype("float32")


def warp_and_gradient(warp, images):
    """`warp(images)` and the gradient of sum(warp(images) * UPSTREAM)."""
    images = tf.constant(images)
    with tf.GradientTape() as tape:
        tape.watch(images)
        warped = warp(images)
        loss = tf.reduce_sum(warped * UPSTREAM[: len(warped)])
    return warped.numpy(), tape.gradient(loss, images).numpy()


def assert_close(got, want):
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.fixture(scope="module")
def device_mesh():
    held = PatchesHeld()
    yield mesh((2, 4)).dtensor_mesh
    del held


def on_mesh(device_mesh, value, layout_specs):
    replicated = dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(device_mesh, value.ndim))
    return dtensor.relayout(replicated, dtensor.Layout(layout_specs, device_mesh))


def whole(value, device_mesh):
    return dtensor.relayout(value, dtensor.Layout.replicated(device_mesh, value.shape.rank))


def test_warps_on_a_mesh(device_mesh):
    """Batch-split images through Keras' ops in a forward pass on the mesh:
    values and gradients as Keras' own on one device."""
    images, transforms = IMAGES[:4], TRANSFORMS[:4]
    corners = np.array([[[0, 0], [8, 0], [0, 6], [8, 6]]] * 4, "float32")
    shifted = corners + np.random.default_rng(3).normal(scale=0.8, size=corners.shape).astype("float32")
    warps = {
        "affine": lambda x: keras.ops.image.affine_transform(x, transforms, "bilinear", "reflect"),
        "affine_nearest": lambda x: keras.ops.image.affine_transform(x, transforms, "nearest", "wrap", 0.5),
        "perspective": lambda x: keras.ops.image.perspective_transform(x, corners, shifted),
    }

    @tf.function
    def traced(x):
        with forward_on(device_mesh):
            return {name: warp_and_gradient_traced(warp, x) for name, warp in warps.items()}

    def warp_and_gradient_traced(warp, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            warped = warp(x)
            loss = tf.reduce_sum(warped * UPSTREAM[:4])
        return [whole(warped, device_mesh), whole(tape.gradient(loss, x), device_mesh)]

    got = traced(on_mesh(device_mesh, images, ["batch"] + [dtensor.UNSHARDED] * 3))
    for name, warp in warps.items():
        for ours, keras_own in zip(got[name], warp_and_gradient(warp, images)):
            assert_close(ours.numpy(), keras_own)


TRACED_SLICES = {
    "crop": lambda x, h: x[:, h : h + 4, h + 1 : h + 4, :],
    "shifted_bounds": lambda x, h: x[1:3, h - 1 : h + 2],
    "index": lambda x, h: x[:, h],
    "ellipsis": lambda x, h: x[..., h - 2 : h],
}


@pytest.mark.parametrize("name", TRACED_SLICES)
def test_slices_at_traced_offsets_on_a_mesh(device_mesh, name):
    """RandomCrop's `x[:, h:h + k]` (DTensor gives empty shards for it) and
    its variants: values and gradients of a batch-split tensor."""
    index = TRACED_SLICES[name]
    x = np.arange(4 * 6 * 6 * 3, dtype="float32").reshape(4, 6, 6, 3)
    offset = 2

    @tf.function
    def traced(x, h):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with forward_on(device_mesh):
                sliced = index(x, h)
            loss = tf.reduce_sum(sliced * sliced)
        return whole(sliced, device_mesh), whole(tape.gradient(loss, x), device_mesh)

    sliced, gradient = traced(
        on_mesh(device_mesh, x, ["batch"] + [dtensor.UNSHARDED] * 3),
        dtensor.copy_to_mesh(tf.constant(offset), dtensor.Layout.replicated(device_mesh, 0)),
    )
    want = index(x, offset)
    np.testing.assert_array_equal(sliced.numpy(), want)
    expected_gradient = np.zeros_like(x)
    index(expected_gradient, offset)[...] = 2 * want
    np.testing.assert_array_equal(gradient.numpy(), expected_gradient)


@pytest.mark.parametrize(
    "index",
    [
        lambda x, h: x[:, h:],
        lambda x, h: x[:, :h],
        lambda x, h: x[:, h : 2 * h],
        lambda x, h: x[:, h : h + 4 : 2],
    ],
    ids=["to-end", "from-start", "scaled", "strided"],
)
def test_slices_of_traced_size_are_a_clear_error(device_mesh, index):
    traced = tf.function(lambda x, h: index(x, h), autograph=False)
    with forward_on(device_mesh):
        with pytest.raises(ValueError, match=r"x\[a:a \+ k\]"):
            traced(tf.zeros((4, 6)), tf.constant(1))


def test_elastic_transform_is_declined_on_a_mesh(device_mesh):
    traced = tf.function(lambda x: keras.ops.image.elastic_transform(x, seed=1), autograph=False)
    with forward_on(device_mesh):
        with pytest.raises(ValueError, match="tf.data pipeline"):
            traced(tf.zeros((4, 6, 6, 3)))


def build_augmented() -> keras.Model:
    """A Dense before a crop and a warp, so that gradients flow back through
    both (the gather of the crop, the warp's registered gradient)."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            layers.Dense(3, name="before"),
            layers.RandomCrop(5, 5, seed=1),
            layers.RandomRotation(0.2, fill_mode="constant", seed=2),
            # Pooled: under any tf.distribute strategy Keras builds the model
            # with training=False, where RandomCrop keeps the input's size.
            layers.GlobalAveragePooling2D(),
            layers.Dense(4, name="after"),
        ],
        name="augmented",
    )


def test_augmentation_layers_train_as_one_device_8x1():
    rng = np.random.default_rng(4)
    x = rng.uniform(size=(24, 6, 6, 3)).astype("float32")
    y = rng.normal(size=(24, 4)).astype("float32")
    assert_parity(build_augmented, rules({}), x, y, mesh_shape=(8, 1))


class PairGrid(keras.layers.Layer):
    """XLNet's segment matrix in small: `ids[:, None]` against `ids[:, :, None]`."""

    def call(self, x):
        ids = keras.ops.cast(x[:, :, 0] > 0, "float32")
        grid = ids[:, None] - ids[:, :, None]
        return x * keras.ops.sum(grid, axis=1)[:, :, None]


def test_new_axis_before_unnamed_dimensions():
    """DTensor's StridedSlice rule reads a garbage sharding spec for the
    dimensions `x[:, None]` leaves unnamed (a crash, or an error Python cannot
    decode): tfmp names them."""

    def build():
        inputs = keras.Input((6, 4))
        hidden = PairGrid(name="grid")(keras.layers.Dense(4, name="in")(inputs))
        return keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 6, 4)).astype("float32"), rng.normal(size=(12, 6, 2)).astype("float32")
    assert_parity(build, None, x, y)
