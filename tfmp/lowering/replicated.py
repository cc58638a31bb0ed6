"""Keras functions whose TensorFlow op DTensor has no layout rule for, run
replicated: their inputs gathered one mesh axis at a time, then Keras' own.

DTensor runs such an op replicated once its switch is set
(`tfmp._env.REPLICATED_OPS`), gathering the inputs itself; but it gathers
every mesh axis of an input in one relayout, which its gather lowering
(`LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2`, set by tfmp) fails to
compile for an input of rank 3 or more split over two axes ("'tf.Reshape' op
requires 'output' number of elements to match": `ops.roll` of scores split
over "batch" and "model"), and places shards wrongly for a tensor split in
another order than the mesh's axes (`tfmp.layout.replicated`). On a mesh the
function's tensor arguments are first gathered by `tfmp.layout.replicated`,
one axis per relayout; DTensor then finds them whole. The same bytes move.
The result is pinned whole, as the op computes it.

One mechanism for every such function: an entry here names the function and
the op it runs, and the op goes into `tfmp._env.REPLICATED_OPS`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.core import convert_to_tensor
from tensorflow.experimental import dtensor

from tfmp.forward import REPLICATED_SCOPE, forward_mesh
from tfmp.layout import replicated
from tfmp.lowering.registry import Lowering, keras_original

_KERAS_NUMPY = "keras.src.backend.tensorflow.numpy"
_KERAS_IMAGE = "keras.src.backend.tensorflow.image"
_KERAS_NN = "keras.src.backend.tensorflow.nn"


def gathered_first(module: str, name: str, op: str) -> Callable:
    """Keras' `module.name` with each tensor argument first gathered whole
    onto every device of the forward pass's mesh, one mesh axis at a time."""

    def lowered(*args: Any, **kwargs: Any) -> Any:
        original = keras_original(module, name)
        bound = inspect.signature(original).bind(*args, **kwargs)
        mesh = forward_mesh()
        # The scope names the gathers after the op (`tfmp.comm_report`, the
        # first step's note): DTensor names a collective after the op whose
        # input it relayouts, and the identity is that op.
        with tf.name_scope(f"{REPLICATED_SCOPE}{op}"):
            for parameter, value in bound.arguments.items():
                if isinstance(value, (tf.Tensor, tf.Variable, keras.Variable)) and value.shape.rank:
                    bound.arguments[parameter] = replicated(tf.identity(convert_to_tensor(value)), mesh)
        result = original(*bound.args, **bound.kwargs)
        if mesh is None or not isinstance(result, tf.Tensor) or not result.shape.rank:
            return result
        return _whole(result, mesh)

    lowered.__name__ = lowered.__qualname__ = name
    lowered.__doc__ = f"Keras' `{name}` on inputs gathered whole, one mesh axis at a time."
    return lowered


def _whole(value: tf.Tensor, mesh: dtensor.Mesh) -> tf.Tensor:
    """`value` pinned whole, as the op computed it: DTensor would otherwise
    take a consumer's split for the op's output, which an op with a
    batch-only rule refuses (DepthwiseConv2dNative before a bias split over
    its channels). Its gradient is gathered one mesh axis at a time too
    (from a consumer split over "batch" and "model")."""

    @tf.custom_gradient
    def pinned(value: tf.Tensor) -> tf.Tensor:
        def gradient(upstream: tf.Tensor) -> tf.Tensor:
            return replicated(upstream, mesh)

        return dtensor.relayout(value, dtensor.Layout.replicated(mesh, value.shape.rank)), gradient

    return pinned(value)


_TWO_AXES = (
    "has no layout rule; DTensor's replicated default gathers two mesh axes in one "
    "relayout, which its collective gather lowering fails"
)

_DEPTHWISE = (
    "and DepthwiseConv2dNativeBackpropInput have no layout rule, and DepthwiseConv2dNative "
    "expands a batch split only; gathered is as fast as DepthwiseConv2dNative on its batch "
    "split and 3.5-27x faster than tfmp's former sum over taps (bench/generic_path.py)"
)

# (module, function, the op DTensor has no rule for, why the gather, first Keras release).
_FUNCTIONS = (
    (_KERAS_NUMPY, "roll", "Roll", _TWO_AXES, "3.12"),
    (_KERAS_NUMPY, "flip", "ReverseV2", _TWO_AXES, "3.12"),
    (_KERAS_NUMPY, "fliplr", "ReverseV2", _TWO_AXES, "3.14"),
    (_KERAS_NUMPY, "flipud", "ReverseV2", _TWO_AXES, "3.14"),
    (_KERAS_IMAGE, "affine_transform", "ImageProjectiveTransformV3", _TWO_AXES, "3.12"),
    (_KERAS_IMAGE, "perspective_transform", "ImageProjectiveTransformV3", _TWO_AXES, "3.12"),
    (
        _KERAS_NN,
        "average_pool",
        "AvgPoolGrad",
        "has no layout rule, and AvgPool expands a batch split only (a pooling after a "
        "conv split over its filters fails)",
        "3.12",
    ),
    (_KERAS_NN, "depthwise_conv", "DepthwiseConv2dNativeBackpropFilter", _DEPTHWISE, "3.12"),
    (_KERAS_NN, "separable_conv", "DepthwiseConv2dNativeBackpropFilter", _DEPTHWISE, "3.12"),
)

LOWERINGS = tuple(
    Lowering(module, name, gathered_first(module, name, op), f"{op} {why}", since=since)
    for module, name, op, why, since in _FUNCTIONS
)
