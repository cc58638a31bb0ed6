"""Convolutions as sums over kernel taps of channel matmuls: the machinery
the conv and pooling lowerings share.

Written as

    y = sum over taps t of einsum(x shifted by t, kernel[t])

a convolution is made only of ops DTensor lays out (strided slices and their
gradients, einsums, sums): split filters need no communication
forward, split input channels one all-reduce of `y`.

The gradients are written by hand: each tap's share of the input gradient is
put in place (a strided pad) *before* its einsum, so that the taps' einsums
feed one sum and a filter split costs one all-reduce of the input gradient, as
Megatron's column split, instead of one per tap. A transposed convolution is
the adjoint of a convolution, so the same three pieces (correlate, its
adjoint, the kernel gradient) make both, with their roles swapped; placing
taps instead of sliding a flipped kernel, nothing is reversed (`tf.reverse`
has no layout propagation). Each tap's kernel gradient is reduced over the
batch split on its own (kernel-sized, one collective per tap).

DTensor infers layouts over the whole step, and some of its choices fail or
cost: zero padding is written as a strided slice's gradient, around which
DTensor relayouts as needed (`tf.pad` fails unless it infers one layout on
both sides), and activations are pinned to explicit layouts around the other
such ops (see `Pinning`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.forward import BACKWARD_SCOPE, batch_spec, forward_mesh

SPATIAL_LETTERS = "dhw"


@dataclasses.dataclass(frozen=True)
class AxisPlan:
    """How one spatial axis of a convolution's input is padded and read.

    Attributes:
        size: The input's size along the axis.
        taps: The kernel's size along the axis.
        stride: The stride.
        dilation: The dilation rate.
        pads: Zeros before and after the input (TensorFlow's "same" padding
            puts the odd one after).
        output: The output's size.
    """

    size: int
    taps: int
    stride: int
    dilation: int
    pads: tuple[int, int]
    output: int

    @property
    def read(self) -> int:
        """Extent one tap reads, strides included."""
        return (self.output - 1) * self.stride + 1

    def start(self, tap: int) -> int:
        """Where tap `tap` starts reading the padded input."""
        return tap * self.dilation


def axis_plan(size: int, taps: int, stride: int, dilation: int, padding: str) -> AxisPlan:
    """Padding and output size along one axis, as TensorFlow computes them.

    Args:
        size: The input's size along the axis.
        taps: The kernel's size along the axis.
        stride: The stride.
        dilation: The dilation rate.
        padding: `"valid"` or `"same"`.

    Returns:
        The axis' plan.
    """
    span = (taps - 1) * dilation + 1
    if padding == "same":
        output = -(-size // stride)
        total = max((output - 1) * stride + span - size, 0)
        pads = (total // 2, total - total // 2)
    elif padding == "valid":
        output = (size - span) // stride + 1
        pads = (0, 0)
    else:
        raise ValueError(
            f"tfmp's convolution supports padding 'valid' or 'same', got padding="
            f"{padding!r}. For other amounts put a keras.layers.ZeroPadding layer "
            "before the convolution and use padding='valid'."
        )
    if output < 1:
        raise ValueError(
            f"The convolution's output would be empty: an input of size {size} is "
            f"smaller than the kernel's span {span} (kernel size {taps}, dilation "
            f"rate {dilation}) with padding={padding!r}. Use a larger input or "
            "padding='same'."
        )
    return AxisPlan(size, taps, stride, dilation, pads, output)


@dataclasses.dataclass(frozen=True)
class TapContraction:
    """The einsums of one kernel tap, by the subscripts of its operands.

    `n` is the batch, `d`, `h`, `w` spatial; the other letters are channel
    dimensions, shared with the kernel tap.

    Attributes:
        patch: Subscripts of the input (and of one tap's patch of it).
        tap: Subscripts of one kernel tap.
        out: Subscripts of the output.
    """

    patch: str
    tap: str
    out: str

    @property
    def forward(self) -> str:
        """(input patch, kernel tap) -> output."""
        return f"{self.patch},{self.tap}->{self.out}"

    @property
    def input_grad(self) -> str:
        """(output gradient in place, kernel tap) -> input gradient."""
        return f"{self.out},{self.tap}->{self.patch}"

    @property
    def kernel_grad(self) -> str:
        """(input patch, output gradient) -> kernel tap gradient."""
        return f"{self.patch},{self.out}->{self.tap}"


def _contraction(rank: int, patch: str, tap: str, out: str) -> TapContraction:
    spatial = SPATIAL_LETTERS[-rank:]
    return TapContraction(f"n{spatial}{patch}", tap, f"n{spatial}{out}")


def dense_contraction(rank: int) -> TapContraction:
    """Each tap is a matmul of channels `c` into filters `f`."""
    return _contraction(rank, "c", "cf", "f")


def grouped_contraction(rank: int) -> TapContraction:
    """Each of the `g` groups is a matmul of its own channels into its filters."""
    return _contraction(rank, "gc", "cgf", "gf")


@dataclasses.dataclass(frozen=True)
class Pinning:
    """The layouts a convolution's activations are pinned to on its mesh.

    DTensor infers layouts over the whole step, and some of its choices fail
    or cost: a transpose whose two sides are split differently ("TransposeOp
    SPMD needs communication"), a sum of the taps' partial sums that a
    consumer wants split (then reduced tap by tap), a reshape asked to gather
    first. The outputs of such ops, the transposes' inputs, and the gradients
    arriving from the next layer are pinned to explicit layouts: the batch
    split as the strategy splits it, spatial dimensions whole (a spatially
    split input is gathered), each channel dimension split as the kernel
    splits it (a `MATCH` spec would leave the other side to inference,
    which fails the same way).

    Attributes:
        mesh: The mesh the convolution runs on, or None off a mesh.
        batch: The mesh axis the batch is split over, or UNSHARDED.
        channels: (subscript, mesh axis or UNSHARDED) of each channel
            dimension; others are whole.
    """

    mesh: dtensor.Mesh | None = None
    batch: str = dtensor.UNSHARDED
    channels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def current(cls, x: tf.Tensor, channels: dict[str, str]) -> Pinning:
        """The pinning of a convolution of `x` in the forward pass being
        traced (read then: a gradient runs after the pass has left its mesh)."""
        mesh = forward_mesh()
        if mesh is None:
            return cls()
        batch = batch_spec(x, mesh, other_axis=None)
        if batch in channels.values():  # a mesh axis splits one dimension at most
            batch = dtensor.UNSHARDED
        return cls(mesh, batch, tuple(channels.items()))

    def pin(self, value: tf.Tensor, subscripts: str) -> tf.Tensor:
        """`value`, whose dimensions `subscripts` name, in its pinned layout."""
        if self.mesh is None:
            return value
        channels = dict(self.channels)
        specs = [self.batch if s == "n" else channels.get(s, dtensor.UNSHARDED) for s in subscripts]
        return dtensor.relayout(value, dtensor.Layout(specs, self.mesh))

    def reshape(self, value: tf.Tensor, dims: Sequence[int], target: str) -> tf.Tensor:
        """`value` reshaped to its batch and `dims`, pinned as `target` names
        them: DTensor keeps a split through a reshape, but a consumer may ask
        it to gather first."""
        return self.pin(tf.reshape(value, [_batch_size(value)] + list(dims)), target)

    def transpose(self, value: tf.Tensor, source: str, target: str) -> tf.Tensor:
        """`value` with dimensions `source` transposed to `target`, pinned
        on both sides."""
        perm = [source.index(s) for s in target]
        return self.pin(tf.transpose(self.pin(value, source), perm), target)


@dataclasses.dataclass(frozen=True)
class Taps:
    """The kernel taps of one convolution: where each reads its padded input.

    Attributes:
        plans: One `AxisPlan` per spatial axis.
        pinning: The layouts of activations on the mesh.
    """

    plans: tuple[AxisPlan, ...]
    pinning: Pinning = Pinning()

    @property
    def indices(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(plan.taps) for plan in self.plans)))

    def window(self, tap: tuple[int, ...]) -> tuple[slice, ...]:
        """The slice of the padded input that tap `tap` reads."""
        return (slice(None),) + tuple(
            slice(plan.start(t), plan.start(t) + plan.read, plan.stride)
            for plan, t in zip(self.plans, tap)
        )

    def padded_shape(self, value: tf.Tensor) -> Any:
        """The padded input's shape, for a batch and channels like `value`'s."""
        spatial = [plan.size + sum(plan.pads) for plan in self.plans]
        channels = value.shape.as_list()[1 + len(self.plans) :]
        if value.shape[0] is not None:
            return [value.shape[0]] + spatial + channels
        return tf.concat([tf.shape(value)[:1], tf.constant(spatial + channels, tf.int32)], 0)

    def place(self, value: tf.Tensor, padded_shape: Any, tap: tuple[int, ...]) -> tf.Tensor:
        """`value` put where tap `tap` reads the padded input (of shape
        `padded_shape`), zeros elsewhere: the gradient of the tap's slice."""
        starts = [plan.start(t) for plan, t in zip(self.plans, tap)]
        reads = [plan.read for plan in self.plans]
        return self._place(value, padded_shape, starts, reads, [plan.stride for plan in self.plans])

    def pad(self, value: tf.Tensor) -> tf.Tensor:
        """`value` zero-padded.

        Placed as a strided slice's gradient rather than by `tf.pad`: DTensor
        pads only where it infers one layout on both sides (a spatially split
        input, or a consumer asking for another split, fail inside DTensor:
        "pad op with input layout different from op output layout"), while it
        relayouts around a slice's gradient as needed.
        """
        starts = [plan.pads[0] for plan in self.plans]
        sizes = [plan.size for plan in self.plans]
        return self._place(value, self.padded_shape(value), starts, sizes, [1] * len(self.plans))

    def _place(
        self,
        value: tf.Tensor,
        padded_shape: Any,
        starts: Sequence[int],
        extents: Sequence[int],
        strides: Sequence[int],
    ) -> tf.Tensor:
        """A tensor of `padded_shape`: zeros, and `value` along the spatial
        axes from `starts`, every `strides`, over `extents`."""
        rank, spatial = value.shape.rank, len(self.plans)
        channels = [0] * (rank - 1 - spatial)
        whole = 1 | sum(1 << axis for axis in range(1 + spatial, rank))  # batch and channels
        return tf.raw_ops.StridedSliceGrad(
            shape=padded_shape,
            begin=[0] + list(starts) + channels,
            end=[0] + [s + e for s, e in zip(starts, extents)] + channels,
            strides=[1] + list(strides) + [1] * len(channels),
            dy=value,
            begin_mask=whole,
            end_mask=whole,
        )

    def crop(self, padded: tf.Tensor) -> tf.Tensor:
        """The input's part of `padded`."""
        return padded[
            (slice(None),)
            + tuple(slice(plan.pads[0], plan.pads[0] + plan.size) for plan in self.plans)
        ]


def kernel_taps(kernel: tf.Tensor, rank: int) -> dict[tuple[int, ...], tf.Tensor]:
    """Each tap of `kernel` (its first `rank` dimensions), by tap index.

    Unstacked: DTensor gathers a split kernel for an indexing slice
    (`kernel[i, j]`), not for an unstack.
    """
    if rank == 0:
        return {(): kernel}
    return {
        (i,) + tap: value
        for i, part in enumerate(tf.unstack(kernel))
        for tap, value in kernel_taps(part, rank - 1).items()
    }


def correlate(padded: tf.Tensor, kernel: tf.Tensor, taps: Taps, spec: TapContraction) -> tf.Tensor:
    """Sum over taps of each tap's einsum with the patch of `padded` it reads."""
    kernels = kernel_taps(kernel, len(taps.plans))
    y = tf.add_n([tf.einsum(spec.forward, padded[taps.window(tap)], kernels[tap]) for tap in taps.indices])
    # Pinned, so that DTensor sums the taps' partial sums first and reduces
    # once, whatever split the consumer asks for.
    return taps.pinning.pin(y, spec.out)


def correlate_adjoint(dy: tf.Tensor, kernel: tf.Tensor, taps: Taps, spec: TapContraction) -> tf.Tensor:
    """The adjoint of `correlate`, in its padded input.

    `dy` is put in place for each tap before the tap's einsum, so that the
    einsums feed one sum: a reduction over split filters is then one
    all-reduce of the sum, not one per tap.
    """
    kernels = kernel_taps(kernel, len(taps.plans))
    shape = taps.padded_shape(dy)
    dx = tf.add_n(
        [tf.einsum(spec.input_grad, taps.place(dy, shape, tap), kernels[tap]) for tap in taps.indices]
    )
    return taps.pinning.pin(dx, spec.patch)


def kernel_gradient(padded: tf.Tensor, dy: tf.Tensor, taps: Taps, spec: TapContraction) -> tf.Tensor:
    """Gradient of `correlate` in its kernel: each tap's einsum of its patch
    with `dy`, stacked tap axis by tap axis (those are never split)."""
    plans = taps.plans

    def stack(prefix: tuple[int, ...]) -> tf.Tensor:
        if len(prefix) == len(plans):
            return tf.einsum(spec.kernel_grad, padded[taps.window(prefix)], dy)
        return tf.stack([stack(prefix + (t,)) for t in range(plans[len(prefix)].taps)])

    return stack(())


def conv_by_taps(x: tf.Tensor, kernel: tf.Tensor, taps: Taps, spec: TapContraction) -> tf.Tensor:
    """A convolution (channels last) as a sum over taps, with a gradient that
    forms the input gradient as one sum.

    Args:
        x: Input `(batch, *spatial, *channels)`.
        kernel: Kernel `(*taps, *channel dimensions of spec)`.
        taps: The kernel taps: one `AxisPlan` per spatial axis of `x`.
        spec: The einsums of one tap.

    Returns:
        The convolution, `(batch, *output spatial, *output channels)`.
    """

    @tf.custom_gradient
    def convolve(x: tf.Tensor, kernel: tf.Tensor):
        padded = taps.pad(x)

        def grad(dy: tf.Tensor):
            with tf.name_scope(BACKWARD_SCOPE):
                dy = taps.pinning.pin(dy, spec.out)  # as the layer after left it
                dx = taps.crop(correlate_adjoint(dy, kernel, taps, spec))
                return dx, kernel_gradient(padded, dy, taps, spec)

        return correlate(padded, kernel, taps, spec), grad

    return convolve(x, kernel)


def conv_transpose_by_taps(x: tf.Tensor, kernel: tf.Tensor, taps: Taps, spec: TapContraction) -> tf.Tensor:
    """The adjoint of `conv_by_taps` (a transposed convolution), channels last.

    Args:
        x: Input `(batch, *spatial, *channels)`: the shape of the
            convolution's output.
        kernel: Kernel `(*taps, *channel dimensions of spec)`, as the
            convolution's.
        taps: The kernel taps of the convolution whose input has the shape
            of this one's output.
        spec: The einsums of one tap of that convolution.

    Returns:
        The transposed convolution, `(batch, *plan sizes, *input channels of spec)`.
    """

    @tf.custom_gradient
    def transpose(x: tf.Tensor, kernel: tf.Tensor):
        def grad(dy: tf.Tensor):
            with tf.name_scope(BACKWARD_SCOPE):
                padded = taps.pad(taps.pinning.pin(dy, spec.patch))
                return correlate(padded, kernel, taps, spec), kernel_gradient(padded, x, taps, spec)

        return taps.crop(correlate_adjoint(x, kernel, taps, spec)), grad

    return transpose(x, kernel)


def per_axis(value: Any, rank: int) -> list[int]:
    """`value`, an int or a sequence, as one int per spatial axis."""
    if isinstance(value, int):
        return [value] * rank
    return [int(v) for v in value]


def conv_taps(
    x: tf.Tensor,
    pinning: Pinning,
    kernel_size: Sequence[int],
    strides: Any,
    padding: str,
    dilation_rate: Any,
    spatial: Sequence[int] | None = None,
) -> Taps:
    """The taps of a convolution of `x` (channels last), whose input has
    spatial shape `spatial` (by default `x`'s)."""
    rank = x.shape.rank - 2
    sizes = zip(
        x.shape[1:-1] if spatial is None else spatial,
        kernel_size,
        per_axis(strides, rank),
        per_axis(dilation_rate, rank),
    )
    return Taps(
        tuple(axis_plan(size, taps, stride, dilation, padding) for size, taps, stride, dilation in sizes),
        pinning,
    )


def _batch_size(value: tf.Tensor) -> int:
    """`value`'s batch size for a reshape: static where known, since DTensor
    expands a reshape to -1 of a split dimension wrongly ("'tf.Reshape' op
    requires 'output' number of elements to match")."""
    return -1 if value.shape[0] is None else value.shape[0]
