"""`tfmp.summary`: each variable's layout and what every device holds."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable

from tfmp.layout import layout_axes


@dataclasses.dataclass(frozen=True)
class VariablePlacement:
    """Where one variable lives: its layout and the shard each device holds."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...] | None  # None: not on a mesh
    shard_shape: tuple[int, ...]
    devices: tuple[str, ...]
    itemsize: int
    is_slot: bool
    stage: int | None = None  # the pipeline stage whose devices hold it
    compute_axes: tuple[str | None, ...] | None = None  # as a layer reads it

    @property
    def gathered_on_use(self) -> bool:
        """Whether a layer reads it in another layout than it is stored in."""
        return self.compute_axes is not None and self.compute_axes != self.axes

    @property
    def shard_bytes(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize

    @property
    def replicated(self) -> bool:
        return self.axes is None or all(axis is None for axis in self.axes)


def placements(model: Any) -> list[VariablePlacement]:
    """Placement of every model variable and optimizer variable of `model`."""
    rows = [_placement(v, is_slot=False) for v in model.variables]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        rows += [_placement(v, is_slot=True) for v in optimizer.variables]
    return rows


def _placement(variable: Any, is_slot: bool) -> VariablePlacement:
    backing = getattr(variable, "value", variable)
    shape = tuple(int(d) for d in variable.shape)
    itemsize = backing.dtype.size
    layout = getattr(backing, "layout", None)
    if layout is None:
        return VariablePlacement(
            variable.path, shape, None, shape, (backing.device,), itemsize, is_slot
        )
    mesh = layout.mesh
    shard = tuple(
        size // (mesh.dim_size(spec) if axis is not None else 1)
        for size, spec, axis in zip(shape, layout.sharding_specs, layout_axes(layout))
    )
    return VariablePlacement(
        variable.path,
        shape,
        layout_axes(layout),
        shard,
        tuple(mesh.local_devices()),
        itemsize,
        is_slot,
        getattr(backing, "stage", None),
        layout_axes(backing.compute_layout) if hasattr(backing, "compute_layout") else None,
    )


def bytes_per_device(model: Any) -> dict[str, dict[str, int]]:
    """Per device: bytes of parameters, of optimizer variables, and their total."""
    totals: dict[str, dict[str, int]] = collections.defaultdict(
        lambda: {"parameters": 0, "optimizer": 0, "total": 0}
    )
    for row in placements(model):
        kind = "optimizer" if row.is_slot else "parameters"
        for device in row.devices:
            totals[device][kind] += row.shard_bytes
            totals[device]["total"] += row.shard_bytes
    return dict(totals)


def bytes_per_stage(model: Any) -> dict[int, dict[str, int]]:
    """Per pipeline stage: the full bytes of its parameters, and the most
    bytes (parameters + optimizer variables) one of its devices holds."""
    stages: dict[int, dict[str, int]] = {}
    per_device = bytes_per_device(model)
    for row in placements(model):
        if row.stage is None:
            continue
        stage = stages.setdefault(row.stage, {"parameters": 0, "largest_device": 0})
        if not row.is_slot:
            stage["parameters"] += math.prod(row.shape) * row.itemsize
        largest = max(per_device[device]["total"] for device in row.devices)
        stage["largest_device"] = max(stage["largest_device"], largest)
    return dict(sorted(stages.items()))


def summary(model: Any, print_fn: Callable[[str], Any] | None = None) -> str:
    """Prints each variable's layout, per-device shard shape and bytes.

    A variable stored split over the batch axis (fully sharded, or by a rule)
    is read by its layer with that axis gathered: the "read as" column shows
    that compute layout where it differs from the stored one.

    Below the table: per device, the bytes of parameters and optimizer
    variables it holds, and the fraction of those bytes that are replicated;
    for a pipeline, each stage's parameter bytes, so imbalance shows.

    Args:
        model: A built Keras model (compiled, to include optimizer variables
            once the optimizer is built).
        print_fn: Called with the text; defaults to `print`.

    Returns:
        The printed text.

    Examples:
        >>> text = tfmp.summary(model)
        variable                   shape     layout           read as  per-device shape  bytes/device
        ---...
        sequential/dense/kernel    (16, 64)  (None, 'model')  same     (16, 16)          1,024
        ...
    """
    rows = placements(model)
    table = [("variable", "shape", "layout", "read as", "per-device shape", "bytes/device")]
    for row in rows:
        if row.is_slot:
            continue
        layout = "-" if row.axes is None else str(row.axes)
        read_as = str(row.compute_axes) if row.gathered_on_use else "same"
        table.append(
            (
                row.path,
                str(row.shape),
                layout,
                read_as,
                str(row.shard_shape),
                f"{row.shard_bytes:,}",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in table]
    lines.insert(1, "-" * len(lines[0]))

    replicated: dict[str, int] = collections.Counter()
    for row in rows:
        if row.replicated:
            for device in row.devices:
                replicated[device] += row.shard_bytes
    lines += ["", "per device: parameters + optimizer variables"]
    for device, kinds in sorted(bytes_per_device(model).items()):
        fraction = replicated[device] / kinds["total"] if kinds["total"] else 0.0
        lines.append(
            f"  {device}: {kinds['parameters']:,} + {kinds['optimizer']:,} = "
            f"{kinds['total']:,} bytes ({fraction:.0%} replicated)"
        )
    stages = bytes_per_stage(model)
    if stages:
        lines += ["", "per pipeline stage: parameters (whole) / most on one device"]
        for stage, sizes in stages.items():
            lines.append(
                f"  stage {stage}: {sizes['parameters']:,} bytes / "
                f"{sizes['largest_device']:,} bytes"
            )
    text = "\n".join(lines)
    (print_fn or print)(text)
    return text
