"""`tfmp.comm_report`: the collectives DTensor inserted into the train step."""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfmp.forward import BACKWARD_SCOPE, GATHER_SCOPE, REPLICATED_SCOPE
from tfmp.inspect.display import format_bytes, render_table
from tfmp.strategy.extended import ModelParallelExtended
from tfmp.strategy.graph_capture import first_step_graphs_of, is_train_step

_OP_KINDS = {
    "CollectiveReduceV2": "all-reduce",
    "CollectiveGatherV2": "all-gather",
    "CollectiveReduceScatterV2": "reduce-scatter",
    "CollectiveAllToAllV2": "all-to-all",
}
_READ_OP = re.compile(r"ReadVariableOp(_\d+)?")
_DTENSOR_KINDS = {
    "DTensorAllReduceOp": "all-reduce",
    "DTensorAllGatherOp": "all-gather",
    "DTensorReduceScatterOp": "reduce-scatter",
    "DTensorAllScatterOp": "all-scatter",
    "DTensorAllToAllOp": "all-to-all",
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of one step, as every device of the mesh runs it.

    Attributes:
        op: The model op it serves (`"transformer_lm/ffn_out/MatMul"`).
        kind: `"all-reduce"`, `"all-gather"`, ...
        axes: The mesh axes it communicates over.
        phase: `"forward"`, `"backward"` or `"optimizer"`.
        category: `"activations"` (forward or backward) or `"gradients"`
            (gradient synchronization over the batch axis), `"optimizer"`, or
            `"weight-gathers"` (a layer gathering a weight stored split over
            the batch axis as it reads it, and that gather's gradient), or
            `"replicated-ops"` (the gathered inputs of an op DTensor has no
            layout rule for, which runs whole on every device).
        bytes: Size of the tensor it reduces or gathers, per device: an
            all-reduce's or reduce-scatter's input, an all-gather's output,
            an all-to-all's buffer.
        lowered_as: The collective that runs: DTensor lowers an all-gather as
            an all-reduce of a zero-filled buffer on CPU and GPU, for one.
        unknown: What tfmp could not read from the step's graph: `"size"`
            (a dimension unknown when the step was traced; `bytes` is then
            0) and/or `"group"` (`axes` is then empty).
    """

    op: str
    kind: str
    axes: tuple[str, ...]
    phase: str
    category: str
    bytes: int
    lowered_as: str = ""
    unknown: tuple[str, ...] = ()

    def wire_bytes(self, group_size: int) -> float:
        """Bytes each device sends (and receives) with ring algorithms over
        `group_size` devices: 2(k-1)/k of the tensor for an all-reduce,
        (k-1)/k for the other kinds."""
        share = (group_size - 1) / group_size
        return (2 if (self.lowered_as or self.kind) == "all-reduce" else 1) * share * self.bytes


@dataclasses.dataclass
class CommReport:
    """The collectives of one training step, per device."""

    collectives: list[Collective]

    def totals(self) -> dict[tuple[str, str, str, str], tuple[int, int]]:
        """(category, phase, axes, kind) -> (count, bytes per device per step)."""
        totals: dict = collections.defaultdict(lambda: [0, 0])
        for c in self.collectives:
            key = (c.category, c.phase, ",".join(c.axes), c.kind)
            totals[key][0] += 1
            totals[key][1] += c.bytes
        return {key: tuple(value) for key, value in sorted(totals.items())}

    def __str__(self) -> str:
        rows = [
            (category, phase, axes, kind, str(count), format_bytes(size))
            for (category, phase, axes, kind), (count, size) in self.totals().items()
        ]
        total = sum(c.bytes for c in self.collectives)
        rows.append(("total", "", "", "", str(len(self.collectives)), format_bytes(total)))
        header = ("category", "phase", "mesh axis", "kind", "count", "bytes/device/step")
        lines = [render_table(header, rows, right=("count", "bytes/device/step"))]
        unread = self.unread()
        if unread:
            lines.append(
                f"{len(unread)} collective(s) tfmp could not read whole (an unknown size "
                "counts 0 bytes above, an unknown group no mesh axis):"
            )
            lines += [f"  {c.op} ({c.kind}): unknown {' and '.join(c.unknown)}" for c in unread]
        return "\n".join(lines)

    def unread(self) -> list[Collective]:
        """The collectives whose size or group the step's graph did not give."""
        return [c for c in self.collectives if c.unknown]


def comm_report(model: Any, print_fn: Callable[[str], Any] | None = None) -> CommReport:
    """Reports the collectives DTensor inserted into the model's train step.

    tfmp keeps the per-device graphs DTensor ran for the first batches of the
    model's first `fit` (later steps are not slowed); this reads the train step's graph
    of one device and classifies each collective by mesh axis, kind and phase.
    Bytes are the size of each reduced or gathered tensor on one device.

    Args:
        model: A model trained with `fit` for at least one step under a
            `tfmp.ModelParallelStrategy`.
        print_fn: Called with the table; defaults to `print`.

    Returns:
        The `CommReport`.

    Raises:
        ValueError: If the model has no tfmp strategy or has not been fit yet.

    Examples:
        >>> history = model.fit(x, y, epochs=1, verbose=0)
        >>> report = tfmp.comm_report(model)
        category     phase      mesh axis   kind         count   bytes/device/step
        ───────────────────────────────────────────────────────────────────────────
        ...
        gradients    backward   batch       all-reduce       4             1.3 KiB
        total ...
    """
    extended = getattr(getattr(model, "distribute_strategy", None), "extended", None)
    if not isinstance(extended, ModelParallelExtended):
        raise ValueError(
            f"Model {model.name!r} was not built under a tfmp.ModelParallelStrategy: "
            "there are no mesh collectives to report."
        )
    graphs = first_step_graphs_of(model)
    graphs.finish()
    if not any(map(is_train_step, graphs.function_graphs)):
        raise ValueError(
            f"No training step of model {model.name!r} has run under tfmp yet: call "
            "model.fit(...) for at least one step, then tfmp.comm_report(model)."
        )
    mesh = extended.mesh
    optimizer = getattr(getattr(model, "optimizer", None), "name", None)
    step = _train_step_partition(graphs.function_graphs, mesh)
    batch_axis = extended.placer.batch_axis
    nodes = {node.name: node for node in step.node}
    report = CommReport(
        [_collective(node, step, mesh, optimizer, batch_axis, _sums_gradients(node, nodes)) for node in step.node
         if node.op in _OP_KINDS]
    )
    (print_fn or print)(str(report))
    return report


def _train_step_partition(function_graphs: list, mesh: Any) -> Any:
    """This client's first mesh device's partition of the train step function
    (in a multi-client run, each client keeps only its own devices' graphs;
    every device runs the same collectives).

    The device can hold more than one partition (host-side parts); the one
    with the collectives is the step's body.
    """
    first = mesh.dtensor_mesh.local_devices()[0]
    device = tf.DeviceSpec.from_string(first)
    partitions = [
        partition
        for function in filter(is_train_step, function_graphs)
        for partition in function.partition_graphs
        if any(
            node.device and _same_device(tf.DeviceSpec.from_string(node.device), device)
            for node in partition.node
        )
    ]
    if not partitions:
        raise ValueError(
            "tfmp kept no training step graph on this client's first mesh device "
            f"{first}: run model.fit on this model's strategy."
        )
    return max(partitions, key=lambda p: sum(n.op in _OP_KINDS for n in p.node))


def _same_device(a: tf.DeviceSpec, b: tf.DeviceSpec) -> bool:
    return (a.device_type, a.device_index, a.task or 0) == (b.device_type, b.device_index, b.task or 0)


def _op_name(node: Any) -> str:
    names = node.experimental_debug_info.original_node_names
    return names[0] if names else node.name


def _sums_gradients(node: Any, nodes: dict) -> bool:
    """Whether collective `node` moves a sum of gradients, which TensorFlow
    names outside "gradient_tape/" (`AddN`, where one value has several
    gradients): an `AddN` that DTensor names the collective after, reading
    a gradient or another such sum. `nodes` maps the partition's node names
    to its nodes."""
    op = _op_name(node).rpartition("/")[0]
    total = next((n for name, n in nodes.items() if name == op or name.endswith("/" + op)), None)
    return (
        total is not None
        and total.op == "AddN"
        and any(BACKWARD_SCOPE in source or "/AddN" in source for source in total.input)
    )


def _collective(node, partition, mesh, optimizer, batch_axis, sums_gradients: bool) -> Collective:
    name = _op_name(node)
    op, _, dtensor_op = name.rpartition("/")
    kind = _DTENSOR_KINDS.get(dtensor_op, _OP_KINDS[node.op])
    axes = _group_axes(node, partition, mesh)
    parts = name.split("/")
    if optimizer and name.startswith(optimizer + "/"):
        phase = category = "optimizer"
    elif sums_gradients or any(part.startswith(BACKWARD_SCOPE) for part in parts):
        phase = "backward"
        category = "gradients" if axes == (batch_axis,) else "activations"
    else:
        phase, category = "forward", "activations"
    # DTensor names the gather of a weight read in its compute layout after
    # the read (`ReadVariableOp`, `ReadVariableOp_1`, ... when a layer reads
    # several), or, where the read feeds a gather of rows, after tfmp's scope.
    if phase == "forward" and (_READ_OP.fullmatch(op.rpartition("/")[2]) or GATHER_SCOPE in parts):
        category = "weight-gathers"
    # The gathered inputs of an op DTensor has no layout rule for.
    if any(part.startswith(REPLICATED_SCOPE) for part in parts):
        category = "replicated-ops"
    size = _bytes(node)
    unknown = tuple(
        what for what, missing in (("size", size is None), ("group", axes is None)) if missing
    )
    axes = axes or ()
    size = size or 0
    if node.op == "CollectiveReduceScatterV2":
        size *= _group_size(axes, mesh)  # its output is one device's part of what it reduces
    return Collective(op or name, kind, axes, phase, category, size, _OP_KINDS[node.op], unknown)


def _group_size(axes: tuple[str, ...], mesh: Any) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    return int(np.prod([sizes[axis] for axis in axes if axis in sizes]))


def _bytes(node: Any) -> int | None:
    """The node's output bytes, or None where its shape is not fully known."""
    dtype = tf.as_dtype(node.attr["T"].type)
    shapes = node.attr["_output_shapes"].list.shape
    if not shapes or any(d.size < 0 for d in shapes[0].dim):
        return None
    return int(np.prod([d.size for d in shapes[0].dim])) * dtype.size


def _group_axes(node: Any, partition: Any, mesh: Any) -> tuple[str, ...] | None:
    """The mesh axes along which the devices of the node's groups differ, or
    None where the graph does not say.

    DTensor computes the group key from a constant table, one entry per device
    of the mesh: devices with equal entries form a group.
    """
    table = _group_table(node.input[2], partition, mesh.size)
    if table is None:
        return None
    coordinates = np.array(np.unravel_index(np.arange(mesh.size), mesh.shape)).T
    varying = set()
    for group in np.unique(table):
        members = coordinates[table == group]
        varying |= {i for i in range(len(mesh.shape)) if len(set(members[:, i])) > 1}
    return tuple(mesh.axis_names[i] for i in sorted(varying))


def _group_table(start: str, partition: Any, size: int) -> np.ndarray | None:
    nodes = {n.name: n for n in partition.node}
    pending, seen = [start], set()
    while pending:
        name = pending.pop().split(":")[0].lstrip("^")
        node = nodes.get(name)
        if node is None or name in seen:
            continue
        seen.add(name)
        if node.op == "Const":
            value = tf.make_ndarray(node.attr["value"].tensor)
            if value.shape == (size,):
                return value
        pending += list(node.input)
    return None
