"""One warning for the dimensions that layouts split but the mesh cannot.

A rule or a layer's declaration may split a dimension over a mesh axis whose
size does not divide it (the demo's rules on a 3x3 mesh: nothing of 64 or 8
splits in 3); that dimension is kept whole. The strategy collects these as a
model's variables are made and warns once, at the model's first step (when
it checks the LayoutMap's rules too), with how many parameter bytes stay
replicated, instead of one warning per variable.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from tfmp.layout import UndividedDimension

# How many kept-whole dimensions the warning names; the rest are counted.
_LISTED = 6


class UndividedDimensions:
    """The dimensions kept whole since the last warning, and the bytes and
    replication of every variable made on the strategy's meshes but
    optimizer slots."""

    def __init__(self) -> None:
        self._pending: list[UndividedDimension] = []
        # Variable path -> (bytes, whether every device holds all of it).
        self._parameters: dict[str, tuple[int, bool]] = {}

    def note_variable(self, path: str, value: Any, layout: Any, undivided: list[UndividedDimension]) -> None:
        """Records a new variable (not an optimizer slot: slots follow their
        variable) with its layout and the dimensions it keeps whole."""
        nbytes = (value.shape.num_elements() or 0) * value.dtype.size
        self._parameters[path] = (nbytes, layout.is_fully_replicated())
        self._pending.extend(undivided)

    def warn(self, models: list[Any]) -> None:
        """Warns once about every dimension kept whole since the last call;
        the parameters it counts are the weights of `models` (all variables
        made, without Keras models: a custom loop's)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        paths = {weight.path for model in models for weight in model.weights}
        parameters = {
            path: entry for path, entry in self._parameters.items() if not paths or path in paths
        }
        warnings.warn(undivided_message(pending, parameters), stacklevel=3)


def undivided_message(
    undivided: list[UndividedDimension], parameters: dict[str, tuple[int, bool]]
) -> str:
    """The warning for `undivided`, with the replicated share of `parameters`."""
    paths = list(dict.fromkeys(dim.path for dim in undivided))
    axes = list(dict.fromkeys((dim.axis, dim.parts) for dim in undivided))
    listed = "; ".join(
        f"{dim.path} dimension {dim.dim} of size {dim.size} ({dim.source})"
        for dim in undivided[:_LISTED]
    )
    if len(undivided) > _LISTED:
        listed += f"; and {len(undivided) - _LISTED} more"
    total = sum(nbytes for nbytes, _ in parameters.values()) or 1
    held = sum(parameters.get(path, (0, False))[0] for path in paths)
    replicated = sum(nbytes for nbytes, whole in parameters.values() if whole)
    over = " and ".join(f"mesh axis {axis!r} of size {parts}" for axis, parts in axes)
    return (
        f"tfmp: layouts split {_count(len(undivided), 'dimension')} of "
        f"{_count(len(paths), 'variable')} over {over}, which does not divide "
        f"{'its size, so it is' if len(undivided) == 1 else 'their sizes, so they are'} kept whole: {listed}. "
        f"{'This variable holds' if len(paths) == 1 else 'These variables hold'} {held:,} bytes "
        f"({_percent(held, total)} of the parameters); in all {replicated:,} of "
        f"{total:,} parameter bytes ({_percent(replicated, total)}) are replicated on "
        "every device (optimizer slots follow their variables). Change the rules, or "
        + " and ".join(_axis_that_divides(undivided, axis, parts) for axis, parts in axes)
        + "."
    )


def _axis_that_divides(undivided: list[UndividedDimension], axis: str, parts: int) -> str:
    """Advice: the axis sizes (a few, smallest first) that divide every size
    kept whole along `axis`, else multiples of its size."""
    sizes = [dim.size for dim in undivided if dim.axis == axis]
    common = math.gcd(*sizes)
    dividing = [str(size) for size in range(2, common + 1) if common % size == 0][:4]
    if not dividing:
        return f"make those sizes multiples of {parts}"
    either = dividing[0] if len(dividing) == 1 else f"{', '.join(dividing[:-1])} or {dividing[-1]}"
    return f"use a mesh axis {axis!r} of size {either}, which divides {'it' if len(sizes) == 1 else 'them all'}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%"
