"""Max pooling as Keras' own op on the batch split, or, in 3-D, as
elementwise ops over the window's taps.

DTensor expands `MaxPool` and `MaxPoolGrad` for a batch split only, so a
max pooling after a conv split over its filters fails as it stands. A 1-D
or 2-D pooling runs Keras' own on its input pinned to the batch split
(channels gathered where a conv split them), its gradient pinned so too:
two ops where the taps take a slice, a maximum and a select each, measured
0.26-0.89x the step time of the taps on 8x1, 2x4 and 1x8 meshes, channels
split or not, the gather included (docs/performance.md). The pooled output leaves
with its channels whole, the layout a conv split over its filters reads.

A 3-D pooling keeps the taps: on the mesh, `MaxPool3DGrad` sent a tie's
gradient elsewhere than on one device (after a stride-1 pooling, whose
windows repeat maxima). Written over the window's taps,

    y = max over taps t of x shifted by t

a pooling is made of strided slices and maximums, which DTensor lays out
whatever the split of batch and channels, with TensorFlow's gradients. The
taps are the conv lowering's (`tfmp.lowering.taps.Taps`). Max pooling reads
the padding as the lowest value of the dtype, so that it never wins. Taps are
compared in window order and a tie goes to the earlier one, as TensorFlow's
`MaxPoolGrad` sends a tie's gradient to the first maximum.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf
from keras.src.backend import standardize_data_format

from tfmp.forward import BACKWARD_SCOPE
from tfmp.lowering.taps import SPATIAL_LETTERS, Pinning, Taps, axis_plan, per_axis
from tfmp.lowering.registry import Lowering, keras_original

_KERAS_NN = "keras.src.backend.tensorflow.nn"
# The input ranks of the poolings Keras' own op runs (1-D and 2-D); the
# others sum over taps. bench/native_pool.py empties it to time the taps.
NATIVE_INPUT_RANKS = (3, 4)


def max_pool(
    inputs: Any,
    pool_size: Any,
    strides: Any = None,
    padding: str = "valid",
    data_format: str | None = None,
) -> tf.Tensor:
    """`keras.src.backend.tensorflow.nn.max_pool` as Keras' own on the
    batch split (1-D, 2-D), or as a maximum over the window's taps (3-D).

    Args:
        inputs: `(batch, *spatial, channels)`, or channels first.
        pool_size: An int or one per spatial axis.
        strides: An int, one per spatial axis, or None (`pool_size`).
        padding: `"valid"` or `"same"`.
        data_format: `"channels_last"`, `"channels_first"` or None.

    Returns:
        The pooled tensor, in `data_format`.
    """

    x = tf.convert_to_tensor(inputs)
    pinning = Pinning.current(x, {})
    if x.shape.rank in NATIVE_INPUT_RANKS:
        return _native_max_pool(x, pinning, pool_size, strides, padding, data_format)

    def pool(x: tf.Tensor, taps: Taps) -> tf.Tensor:
        inside = _inside(taps, x.dtype)
        lowest = tf.constant(x.dtype.min, x.dtype)
        padded = taps.pad(x) + (1 - inside) * lowest
        windows = [padded[taps.window(tap)] for tap in taps.indices]
        y = windows[0]
        for window in windows[1:]:
            y = tf.maximum(y, window)  # a tie keeps `y`: the earlier tap
        return y

    return _pooled(x, pool_size, strides, padding, data_format, pool)


def _native_max_pool(
    x: tf.Tensor,
    pinning: Pinning,
    pool_size: Any,
    strides: Any,
    padding: str,
    data_format: str | None,
) -> tf.Tensor:
    """Keras' own max pooling of `x` pinned to its batch split, with the
    gradient pinned so too before `MaxPoolGrad` (which DTensor expands on
    that layout) and after it, as the native convolution's
    (`tfmp.lowering.conv`)."""
    spatial = SPATIAL_LETTERS[-(x.shape.rank - 2) :]
    channels_first = standardize_data_format(data_format) == "channels_first"
    letters = f"nc{spatial}" if channels_first else f"n{spatial}c"
    keras_max_pool = keras_original(_KERAS_NN, "max_pool")

    @tf.custom_gradient
    def native(x: tf.Tensor):
        x = tf.stop_gradient(pinning.pin(x, letters))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = keras_max_pool(x, pool_size, strides, padding, data_format)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            with tf.name_scope(BACKWARD_SCOPE):
                dx = tape.gradient(y, x, output_gradients=pinning.pin(dy, letters))
                return pinning.pin(dx, letters)

        return pinning.pin(y, letters), grad

    return native(x)


def _pooled(
    inputs: tf.Tensor,
    pool_size: Any,
    strides: Any,
    padding: str,
    data_format: str | None,
    pool: Callable[[tf.Tensor, Taps], tf.Tensor],
) -> tf.Tensor:
    """`pool` applied channels last to the taps of `inputs`' windows."""
    x = inputs
    rank = x.shape.rank - 2
    channels_first = standardize_data_format(data_format) == "channels_first"
    if channels_first:
        x = tf.transpose(x, [0] + list(range(2, rank + 2)) + [1])
    sizes = per_axis(pool_size, rank)
    steps = sizes if strides is None else per_axis(strides, rank)
    plans = tuple(
        axis_plan(size, taps, stride, 1, padding.lower())
        for size, taps, stride in zip(x.shape[1:-1], sizes, steps)
    )
    y = pool(x, Taps(plans, Pinning()))
    if channels_first:
        y = tf.transpose(y, [0, rank + 1] + list(range(1, rank + 1)))
    return y


def _inside(taps: Taps, dtype: tf.DType) -> tf.Tensor:
    """1 where the padded input holds the input, 0 in the padding: shape
    `(1, *padded spatial, 1)`."""
    masks = [np.pad(np.ones(plan.size), plan.pads) for plan in taps.plans]
    return tf.constant(_outer(masks)[None, ..., None], dtype)


def _outer(vectors: list[np.ndarray]) -> np.ndarray:
    """The outer product of `vectors`, one axis each."""
    result = vectors[0]
    for vector in vectors[1:]:
        result = np.multiply.outer(result, vector)
    return result


LOWERINGS: tuple[Lowering, ...] = (
    Lowering(
        _KERAS_NN,
        "max_pool",
        max_pool,
        "MaxPool expands a batch split only: channels split by a conv's filters fail",
    ),
)
