"""Convolutions (Keras' Conv and ConvTranspose layers) as Keras' own op on
the batch split, or as sums over kernel taps of channel matmuls
(`tfmp.lowering.taps`).

DTensor's own convolutions refuse split kernels on CPU and GPU ("Filter for
convolution must have fully replicated layout"), split input channels, and
transposed convolutions of anything but a batch split. (The depthwise and
separable convolutions run Keras' own on inputs gathered whole:
`tfmp.lowering.replicated`, measured faster than a sum over taps.)

A convolution or transposed convolution whose kernel is whole (split over no
mesh axis) runs as Keras' own op on its batch split (`_native_conv`):
DTensor's Conv ops and their gradients take that layout, and one op per
device beats a product per tap. So does a split kernel gathered whole where
the work each device then duplicates is small (`_runs_natively`); a larger
one runs tap-wise, as do grouped and channels-first convolutions.
Keras' `add`, which adds a conv layer's bias, is lowered too (see `add`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import tensorflow as tf
from keras.src.backend import standardize_data_format
from keras.src.backend.common import dtypes
from keras.src.backend.common.backend_utils import compute_conv_transpose_output_shape
from keras.src.backend.tensorflow import sparse as keras_sparse
from keras.src.backend.tensorflow.core import convert_to_tensor as keras_tensor
from tensorflow.experimental import dtensor

from tfmp.forward import BACKWARD_SCOPE, compute_specs, forward_mesh
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
    """`keras.src.backend.tensorflow.nn.conv` as a sum over kernel taps, or
    as Keras' own where the kernel is whole or cheap to gather.

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
        if _runs_natively(kernel, pinning, data_format, "cf"):
            keras_conv = keras_original(_KERAS_NN, "conv")
            return _native_conv(
                lambda x, k: keras_conv(x, k, strides, padding, "channels_last", dilation_rate),
                inputs,
                kernel_tensor,
                compute_specs(kernel),
                pinning,
                "cf",
            )
        convolve = _dense_conv
    else:
        in_channels = out_channels = "g"
        pinning = Pinning.current(inputs, _grouped_channels(kernel, channels // per_group))
        convolve = _grouped_conv
    x = _to_channels_last(inputs, data_format, pinning, in_channels)
    taps = conv_taps(x, pinning, kernel_tensor.shape[:-2], strides, padding, dilation_rate)
    return _from_channels_last(convolve(x, kernel_tensor, taps), data_format, pinning, out_channels)


def _runs_natively(kernel: Any, pinning: Pinning, data_format: str | None, channels: str) -> bool:
    """Whether Keras' own convolution runs this one (`_native_conv`): a
    tfmp variable's kernel, channels last, whole or cheap to gather.

    A whole kernel always runs natively: DTensor's Conv ops and their
    gradients take a batch split. A split kernel is gathered where the
    work every device then duplicates is small beside what the sum over
    taps moves (`_gathered_work_per_moved_element`). `channels` names the
    kernel's last two dimensions: "cf" (input channels, filters) for a
    convolution, "fc" for a transposed one."""
    specs = compute_specs(kernel)
    return (
        specs is not None
        and pinning.mesh is not None
        and not _channels_first(data_format)
        and _gathered_work_per_moved_element(kernel.shape, specs, pinning.mesh, channels)
        <= GATHERED_WORK_PER_MOVED_ELEMENT
    )


# Where the two ways crossed in bench/native_conv.py (a convnet on 2x4 and
# 1x8 meshes of 8 CPU devices, docs/performance.md): the filter split of a
# 128x128-channel kernel ran as fast either way at 77 and 1.06-1.23x faster
# as a sum over taps at 100; every split below (16 to 64 channels, and the
# channel splits of 128x128 at 65 and 83) ran 1.15-2x faster gathered.
GATHERED_WORK_PER_MOVED_ELEMENT = 90


def _gathered_work_per_moved_element(
    shape: Any, specs: tuple[str, ...], mesh: dtensor.Mesh, channels: str = "cf"
) -> float:
    """Multiply-adds every device duplicates when it convolves with the
    whole kernel, per element the sum over taps moves instead; 0 for a
    whole kernel.

    Per output position and tap, a device's share of a kernel split into
    `shards` is `C * F / shards` multiply-adds; gathered, it computes all
    `C * F`. The sum over taps reads `C_local` input channels and adds
    `F_local` partial sums per position and tap, and where the input
    channels are split, all-reduces the `F` outputs once per position (an
    all-reduce moves each element about twice). `channels` says which of
    the kernel's last two dimensions is `C` ("c") and which `F` ("f")."""

    def split(spec: str) -> int:
        return 1 if spec == dtensor.UNSHARDED else mesh.dim_size(spec)

    shards = math.prod(split(spec) for spec in specs)
    if shards == 1:
        return 0.0
    sizes = dict(zip(channels, shape[-2:]))
    splits = dict(zip(channels, (split(spec) for spec in specs[-2:])))
    moved = sizes["c"] / splits["c"] + sizes["f"] / splits["f"]
    if splits["c"] > 1:
        moved += 2 * sizes["f"] / math.prod(shape[:-2])
    return (1 - 1 / shards) * sizes["c"] * sizes["f"] / moved


def _native_conv(
    convolve: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
    x: tf.Tensor,
    kernel: tf.Tensor,
    kernel_specs: tuple[str, ...],
    pinning: Pinning,
    channels: str,
) -> tf.Tensor:
    """`convolve(x, kernel)`, Keras' own (channels last), on `x` pinned to
    its batch split and `kernel` gathered whole (spatial dimensions and
    channels whole): one op per device instead of a product per tap, and
    one device's sums.

    `channels` names the kernel's last two dimensions as the pinning does:
    "cf" for a convolution (input channels `c`, filters `f`), "fc" for a
    transposed one, whose input has the kernel's last dimension. The output
    leaves split as the kernel splits its own; its gradient is pinned whole
    before DTensor's own gradient ops run (which refuse split channels), and
    the input's gradient leaves in `x`'s pinned layout (a relayout's own
    gradient, back to the layout `x` came in, fails DTensor's layout
    propagation after a split layer), the kernel's in `kernel_specs`, the
    variable's."""
    spatial = SPATIAL_LETTERS[-(x.shape.rank - 2) :]
    kernel_letters = SPATIAL_LETTERS[-(kernel.shape.rank - 2) :] + "cf"
    patch, out = f"n{spatial}{channels[0]}", f"n{spatial}{channels[1]}"
    whole = Pinning(pinning.mesh, pinning.batch)
    kernel_layout = dtensor.Layout(list(kernel_specs), pinning.mesh)

    @tf.custom_gradient
    def native(x: tf.Tensor, kernel: tf.Tensor):
        x = tf.stop_gradient(whole.pin(x, patch))
        kernel = tf.stop_gradient(whole.pin(kernel, kernel_letters))
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = convolve(x, kernel)

        def grad(dy: tf.Tensor):
            with tf.name_scope(BACKWARD_SCOPE):
                dx, dkernel = tape.gradient(y, [x, kernel], output_gradients=whole.pin(dy, out))
                dx, dkernel = whole.pin(dx, patch), whole.pin(dkernel, kernel_letters)
                return pinning.pin(dx, patch), dtensor.relayout(dkernel, kernel_layout)

        # Whole first: DTensor would carry a filter split back onto Conv2D.
        return pinning.pin(whole.pin(y, out), out), grad

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
    sum over kernel taps, or as Keras' own where the kernel is whole or
    cheap to gather.

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
    if _runs_natively(kernel, pinning, data_format, "fc"):
        keras_conv_transpose = keras_original(_KERAS_NN, "conv_transpose")
        y = _native_conv(
            lambda x, k: keras_conv_transpose(x, k, strides, padding, output_padding, "channels_last", dilation_rate),
            x,
            kernel_tensor,
            compute_specs(kernel),
            pinning,
            "fc",
        )
    else:
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


def _kernel_channels(kernel: Any, letters: str) -> dict[str, str]:
    """`letters` (the kernel's last dimensions) -> how the kernel splits them.

    A kernel that is no tfmp variable (computed in the forward pass) tells
    nothing: its channels are pinned whole, which is correct, if not the
    least communication.
    """
    specs = compute_specs(kernel) or (dtensor.UNSHARDED,) * len(letters)
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
