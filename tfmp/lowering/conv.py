"""Convolutions (Keras' Conv and ConvTranspose layers) as sums over kernel
taps of channel matmuls (`tfmp.lowering.taps`), or as Keras' own where the
kernel is whole.

DTensor's own convolutions refuse split kernels on CPU and GPU ("Filter for
convolution must have fully replicated layout"), split input channels, and
transposed convolutions of anything but a batch split. (The depthwise and
separable convolutions run Keras' own on inputs gathered whole:
`tfmp.lowering.replicated`, measured faster than a sum over taps.)

A convolution whose kernel is whole (split over no mesh axis) runs as Keras'
own op on its batch split (`_native_conv`): DTensor's Conv ops and their
gradients take that layout, and one op per device beats a product per tap.
Keras' `add`, which adds a conv layer's bias, is lowered too (see `add`).
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from keras.src.backend import standardize_data_format
from keras.src.backend.common import dtypes
from keras.src.backend.common.backend_utils import compute_conv_transpose_output_shape
from keras.src.backend.tensorflow import sparse as keras_sparse
from keras.src.backend.tensorflow.core import convert_to_tensor as keras_tensor
from tensorflow.experimental import dtensor

from tfmp.forward import BACKWARD_SCOPE, forward_mesh
from tfmp.lowering.registry import Lowering, keras_original
from tfmp.lowering.taps import (
    SPATIAL_LETTERS,
    Pinning,
    Taps,
    conv_by_taps,
    conv_taps,
    conv_transpose_by_taps,
    dense_contraction,
    grouped_contraction,
    per_axis,
)

_KERAS_NN = "keras.src.backend.tensorflow.nn"


# --- Keras' backend functions, on the mesh ----------------------------------


def conv(
    inputs: Any,
    kernel: Any,
    strides: Any = 1,
    padding: str = "valid",
    data_format: str | None = None,
    dilation_rate: Any = 1,
) -> tf.Tensor:
    """`keras.src.backend.tensorflow.nn.conv` as a sum over kernel taps.

    Groups (`channels != kernel.shape[-2]`) contract each group's channels
    with its filters only.

    Args:
        inputs: `(batch, *spatial, channels)`, or channels first.
        kernel: `(*taps, channels // groups, filters)`.
        strides: An int or one per spatial axis.
        padding: `"valid"` or `"same"`.
        data_format: `"channels_last"`, `"channels_first"` or None (Keras'
            default).
        dilation_rate: An int or one per spatial axis.

    Returns:
        The convolution, in `data_format`.
    """
    inputs, kernel_tensor = _tensors(inputs, kernel, "conv")
    channels, per_group = _channel_count(inputs, data_format), kernel_tensor.shape[-2]
    if channels == per_group:
        in_channels, out_channels = "c", "f"
        pinning = Pinning.current(inputs, _kernel_channels(kernel, "cf"))
        if _runs_natively(kernel, pinning, data_format):
            return _native_conv(inputs, kernel_tensor, pinning, strides, padding, dilation_rate)
        convolve = _dense_conv
    else:
        in_channels = out_channels = "g"
        pinning = Pinning.current(inputs, _grouped_channels(kernel, channels // per_group))
        convolve = _grouped_conv
    x = _to_channels_last(inputs, data_format, pinning, in_channels)
    taps = conv_taps(x, pinning, kernel_tensor.shape[:-2], strides, padding, dilation_rate)
    return _from_channels_last(convolve(x, kernel_tensor, taps), data_format, pinning, out_channels)


def _runs_natively(kernel: Any, pinning: Pinning, data_format: str | None) -> bool:
    """Whether DTensor's own convolution runs this one: a whole kernel (a
    tfmp variable split over no mesh axis), channels last. It splits the
    batch only, which DTensor's Conv ops and their gradients take."""
    specs = _kernel_specs(kernel)
    return (
        specs is not None
        and all(spec == dtensor.UNSHARDED for spec in specs)
        and pinning.mesh is not None
        and not _channels_first(data_format)
    )


def _native_conv(
    x: tf.Tensor, kernel: tf.Tensor, pinning: Pinning, strides: Any, padding: str, dilation_rate: Any
) -> tf.Tensor:
    """Keras' own convolution, on `x` pinned to its batch split (spatial
    dimensions and channels whole): one op per device instead of a product
    per tap, and one device's sums. The output's gradient is pinned alike
    before DTensor's own gradient ops run, and the input's gradient leaves
    in that layout (a relayout's own gradient, back to the layout `x` came
    in, fails DTensor's layout propagation after a split layer)."""
    spatial = SPATIAL_LETTERS[-(x.shape.rank - 2) :]
    patch, out = f"n{spatial}c", f"n{spatial}f"
    convolve = keras_original(_KERAS_NN, "conv")

    @tf.custom_gradient
    def native(x: tf.Tensor, kernel: tf.Tensor):
        x = tf.stop_gradient(pinning.pin(x, patch))
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = convolve(x, kernel, strides, padding, "channels_last", dilation_rate)

        def grad(dy: tf.Tensor):
            with tf.name_scope(BACKWARD_SCOPE):
                dx, dkernel = tape.gradient(y, [x, kernel], output_gradients=pinning.pin(dy, out))
                return pinning.pin(dx, patch), dkernel

        return pinning.pin(y, out), grad

    return native(x, kernel)


def _dense_conv(x: tf.Tensor, kernel: tf.Tensor, taps: Taps) -> tf.Tensor:
    return conv_by_taps(x, kernel, taps, dense_contraction(len(taps.plans)))


def _grouped_conv(x: tf.Tensor, kernel: tf.Tensor, taps: Taps) -> tf.Tensor:
    channels, per_group, filters = x.shape[-1], kernel.shape[-2], kernel.shape[-1]
    groups = channels // per_group
    if channels % per_group or filters % groups:
        raise ValueError(
            f"conv: `inputs` have {channels} channels and `kernel` {per_group} per "
            f"group and {filters} filters; channels and filters must divide into the "
            "same number of groups. Check the layer's `groups`."
        )
    spec = grouped_contraction(len(taps.plans))
    # Channels as (groups, per group): a split of whole groups stays on `g`.
    grouped = taps.pinning.reshape(x, x.shape[1:-1] + [groups, per_group], spec.patch)
    grouped_kernel = tf.reshape(kernel, kernel.shape[:-1] + [groups, filters // groups])
    y = conv_by_taps(grouped, grouped_kernel, taps, spec)
    return taps.pinning.reshape(y, y.shape[1:-2] + [filters], spec.out[:-2] + "g")


def conv_transpose(
    inputs: Any,
    kernel: Any,
    strides: Any = 1,
    padding: str = "valid",
    output_padding: Any = None,
    data_format: str | None = None,
    dilation_rate: Any = 1,
) -> tf.Tensor:
    """`keras.src.backend.tensorflow.nn.conv_transpose` as the adjoint of a
    sum over kernel taps.

    Args:
        inputs: `(batch, *spatial, channels)`, or channels first.
        kernel: `(*taps, filters, channels)`.
        strides: An int or one per spatial axis.
        padding: `"valid"` or `"same"`.
        output_padding: None, an int or one per spatial axis: extra size
            after the output, as Keras computes it.
        data_format: `"channels_last"`, `"channels_first"` or None.
        dilation_rate: An int or one per spatial axis.

    Returns:
        `(batch, *output spatial, filters)`, in `data_format`.
    """
    inputs, kernel_tensor = _tensors(inputs, kernel, "conv_transpose")
    # The adjoint of a convolution whose kernel this is: its filters `f` are
    # this one's input channels, its channels `c` this one's filters.
    pinning = Pinning.current(inputs, _kernel_channels(kernel, "cf"))
    x = _to_channels_last(inputs, data_format, pinning, "f")
    rank = x.shape.rank - 2
    output_shape = compute_conv_transpose_output_shape(
        x.shape.as_list(),
        kernel_tensor.shape[:-2],
        kernel_tensor.shape[-2],
        per_axis(strides, rank),
        padding,
        output_padding,
        "channels_last",
        per_axis(dilation_rate, rank),
    )
    taps = conv_taps(x, pinning, kernel_tensor.shape[:-2], strides, padding, dilation_rate, output_shape[1:-1])
    for plan, size in zip(taps.plans, x.shape[1:-1]):
        if plan.output != size:
            raise ValueError(
                f"conv_transpose: output_padding={output_padding!r} gives an output of "
                f"size {plan.size} along an axis, which a stride-{plan.stride} "
                f"convolution maps to {plan.output}, not to the input's {size}. Use an "
                "output_padding smaller than the stride."
            )
    y = conv_transpose_by_taps(x, kernel_tensor, taps, dense_contraction(rank))
    return _from_channels_last(y, data_format, pinning, "c")


def _tensors(inputs: Any, kernel: Any, function: str) -> tuple[tf.Tensor, tf.Tensor]:
    """`inputs` and `kernel` as tensors; the taps are planned from static shapes."""
    inputs = tf.convert_to_tensor(inputs)
    if None in inputs.shape[1:]:
        raise ValueError(
            f"tfmp's {function} on a mesh needs a static spatial shape and channel "
            f"count; got `inputs` of shape {inputs.shape}. Give the model's "
            "keras.Input a full shape, e.g. keras.Input((32, 32, 3))."
        )
    return inputs, tf.convert_to_tensor(kernel, inputs.dtype)


def _kernel_specs(kernel: Any) -> tuple[str, ...] | None:
    """How a tfmp variable (or the Keras variable around one) is split in
    the forward pass; None for any other kernel."""
    variable = getattr(kernel, "_value", kernel)  # a Keras variable's backend variable
    layout = getattr(variable, "compute_layout", None)
    return None if layout is None else tuple(layout.sharding_specs)


def _kernel_channels(kernel: Any, letters: str) -> dict[str, str]:
    """`letters` (the kernel's last dimensions) -> how the kernel splits them.

    A kernel that is no tfmp variable (computed in the forward pass) tells
    nothing: its channels are pinned whole, which is correct, if not the
    least communication.
    """
    specs = _kernel_specs(kernel) or (dtensor.UNSHARDED,) * len(letters)
    return dict(zip(letters, specs[-len(letters) :]))


def _grouped_channels(kernel: Any, groups: int) -> dict[str, str]:
    """Channel splits of a grouped convolution: a filter split of whole
    groups splits the groups `g`; the flat channels of its input and output
    are then split alike."""
    channels = _kernel_channels(kernel, "cf")
    by_filters = channels["f"]
    mesh = forward_mesh()
    whole_groups = (
        by_filters != dtensor.UNSHARDED and mesh is not None and groups % mesh.dim_size(by_filters) == 0
    )
    group_split = by_filters if whole_groups else dtensor.UNSHARDED
    return {"c": channels["c"], "g": group_split, "f": dtensor.UNSHARDED}


def _channel_count(inputs: tf.Tensor, data_format: str | None) -> int:
    return inputs.shape[1] if _channels_first(data_format) else inputs.shape[-1]


def _channels_first(data_format: str | None) -> bool:
    return standardize_data_format(data_format) == "channels_first"


def _to_channels_last(
    inputs: tf.Tensor, data_format: str | None, pinning: Pinning, channels: str
) -> tf.Tensor:
    """`inputs` channels last; `channels` names their channel dimension."""
    if not _channels_first(data_format):
        return inputs
    spatial = SPATIAL_LETTERS[-(inputs.shape.rank - 2) :]
    return pinning.transpose(inputs, f"n{channels}{spatial}", f"n{spatial}{channels}")


def _from_channels_last(y: tf.Tensor, data_format: str | None, pinning: Pinning, channels: str) -> tf.Tensor:
    """`y` in `data_format`; `channels` names its channel dimension."""
    if not _channels_first(data_format):
        return y
    spatial = SPATIAL_LETTERS[-(y.shape.rank - 2) :]
    return pinning.transpose(y, f"n{spatial}{channels}", f"n{channels}{spatial}")


@keras_sparse.elementwise_binary_union(tf.sparse.add)
def add(x1: Any, x2: Any) -> tf.Tensor:
    """`keras.src.backend.tensorflow.numpy.add`, with a conv layer's bias
    added as DTensor can.

    A conv layer adds its bias reshaped to `(1, ..., 1, filters)` (or
    `(1, filters, 1, ...)`), which Keras turns into
    `tf.nn.bias_add(x1, tf.squeeze(x2))`. DTensor mis-expands that Squeeze
    when the sum is split over channels and the bias is not ("SPMD expansion
    resulted in op output inconsistent with the provided layout": a
    replicated conv feeding a channel-split one), and a rank-3 channels-first
    BiasAdd at all. Here the bias is flattened by a reshape, and added
    channels-first by broadcasting; Keras' choice of axis is kept, and
    anything else is `tf.add` as in Keras.

    Args:
        x1: A tensor.
        x2: A tensor, or a bias as above.

    Returns:
        `x1 + x2`.
    """
    x1, x2 = _common_dtype(x1, x2)
    channels = _bias_size(x1, x2)
    if channels is None:
        return tf.add(x1, x2)
    # A static shape: DTensor expands a reshape to -1 of a split bias wrongly.
    bias = x2 if x2.shape.rank == 1 else tf.reshape(x2, [channels])
    if x1.shape[-1] == channels:
        return tf.nn.bias_add(x1, bias)
    return tf.add(x1, tf.reshape(bias, [1, channels] + [1] * (x1.shape.rank - 2)))


def _common_dtype(x1: Any, x2: Any) -> tuple[Any, Any]:
    """`x1` and `x2` as tensors of their result dtype, as Keras' `add` makes them."""
    if not isinstance(x1, (int, float)):
        x1 = keras_tensor(x1)
    if not isinstance(x2, (int, float)):
        x2 = keras_tensor(x2)
    dtype = dtypes.result_type(getattr(x1, "dtype", type(x1)), getattr(x2, "dtype", type(x2)))
    return keras_tensor(x1, dtype), keras_tensor(x2, dtype)


def _bias_size(x1: tf.Tensor, x2: tf.Tensor) -> int | None:
    """The size of `x2` if Keras would add it as a bias of `x1`, else None."""
    sizes = [d for d in x2.shape.as_list() if d is None or d > 1]
    if len(sizes) != 1 or len(x1.shape) < 2 or sizes[0] is None:
        return None
    return sizes[0] if sizes[0] in (x1.shape.as_list()[1], x1.shape.as_list()[-1]) else None


def _lowering(function: Callable, why: str) -> Lowering:
    return Lowering(_KERAS_NN, function.__name__, function, why)


LOWERINGS: tuple[Lowering, ...] = (
    Lowering(
        "keras.src.backend.tensorflow.numpy",
        "add",
        add,
        "a conv bias's Squeeze, split like the sum but not the bias; rank-3 NCHW BiasAdd",
    ),
    _lowering(conv, "Conv refuses a split kernel or split input channels"),
    _lowering(conv_transpose, "Conv2DBackpropInput takes batch-parallel layouts only"),
)
