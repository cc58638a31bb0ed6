"""Mesh axes that split nothing: the devices along them compute copies.

A mesh axis that no batch, no sequence, no pipeline stage and no variable's
layout (planned, declared or matched by a rule) splits leaves its devices
computing the same step: a mesh of ("batch", "sequence", "model") whose
"sequence" axis was meant for context parallelism that was not turned on,
or an "auto" plan that found nothing to split on "model". Nothing is wrong
in the numbers, so nothing else would say it. At the first step whose
models have variables, tfmp warns once per such axis and proposes what
would use it, as MaxText refuses a model left replicated.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

_SEQUENCE_NAMES = ("sequence", "seq", "context", "cp")


def idle_axes(mesh: Any, used: Iterable[str | None], models: Iterable[Any]) -> list[str]:
    """The axes of `mesh` longer than 1 that neither `used` nor any layout of
    the `models`' variables names."""
    named = {axis for axis in used if axis}
    for model in models:
        for weight in model.weights:
            layout = getattr(getattr(weight, "value", None), "layout", None)
            if layout is not None:
                named.update(layout.sharding_specs)
    return [axis for axis in mesh.axis_names if mesh.axis_size(axis) > 1 and axis not in named]


def warn_idle_axes(mesh: Any, axes: list[str], model_names: list[str]) -> None:
    """Warns once per idle axis, with what would use it."""
    for axis in axes:
        if axis.lower() in _SEQUENCE_NAMES:
            proposal = f"pass context_parallel={axis!r} to split sequences over it (long inputs)"
        elif "expert" in axis.lower():
            proposal = (
                f"use tfmp.layers.MixtureOfExperts(..., axis={axis!r}), pass layout_map='auto' "
                "(it splits the banks of a mixture of experts, such as KerasHub's, over this "
                "axis), or lay out your mixture of experts' banks over it with a LayoutMap rule "
                f"(e.g. ({axis!r}, None, None) for a (experts, features, hidden) bank)"
            )
        else:
            planned = " (layout_map='auto' plans one)" if axis == "model" else ""
            proposal = (
                f"pass a LayoutMap that splits weights over it{planned}, or batch_axis={axis!r} "
                "to split batches over it"
            )
        warnings.warn(
            f"tfmp: mesh axis {axis!r} (size {mesh.axis_size(axis)}) splits nothing in "
            f"{model_names}: no batch, sequence, stage or variable is split over it, so the "
            f"{mesh.axis_size(axis)} devices along it compute the same step. To use them, "
            f"{proposal}; or leave the axis out of the mesh.",
            stacklevel=3,
        )
