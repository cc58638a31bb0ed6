"""Which layout a new variable gets: one pure function, and the hook that tells
it which Keras variable is being created."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.layout import Axes, GatheredOnUse, UndividedDimension, axes_to_layout
from tfmp.mesh import DeviceMesh

_creating = threading.local()


@contextlib.contextmanager
def creating(keras_variable: Any) -> Iterator[None]:
    """The backing `tf.Variable` of `keras_variable` is created in the block.

    Keras 3's TensorFlow `Variable._initialize` runs in this block (installed
    by tfmp), so the strategy's variable creator knows the Keras variable,
    its path and its layer's declaration, also when Keras deferred the
    creation past the layer's name scope.
    """
    previous = getattr(_creating, "variable", None)
    _creating.variable = keras_variable
    try:
        yield
    finally:
        _creating.variable = previous


def keras_variable_being_created() -> Any:
    """The Keras variable whose `tf.Variable` is being created, or None."""
    return getattr(_creating, "variable", None)


def resolve_layout(
    path: str,
    shape: Sequence[int],
    dtype: tf.DType,
    mesh: DeviceMesh,
    colocated: Any = None,
    declared: tuple[str, Axes] | None = None,
    rule: tuple[str, Axes] | None = None,
    fully_shard_axis: str | None = None,
    undivided: list[UndividedDimension] | None = None,
) -> dtensor.Layout:
    """The storage layout of a new variable, from what is known about it.

    In order: an optimizer slot (created colocated with its variable, same
    shape) takes that variable's layout; a layout the variable's layer
    declares (which a LayoutMap rule must not contradict); the LayoutMap rule
    that matches its path; else replicated. With `fully_shard_axis`, a
    floating-point variable is then also split over that axis on its largest
    dimension that is not split yet and divides by it (fully sharded data
    parallelism).

    Args:
        path: The variable's path, for rules and messages.
        shape: Its shape.
        dtype: Its dtype.
        mesh: The mesh it lives on.
        colocated: The variable an optimizer slot is created for, or None.
        declared: `(layer name, axes)` its layer declares, or None.
        rule: `(key, axes)` of the LayoutMap rule that matches, or None.
        fully_shard_axis: The mesh axis to shard every weight over as well.
        undivided: Where the dimensions kept whole because their size does
            not divide by their mesh axis are added; None: each is warned
            about (`axes_to_layout`).

    Returns:
        A `dtensor.Layout` on `mesh`.
    """
    shape = tuple(int(size) for size in shape)
    reference = getattr(colocated, "layout", None)
    if reference is not None and tuple(colocated.shape) == shape:
        return reference
    if declared is not None:
        owner, axes = declared
        if rule is not None and rule[1] != axes:
            raise ValueError(
                f"Variable {path!r}: layer {owner!r} declares the layout {axes} "
                f"but LayoutMap rule {rule[0]!r} gives {rule[1]}. The layer's "
                "layout is used for its weights: remove the rule or make it agree."
            )
        layout = axes_to_layout(
            axes, mesh, shape, path, f"the layout layer {owner!r} declares",
            missing_axis_replicates=True, undivided=undivided,
        )
    elif rule is not None:
        layout = axes_to_layout(
            rule[1], mesh, shape, path, f"LayoutMap rule {rule[0]!r}", undivided=undivided
        )
    else:
        layout = dtensor.Layout.replicated(mesh.dtensor_mesh, len(shape))
    if fully_shard_axis is None:
        return layout
    return fully_sharded(layout, shape, fully_shard_axis, dtype)


def gathered_axes(
    batch_axis: str | None,
    declared: tuple[str, Axes] | None = None,
    rule: tuple[str, Axes] | None = None,
) -> tuple[str, ...]:
    """The mesh axes a variable is gathered over when its layer reads it.

    The batch axis (the activations a weight meets are split over it, so a
    weight split over it is fully sharded), and every axis of the layout it
    gets (its layer's declaration, else the rule) if that is a
    `tfmp.gather_on_use` layout.
    """
    axes = (declared or rule or (None, ()))[1]
    gathered = [batch_axis] if batch_axis else []
    if isinstance(axes, GatheredOnUse):
        gathered += [axis for axis in axes if axis and axis not in gathered]
    return tuple(gathered)


def fully_sharded(
    layout: dtensor.Layout, shape: Sequence[int], axis: str, dtype: Any
) -> dtensor.Layout:
    """`layout` also split over `axis` on the largest dimension that is whole
    and divides by it; `layout` itself when it uses `axis`, none fits, or
    `dtype` is not floating point (a step counter, an integer table).

    The one place that decides which variables `fully_shard=True` splits:
    every floating dtype, `bfloat16` and `float16` (a `"bfloat16"` policy's
    weights) as well as `float32` (a mixed policy's)."""
    specs = list(layout.sharding_specs)
    if not tf.as_dtype(dtype).is_floating or axis in specs or axis not in layout.mesh.dim_names:
        return layout
    parts = layout.mesh.dim_size(axis)
    candidates = [
        dim for dim, size in enumerate(shape)
        if specs[dim] == dtensor.UNSHARDED and size % parts == 0 and size >= parts
    ]
    if parts == 1 or not candidates:
        return layout
    specs[max(candidates, key=lambda dim: (shape[dim], -dim))] = axis
    return dtensor.Layout(specs, layout.mesh)
