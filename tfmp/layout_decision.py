"""Which mesh axes a variable is split over: one pure function of what is
known about it.

A variable's layout has several possible sources: the variable it is an
optimizer slot of, a `keras.Variable(layout=...)`, the layout its layer
declares (tfmp's layers), the plan of `layout_map="auto"`, a `LayoutMap`
rule, and `fully_shard=True`. `decide_layout` weighs them, in that order,
for the strategy's variable creator and for `layout_map="auto"` alike, and
says why: it reads no TensorFlow state (no mesh object, no variable), so
each case is a line of a table in `tests/test_layout_decision.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import tensorflow as tf

from tfmp.layout import Axes, GatheredOnUse, SplitOnUse, UndividedDimension


@dataclasses.dataclass(frozen=True)
class LayoutDecision:
    """The mesh axes of a variable's storage layout, and why.

    Attributes:
        axes: One mesh axis name, or None (whole), per dimension.
        source: What decided it: `"slot"`, `"explicit"`, `"declared"`,
            `"planned"`, `"rule"` or `"replicated"`.
        why: The same in words, with what `fully_shard` did, for messages.
        gathered_on_use: The mesh axes its layer gathers it over as it reads
            it (a `tfmp.gather_on_use` layout's), besides the batch axis.
        undivided: The dimensions its layout splits and its mesh cannot (the
            size does not divide): kept whole.
        split_on_use: The mesh axes its layer reads it split over even where
            one splits the batch (a `tfmp.split_on_use` layout's); an axis
            `fully_shard` adds is not among them.

    Examples:
        >>> from tfmp.layout_decision import decide_layout
        >>> decision = decide_layout(
        ...     "mlp/up/kernel", (16, 32), "bfloat16", {"batch": 2, "model": 4},
        ...     rule=("up/kernel", (None, "model")), fully_shard_axis="batch",
        ... )
        >>> decision.axes
        ('batch', 'model')
        >>> decision.why
        "LayoutMap rule 'up/kernel'; fully sharded: 'batch' on dimension 0"
    """

    axes: tuple[str | None, ...]
    source: str
    why: str
    gathered_on_use: tuple[str, ...] = ()
    undivided: tuple[UndividedDimension, ...] = ()
    split_on_use: tuple[str, ...] = ()


def decide_layout(
    path: str,
    shape: Sequence[int],
    dtype: Any,
    mesh_axes: Mapping[str, int],
    *,
    slot_of: tuple[str, Sequence[int], Axes] | None = None,
    explicit: tuple[str, Axes] | None = None,
    declared: tuple[str, Axes] | None = None,
    planned: tuple[str, Axes] | None = None,
    rule: tuple[str, Axes] | None = None,
    fully_shard_axis: str | None = None,
) -> LayoutDecision:
    """The storage layout of a variable, from everything that may decide it.

    In order: an optimizer slot of the variable's shape takes that
    variable's axes (already fully sharded where it is); a
    `keras.Variable(layout=...)` wins over any map, as on JAX; then the
    layout its layer declares (a `LayoutMap` rule that contradicts it is an
    error, and `layout_map="auto"`'s plan gives way to it); then the plan's
    entry; then the matching rule; else replicated. With `fully_shard_axis`
    a floating-point variable (any float width: `bfloat16` and `float16` as
    well as `float32`) is then also split over that axis on its largest
    dimension that is whole and divides by it. A dimension that does not
    divide by its mesh axis is kept whole and listed in `undivided`.

    Args:
        path: The variable's path, for messages.
        shape: Its shape.
        dtype: Its dtype: a name (`"bfloat16"`), a `tf.DType` or a numpy dtype.
        mesh_axes: The mesh's axis names and sizes, in order.
        slot_of: For an optimizer slot, `(path, shape, axes)` of its
            variable; else None.
        explicit: `(owner, axes)` of a `keras.Variable(layout=...)`, or None.
        declared: `(layer name, axes)` its layer declares, or None.
        planned: `(key, axes)` of `layout_map="auto"`'s plan entry, or None.
        rule: `(key, axes)` of the `LayoutMap` rule that matches, or None.
        fully_shard_axis: The mesh axis `fully_shard=True` splits every
            floating-point variable over as well, or None.

    Returns:
        A `LayoutDecision`.

    Raises:
        ValueError: A layout of another rank than the variable, a mesh axis
            the mesh lacks (except in a declared layout, where that
            dimension stays whole), or a rule that contradicts the layer's
            declaration.
    """
    shape = tuple(int(size) for size in shape)
    if slot_of is not None and tuple(int(size) for size in slot_of[1]) == shape:
        return LayoutDecision(tuple(slot_of[2]), "slot", f"optimizer slot of {slot_of[0]!r}: its variable's layout")
    if explicit is not None:
        source, described, axes, lenient = "explicit", explicit[0], explicit[1], True
    elif declared is not None:
        if rule is not None and tuple(rule[1]) != tuple(declared[1]):
            raise ValueError(
                f"Variable {path!r}: layer {declared[0]!r} declares the layout {declared[1]} "
                f"but LayoutMap rule {rule[0]!r} gives {rule[1]}. The layer's "
                "layout is used for its weights: remove the rule or make it agree."
            )
        source, axes, lenient = "declared", declared[1], True
        described = f"the layout layer {declared[0]!r} declares"
    elif planned is not None:
        source, described, axes, lenient = "planned", "auto_layout", planned[1], False
    elif rule is not None:
        source, described, axes, lenient = "rule", f"LayoutMap rule {rule[0]!r}", rule[1], False
    else:
        source, described, axes, lenient = "replicated", "no rule: replicated", (None,) * len(shape), False
    split, undivided = _checked(axes, shape, mesh_axes, path, described, lenient)
    gathered = kept = ()
    if isinstance(axes, GatheredOnUse):
        gathered = tuple(axis for axis in axes if axis and mesh_axes.get(axis, 1) > 1)
    if isinstance(axes, SplitOnUse):
        kept = tuple(axis for axis in split if axis)
    why = described
    if fully_shard_axis is not None:
        split, why = _fully_sharded(split, shape, dtype, mesh_axes, fully_shard_axis, why)
    return LayoutDecision(split, source, why, gathered, undivided, kept)


def is_floating_point(dtype: Any) -> bool:
    """Whether `dtype` (a name, `tf.DType` or numpy dtype) is a float of any
    width: the variables `fully_shard=True` and `gather_on_use` storage
    splits take."""
    return tf.as_dtype(dtype).is_floating


def _checked(
    axes: Axes,
    shape: tuple[int, ...],
    mesh_axes: Mapping[str, int],
    path: str,
    source: str,
    lenient: bool,
) -> tuple[tuple[str | None, ...], tuple[UndividedDimension, ...]]:
    """`axes` fitted to `shape` on the mesh: an axis the mesh lacks is an
    error, or with `lenient` (a declared layout: the layer then behaves as
    its Keras counterpart) a whole dimension; a size that does not divide,
    or an axis of size 1, keeps its dimension whole."""
    if len(axes) != len(shape):
        raise ValueError(
            f"Layout {tuple(axes)} for variable {path!r} has {len(axes)} entries but the "
            f"variable has shape {shape} (rank {len(shape)}). Fix {source} to give "
            f"one mesh axis or None per dimension."
        )
    split, undivided = [], []
    for dim, (axis, size) in enumerate(zip(axes, shape)):
        if axis is None or (lenient and axis not in mesh_axes):
            split.append(None)
            continue
        if axis not in mesh_axes:
            raise ValueError(
                f"Mesh axis of variable {path!r} ({source}) {axis!r} is not an axis of the "
                f"mesh {dict(mesh_axes)}. Use one of {list(mesh_axes)}, or add the axis to the mesh."
            )
        if size % mesh_axes[axis]:
            undivided.append(UndividedDimension(path, dim, size, axis, mesh_axes[axis], source))
            split.append(None)
        else:
            # A split over an axis of size 1 holds the whole dimension on every
            # device: stored whole, where DTensor's layout propagation fails on
            # some such splits (an embedding table's gather under Adam on a
            # 1x8 mesh, a Conv's filter).
            split.append(axis if mesh_axes[axis] > 1 else None)
    return tuple(split), tuple(undivided)


def _fully_sharded(
    axes: tuple[str | None, ...],
    shape: tuple[int, ...],
    dtype: Any,
    mesh_axes: Mapping[str, int],
    axis: str,
    why: str,
) -> tuple[tuple[str | None, ...], str]:
    """`axes` also split over `axis` on the largest whole dimension that
    divides by it, for a floating-point variable that does not use `axis` yet."""
    parts = mesh_axes.get(axis, 1)
    if not is_floating_point(dtype):
        return axes, f"{why}; not fully sharded: {tf.as_dtype(dtype).name} is not floating point"
    if axis in axes or parts == 1:
        return axes, why
    candidates = [
        dim for dim, size in enumerate(shape) if axes[dim] is None and size % parts == 0 and size >= parts
    ]
    if not candidates:
        return axes, f"{why}; not fully sharded: no whole dimension divides by {axis!r} of size {parts}"
    dim = max(candidates, key=lambda dim: (shape[dim], -dim))
    return (*axes[:dim], axis, *axes[dim + 1 :]), f"{why}; fully sharded: {axis!r} on dimension {dim}"
