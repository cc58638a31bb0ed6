"""Array ops DTensor joins, orders or loops over wrongly, in models that train
on the mesh as on one device: concatenation and stacking along a dimension
layout propagation splits, backward slices, sorts, rolls, triangles,
transposes, loops of a fixed length and gathers with batch_dims counted from
the back (tfmp/lowering/joins.py, arrays.py, loops.py, indexing.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from helpers import assert_parity, rules

RNG = np.random.default_rng(0)
Y = RNG.normal(size=(24, 4)).astype("float32")


def build_branches(axis):
    """Two branches joined by keras.layers.Concatenate, then a Dense."""

    def build():
        inputs = keras.Input((16,))
        relu = keras.layers.Dense(32, activation="relu", name="relu")(inputs)
        tanh = keras.layers.Dense(32, activation="tanh", name="tanh")(inputs)
        joined = keras.layers.Concatenate(axis=axis)([relu, tanh])
        hidden = keras.layers.Dense(64, activation="relu", name="rows")(joined)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))

    return build


@pytest.mark.parametrize("axis", [-1, 1])
def test_concatenate_before_a_row_parallel_dense(axis):
    """The Dense's kernel split on rows asks for the concatenation split on
    the joined features: with axis=-1 DTensor joined each device's shards
    (wrong losses from the first step), with axis=1 it refused."""
    x = RNG.normal(size=(24, 16)).astype("float32")
    assert_parity(build_branches(axis), rules({"rows/kernel": ("model", None)}), x, Y)


class Rotary(keras.layers.Layer):
    """Rotates the halves of the last dimension, as rotary embeddings do."""

    def call(self, x):
        first, second = x[..., :4], x[..., 4:]
        return x * 0.5 + ops.concatenate([-second, first], axis=-1)


class ClassToken(keras.layers.Layer):
    """A learned token before the sequence (ViT's class token)."""

    def build(self, input_shape):
        self.token = self.add_weight(shape=(1, 1, input_shape[-1]), name="token")

    def call(self, x):
        token = ops.broadcast_to(self.token, (ops.shape(x)[0], 1, x.shape[-1]))
        return ops.concatenate([token, x], axis=1)


def build_attention_like():
    inputs = keras.Input((5, 16))
    heads = keras.layers.EinsumDense("bsf,fhd->bshd", (5, 4, 8), name="query")(inputs)
    rotated = Rotary(name="rotary")(heads)
    merged = keras.layers.EinsumDense("bshd,hdf->bsf", (5, 16), name="output")(rotated)
    sequence = ClassToken(name="class_token")(merged)
    rows = keras.layers.Dense(8, name="rows")(sequence)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.Flatten()(rows)))


def test_joins_of_rank_three_and_four_with_heads_and_features_split():
    """Rotary halves with heads split over "model", a class token joined on
    the sequence, features split by rows after it."""
    x = RNG.normal(size=(24, 5, 16)).astype("float32")
    layout = rules(
        {"query/kernel": (None, "model", None), "output/kernel": ("model", None, None), "rows/kernel": ("model", None)}
    )
    assert_parity(build_attention_like, layout, x, Y)


class Similarities(keras.layers.Layer):
    """CLIP's logits in small: text-image similarities, and the same
    transposed (per image)."""

    def call(self, image, text):
        per_text = ops.matmul(text, ops.transpose(image))
        return ops.concatenate(
            [ops.logsumexp(per_text, axis=-1, keepdims=True), ops.logsumexp(ops.transpose(per_text), axis=-1, keepdims=True)],
            axis=-1,
        )


def test_transposed_batch_by_batch_logits():
    """The (batch, batch) logits are split on rows, transposed, and asked
    for split on rows again: DTensor's Transpose refused ("TransposeOp SPMD
    needs communication"); tfmp's einsum moves the split."""

    def build():
        image, text = keras.Input((6,), name="image"), keras.Input((6,), name="text")
        logits = Similarities(name="similarities")(
            keras.layers.Dense(8, name="image_proj")(image), keras.layers.Dense(8, name="text_proj")(text)
        )
        return keras.Model({"image": image, "text": text}, keras.layers.Dense(4, name="head")(logits))

    x = {name: RNG.normal(size=(24, 6)).astype("float32") for name in ("image", "text")}
    assert_parity(build, lambda device_mesh: "auto", x, Y)


class Op(keras.layers.Layer):
    def __init__(self, function, **kwargs):
        super().__init__(**kwargs)
        self.function = function

    def call(self, x):
        return self.function(x)


def _grid(x):
    return ops.reshape(x, (-1, 4, 4, 4))


OPS = {
    # Pack of the columns of a feature-split tensor; Unpack along a split dimension.
    "stack_and_unstack": lambda x: ops.reshape(ops.stack([x, 2 * x], axis=1), (-1, 128))[:, 32:96]
    + ops.reshape(ops.stack(ops.unstack(_grid(x), axis=-1)[::-1], axis=-1), (-1, 64)),
    # StridedSlice with negative steps reversed each device's shard.
    "backward_slices": lambda x: ops.concatenate(
        [x[:, ::-1], x[:, 40:8:-2], ops.reshape(_grid(x)[:, ::-1, :, ::-2], (-1, 32))], axis=1
    ),
    # TopKV2 refuses a split sorted dimension; Roll and MatrixBandPart have no rule.
    "sort_roll_triangles": lambda x: ops.sort(x) + ops.roll(x, 3, axis=1)
    + ops.reshape(ops.tril(ops.reshape(x, (-1, 8, 8)), -1) + ops.triu(ops.reshape(x, (-1, 8, 8)), 2), (-1, 64)),
    # while loops over TensorArrays: unrolled when their length is fixed.
    "loops": lambda x: ops.fori_loop(0, 3, lambda i, v: v * 0.9 + ops.cast(i, "float32"), x)
    + ops.transpose(ops.scan(lambda c, r: (c * 0.5 + r, c), ops.zeros_like(ops.transpose(x)[0]), ops.transpose(x))[1])
    + ops.transpose(ops.map(lambda r: r * 2.0 + ops.sum(r), ops.transpose(x))),
    # GatherV2 with batch_dims=-1 crashed the process in DTensor's expansion.
    "gather_batch_dims_from_the_back": lambda x: tf.gather(
        x, tf.argsort(tf.stop_gradient(x[:, :8]), axis=-1), axis=-1, batch_dims=-1
    ),
}


@pytest.mark.parametrize("name", OPS)
def test_array_ops_on_split_features(name):
    """Each op between a column-parallel and a row-parallel Dense (auto
    layouts): its input comes split over "model" on the last dimension."""

    def build():
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(64, name="up")(inputs)
        hidden = keras.layers.Flatten()(Op(OPS[name], name="op")(hidden))
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))

    x = RNG.normal(size=(24, 16)).astype("float32")
    assert_parity(build, lambda device_mesh: "auto", x, Y)
