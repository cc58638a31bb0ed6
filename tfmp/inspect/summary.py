"""`tfmp.summary`: each variable's layout and what every device holds."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import textwrap
from typing import Any, Callable

import tensorflow as tf

from tfmp.inspect.display import Device, device_ranges, format_bytes, render_table
from tfmp.layout import LayoutMap, layout_axes


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
    """Prints each variable's layout and shard, and what every device holds.

    One row per model variable: its path, shape, layout and the shard one
    device holds. A variable stored split over the batch axis (fully sharded,
    or by a rule) is read by its layer with that axis gathered: a "read as"
    column then shows that compute layout where it differs from the stored one.

    Below the table: the bytes of parameters and optimizer variables each
    device holds, one line for devices that hold the same, and which share of
    those bytes is replicated (held whole by every device), in which
    variables; for a pipeline, each stage's parameter bytes, so imbalance
    shows. Devices are named short (`CPU:3`), their full name given once.

    Args:
        model: A built Keras model (compiled, to include optimizer variables
            once the optimizer is built).
        print_fn: Called with the text; defaults to `print`.

    Returns:
        The printed text.

    Examples:
        >>> text = tfmp.summary(model)
        devices: CPU:0-7, short for /job:localhost/replica:0/task:0/device:CPU:0-7
        <BLANKLINE>
        variable                    shape      layout            shard        bytes
        ───────────────────────────────────────────────────────────────────────────
        sequential/dense/kernel     (16, 64)   (None, 'model')   (16, 16)   1.0 KiB
        sequential/dense/bias       (64,)      (None,)           (64,)        256 B
        sequential/dense_1/kernel   (64, 4)    ('model', None)   (16, 4)      256 B
        sequential/dense_1/bias     (4,)       (None,)           (4,)          16 B
        <BLANKLINE>
        layout: the mesh axis each dimension is split over (None: not split); shard: ...
        <BLANKLINE>
        devices   parameters   optimizer     total   replicated
        ───────────────────────────────────────────────────────
        CPU:0-7      1.5 KiB         0 B   1.5 KiB          18%
        <BLANKLINE>
        Each device on a line holds: ... Replicated on CPU:0-7: 18% of each device's bytes,
        272 B in 2 parameter variables (largest: sequential/dense/bias 256 B;
        sequential/dense_1/bias 16 B).
    """
    rows = placements(model)
    on_mesh = any(row.axes is not None for row in rows)
    all_devices = {device for row in rows for device in row.devices}
    lines = [_devices_line(all_devices, on_mesh), "", _variable_table(rows), ""]
    lines += _variable_legend(rows, on_mesh)
    groups = _device_groups(bytes_per_device(model), rows)
    lines += ["", _device_table(groups, on_mesh)]
    if on_mesh:
        lines += [""] + _replicated_lines(groups)
    lines += _output_lines(model)
    stages = bytes_per_stage(model)
    if stages:
        lines += ["", "per pipeline stage:"]
        lines.append(
            render_table(
                ("stage", "parameters", "fullest device"),
                [
                    (f"stage {stage}", format_bytes(sizes["parameters"]),
                     format_bytes(sizes["largest_device"]))
                    for stage, sizes in stages.items()
                ],
                right=("parameters", "fullest device"),
            )
        )
        lines += _wrap(
            "parameters: the stage's parameters, whole; fullest device: the most one "
            "of its devices holds (parameters and optimizer variables)."
        )
    text = "\n".join(lines)
    (print_fn or print)(text)
    return text


def _output_lines(model: Any) -> list[str]:
    """The layer outputs the strategy lays out (by `"/output"` rules, or
    sequence parallelism) in the steps traced so far."""
    layout_map = getattr(getattr(model, "distribute_strategy", None), "layout_map", None)
    if not isinstance(layout_map, LayoutMap):
        return []
    laid_out = layout_map.laid_out_outputs()
    if not laid_out and not layout_map.output_keys():
        return []
    if not laid_out:
        return [""] + _wrap(
            f"layer outputs: rules {layout_map.output_keys()} lay out the outputs they "
            "match from the first traced step (none traced yet)."
        )
    table = render_table(
        ("layer output", "layout", "laid out by"),
        [(f"{path}/output", str(axes), key) for path, (key, axes) in laid_out.items()],
    )
    return ["", table]


def _devices_line(devices: set[str], on_mesh: bool) -> str:
    specs = sorted({tf.DeviceSpec.from_string(d) for d in devices}, key=lambda s: s.to_string())
    names = device_ranges(devices)
    first = specs[0]
    if len({(s.job, s.replica, s.task, s.device_type) for s in specs}) == 1:
        full = (f"/job:{first.job}/replica:{first.replica}/task:{first.task}/"
                f"device:{names.rpartition('/')[2]}")
    else:
        full = f"/job:{first.job}/replica:{first.replica}/task:<task>/device:<type>:<index>"
    line = f"devices: {names}, short for {full}"
    if not on_mesh:
        line += " (no variable is on a mesh: the model was built outside a tfmp strategy's scope)"
    return line


def _variable_table(rows: list[VariablePlacement]) -> str:
    read_as = any(row.gathered_on_use for row in rows)
    header = ("variable", "shape", "layout") + (("read as",) if read_as else ()) + (
        "shard", "bytes")
    table = []
    for row in rows:
        if row.is_slot:
            continue
        cells = [row.path, str(row.shape), "-" if row.axes is None else str(row.axes)]
        if read_as:
            cells.append(str(row.compute_axes) if row.gathered_on_use else "")
        cells += [str(row.shard_shape), format_bytes(row.shard_bytes)]
        table.append(cells)
    return render_table(header, table, right=("bytes",))


def _variable_legend(rows: list[VariablePlacement], on_mesh: bool) -> list[str]:
    if not on_mesh:
        return ["layout -: on one device, not on a mesh; shard: the whole variable."]
    legend = (
        "layout: the mesh axis each dimension is split over (None: not split); shard: "
        "the part one device holds, and its bytes."
    )
    if any(row.gathered_on_use for row in rows):
        legend += (
            " read as: the layout its layer reads it in, gathered over the batch axis "
            "(blank: as stored)."
        )
    return _wrap(legend + " Optimizer variables take their variable's layout and are counted below.")


@dataclasses.dataclass
class _DeviceGroup:
    """Devices that hold the same bytes, and the replicated variables among them."""

    devices: list[str]
    kinds: dict[str, int]
    replicated: list[VariablePlacement]

    @property
    def replicated_share(self) -> float:
        held = sum(row.shard_bytes for row in self.replicated)
        return held / self.kinds["total"] if self.kinds["total"] else 0.0


def _device_groups(
    totals: dict[str, dict[str, int]], rows: list[VariablePlacement]
) -> list[_DeviceGroup]:
    """Devices grouped by what they hold, in device order."""
    groups: dict[tuple, _DeviceGroup] = {}
    for device in sorted(totals, key=Device.parse):
        replicated = [
            row for row in rows
            if row.replicated and row.axes is not None and device in row.devices
        ]
        key = (tuple(totals[device].values()), tuple(row.path for row in replicated))
        if key in groups:
            groups[key].devices.append(device)
        else:
            groups[key] = _DeviceGroup([device], totals[device], replicated)
    return list(groups.values())


def _device_table(groups: list[_DeviceGroup], on_mesh: bool) -> str:
    header = ("devices", "parameters", "optimizer", "total") + (
        ("replicated",) if on_mesh else ())
    table = []
    for group in groups:
        cells = [device_ranges(group.devices)] + [
            format_bytes(group.kinds[kind]) for kind in ("parameters", "optimizer", "total")
        ]
        if on_mesh:
            cells.append(_percent(group.replicated_share))
        table.append(cells)
    return render_table(header, table, right=header[1:])


def _replicated_lines(groups: list[_DeviceGroup]) -> list[str]:
    """The device table explained, and the replicated variables of each line."""
    text = (
        "Each device on a line holds: its shards of the parameters and of the optimizer "
        "variables, their total, and the share of that total replicated (held whole by "
        "every device, split over no mesh axis)."
    )
    if not any(group.replicated for group in groups):
        text += " Nothing is replicated: every variable is split over a mesh axis."
    for group in groups:
        if not group.replicated:
            continue
        parameters = sorted(
            (row for row in group.replicated if not row.is_slot), key=lambda r: -r.shard_bytes
        )
        largest = "; ".join(f"{r.path} {format_bytes(r.shard_bytes)}" for r in parameters[:3])
        held = []
        if parameters:
            held.append(f"{_count(len(parameters), 'parameter variable')} (largest: {largest})")
        if len(group.replicated) > len(parameters):
            held.append(_count(len(group.replicated) - len(parameters), "optimizer variable"))
        size = sum(row.shard_bytes for row in group.replicated)
        text += (
            f" Replicated on {device_ranges(group.devices)}: "
            f"{_percent(group.replicated_share)} of each device's bytes, "
            f"{format_bytes(size)} in {' and '.join(held)}."
        )
    return _wrap(text)


def _wrap(text: str) -> list[str]:
    """`text` in lines of at most 88 characters, a size never cut from its unit."""
    kept_whole = re.sub(r"(\d) (B|[KMGT]iB)\b", "\\1\u00a0\\2", text)
    return [line.replace("\u00a0", " ") for line in textwrap.wrap(kept_whole, width=88)]


def _percent(fraction: float) -> str:
    """`0.06` -> `"6%"`; a share that rounds to 0% but is not nothing -> `"<1%"`."""
    return "<1%" if 0 < fraction < 0.005 else f"{fraction:.0%}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' if number != 1 else ''}"
