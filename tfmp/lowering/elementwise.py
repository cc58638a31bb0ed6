"""Elementwise ops whose TensorFlow gradient builds tensors from shapes.

TensorFlow's gradient of `clip_by_value` fills zeros of the gradient's
shape, read with `tf.shape`. When the step's batch size is known only as it
runs (Keras retraces the step with an unknown one for a second batch size,
or a partial last batch), DTensor fills the global shape under the split
gradient's labels, and a later op gets shards of the wrong size: GPT-OSS's
clipped expert activations, split over experts ("shape of dy was [4,16,32]
instead of [1,16,32]" in the StridedSliceGrad after it). Here the gradient
is selected elementwise against a scalar zero: the same values, with the
gradient's own layout.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfmp.lowering.registry import Lowering, keras_original

_KERAS_NUMPY = "keras.src.backend.tensorflow.numpy"


def clip(x: Any, x_min: Any, x_max: Any) -> Any:
    """`keras.ops.clip` with bounds known when traced: TensorFlow's forward
    pass, and its gradient (passed where `x_min <= x <= x_max`, zero
    elsewhere) without a shape-built zeros."""
    original = keras_original(_KERAS_NUMPY, "clip")
    bounds = [tf.get_static_value(bound) for bound in (x_min, x_max)]
    x = tf.convert_to_tensor(x)
    if any(bound is None for bound in bounds) or not x.dtype.is_floating:
        return original(x, x_min, x_max)
    low, high = (tf.constant(bound, x.dtype) for bound in bounds)

    @tf.custom_gradient
    def clipped(x: tf.Tensor):
        def grad(dy: tf.Tensor) -> tf.Tensor:
            inside = tf.logical_and(x >= low, x <= high)
            return tf.where(inside, dy, tf.constant(0, dy.dtype))

        return original(x, x_min, x_max), grad

    return clipped(x)


LOWERINGS = (
    Lowering(
        _KERAS_NUMPY,
        "clip",
        clip,
        "clip_by_value's gradient fills zeros of a shape read in the step",
    ),
)
