"""A mean whose gradient DTensor lays out whatever the split of its input.

TensorFlow's gradient of `reduce_mean` tiles the output's gradient back to
the input's shape, and DTensor expands that `Tile` wrongly when the input's
kept dimensions are split over a mesh axis: a conv split over its filters,
then `GlobalAveragePooling2D`, fails to train ("'tf.Tile' op requires
input.shape[3] (8) * 1 to be equal to output.shape[3] (2)"). Here the
gradient is the output's gradient divided by the count, broadcast by an
elementwise product with ones over the reduced dimensions: the same values,
in ops DTensor lays out any way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow.core import convert_to_tensor as keras_tensor

from tfmp.lowering.registry import Lowering, keras_original

_KERAS_NUMPY = "keras.src.backend.tensorflow.numpy"


def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """`keras.src.backend.tensorflow.numpy.mean`, with a broadcast gradient
    for floating inputs (sparse and integer ones are Keras' own)."""
    original = keras_original(_KERAS_NUMPY, "mean")
    if isinstance(x, tf.IndexedSlices):
        return original(x, axis, keepdims)
    x = keras_tensor(x)
    if not x.dtype.is_floating:
        return original(x, axis, keepdims)
    rank = x.shape.rank
    axes = range(rank) if axis is None else [a % rank for a in np.atleast_1d(axis)]
    reduced = sorted(set(axes))

    @tf.custom_gradient
    def averaged(x: tf.Tensor):
        def grad(dy: tf.Tensor) -> tf.Tensor:
            if not keepdims:
                for a in reduced:
                    dy = tf.expand_dims(dy, a)
            # Keras averages low precision in float32: so is the gradient.
            dtype = tf.float64 if x.dtype == tf.float64 else tf.float32
            share = tf.cast(tf.cast(dy, dtype) / _count(x, reduced, dtype), x.dtype)
            return share * _ones_over(x, reduced)

        return original(x, axis, keepdims), grad

    return averaged(x)


def _ones_over(x: tf.Tensor, reduced: list[int]) -> tf.Tensor:
    """Ones that broadcast the mean's gradient over the reduced dimensions:
    a constant, 1 on the kept dimensions, where their sizes are known (the
    gradient keeps the layout of the output's, even with a batch size known
    only in the step, where `zeros_like(x)` fills the global shape under
    `x`'s split labels: "Incompatible shapes: [2,1,1,4] vs. [2,8,8,16]");
    else ones like `x`."""
    sizes = [x.shape[a] if a in reduced else 1 for a in range(x.shape.rank)]
    if all(size is not None for size in sizes):
        return tf.ones(sizes, x.dtype)
    return tf.ones_like(x)


def _count(x: tf.Tensor, reduced: list[int], dtype: tf.DType) -> tf.Tensor:
    """How many values each mean averages: static where the shape is known."""
    sizes = [x.shape[a] for a in reduced]
    if all(size is not None for size in sizes):
        return tf.constant(float(np.prod(sizes)), dtype)
    return tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), reduced)), dtype)


LOWERINGS = (
    Lowering(
        _KERAS_NUMPY,
        "mean",
        mean,
        "reduce_mean's gradient Tile mis-expands when the kept dimensions are split",
    ),
)
