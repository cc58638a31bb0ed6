"""A 2-D convolution written as a sum over kernel taps of channel matmuls.

DTensor's own Conv2D refuses split kernels on CPU and GPU. Written as
`y = sum over taps (i, j) of einsum("nhwc,cf->nhwf", x shifted by (i, j), K[i, j])`
it is made only of ops DTensor lays out: split filters (`f`) need no
communication forward, split channels (`c`) one all-reduce of `y`. The custom
gradient forms `dx` as one sum of per-tap contractions, so that a filter split
costs one all-reduce of `dx` backward, as Megatron's column split, instead of
one per tap.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.layers.declaring import BACKWARD_SCOPE


def conv2d_by_taps(
    x: tf.Tensor,
    kernel: tf.Tensor,
    strides: Sequence[int],
    padding: str,
    dilation_rate: Sequence[int],
    pad_layouts: tuple[dtensor.Layout, dtensor.Layout] | None = None,
) -> tf.Tensor:
    """`tf.nn.convolution` (NHWC, HWIO kernel) computed tap by tap.

    Args:
        x: Input of shape `(batch, height, width, channels)`, static height and
            width.
        kernel: Kernel of shape `(kh, kw, channels, filters)`.
        strides: `(sh, sw)`.
        padding: `"valid"` or `"same"` (as TensorFlow pads).
        dilation_rate: `(dh, dw)`.
        pad_layouts: On a mesh, the layouts of the zero-padded input and of the
            zero-padded output gradient: DTensor pads only within one layout,
            and cannot always infer it.

    Returns:
        The convolution, shape `(batch, out_height, out_width, filters)`.
    """
    height, width = x.shape[1], x.shape[2]
    if height is None or width is None:
        raise ValueError(
            f"tfmp's split convolution needs a static height and width; got input "
            f"shape {x.shape}. Give the model's Input a full spatial shape."
        )
    kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
    rows = _axis_plan(height, kh, strides[0], dilation_rate[0], padding)
    cols = _axis_plan(width, kw, strides[1], dilation_rate[1], padding)
    taps = [(i, j) for i in range(kh) for j in range(kw)]

    def pad(value: tf.Tensor, paddings: list, which: int) -> tf.Tensor:
        if pad_layouts is None:
            return tf.pad(value, paddings)
        layout = pad_layouts[which]
        return dtensor.relayout(tf.pad(dtensor.relayout(value, layout), paddings), layout)

    @tf.custom_gradient
    def convolve(x: tf.Tensor, kernel: tf.Tensor):
        padded = pad(x, [[0, 0], rows.pads, cols.pads, [0, 0]], 0)
        patches = {tap: _patch(padded, tap, rows, cols) for tap in taps}
        y = tf.add_n(
            [tf.einsum("nhwc,cf->nhwf", patches[i, j], kernel[i, j]) for i, j in taps]
        )

        def grad(dy: tf.Tensor):
            with tf.name_scope(BACKWARD_SCOPE):
                return tap_grads(dy)

        def tap_grads(dy: tf.Tensor):
            # Zeros between the rows and columns undo the stride; each tap's
            # patch gradient is dy moved to where the patch was read.
            spread = _spread(dy, rows.stride, cols.stride)
            padded_dx = tf.add_n(
                [
                    tf.einsum(
                        "nhwf,cf->nhwc",
                        pad(spread, _placement(spread, (i, j), rows, cols), 1),
                        kernel[i, j],
                    )
                    for i, j in taps
                ]
            )
            dx = padded_dx[
                :, rows.pads[0] : rows.pads[0] + height, cols.pads[0] : cols.pads[0] + width
            ]
            dkernel = tf.stack(
                [
                    tf.stack(
                        [tf.einsum("nhwc,nhwf->cf", patches[i, j], dy) for j in range(kw)]
                    )
                    for i in range(kh)
                ]
            )
            return dx, dkernel

        return y, grad

    return convolve(x, kernel)


class _AxisPlan:
    """Padding, output size, stride and dilation along one spatial axis."""

    def __init__(self, size: int, taps: int, stride: int, dilation: int, padding: str):
        span = (taps - 1) * dilation + 1
        if padding == "same":
            self.output = -(-size // stride)
            total = max((self.output - 1) * stride + span - size, 0)
            self.pads = [total // 2, total - total // 2]
        elif padding == "valid":
            self.output = (size - span) // stride + 1
            self.pads = [0, 0]
        else:
            raise ValueError(
                f"tfmp's split convolution supports padding 'valid' or 'same', got "
                f"{padding!r}."
            )
        self.padded = size + sum(self.pads)
        self.stride = stride
        self.dilation = dilation
        self.read = (self.output - 1) * stride + 1  # rows one tap reads, stride included


def _axis_plan(size: int, taps: int, stride: int, dilation: int, padding: str) -> _AxisPlan:
    return _AxisPlan(int(size), taps, int(stride), int(dilation), padding)


def _patch(padded: tf.Tensor, tap: tuple[int, int], rows: _AxisPlan, cols: _AxisPlan):
    top, left = tap[0] * rows.dilation, tap[1] * cols.dilation
    return padded[
        :, top : top + rows.read : rows.stride, left : left + cols.read : cols.stride
    ]


def _spread(dy: tf.Tensor, row_stride: int, col_stride: int) -> tf.Tensor:
    """Inserts `stride - 1` zeros between the rows and columns of `dy`."""
    if row_stride == 1 and col_stride == 1:
        return dy
    n, h, w, f = tf.unstack(tf.shape(dy))
    grid = dy[:, :, None, :, None, :]
    grid = tf.pad(grid, [[0, 0], [0, 0], [0, row_stride - 1], [0, 0], [0, col_stride - 1], [0, 0]])
    grid = tf.reshape(grid, [n, h * row_stride, w * col_stride, f])
    return grid[:, : (dy.shape[1] - 1) * row_stride + 1, : (dy.shape[2] - 1) * col_stride + 1]


def _placement(spread: tf.Tensor, tap: tuple[int, int], rows: _AxisPlan, cols: _AxisPlan):
    """Paddings that put `spread` where a tap read the padded input."""
    top, left = tap[0] * rows.dilation, tap[1] * cols.dilation
    return [
        [0, 0],
        [top, rows.padded - top - rows.read],
        [left, cols.padded - left - cols.read],
        [0, 0],
    ]
