"""Moving host values onto the mesh with a layout, and sharded values off it."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.layout import replicated


def to_layout(value: Any, layout: dtensor.Layout, local_rows: bool = False) -> tf.Tensor:
    """Returns `value` as a DTensor with `layout`.

    Host values are sliced on the host and each device receives only its shard;
    replicated DTensors are sliced by each device from its own copy, and
    other DTensors on the same mesh relaid out; DTensors on another mesh go
    through the host.

    With `local_rows`, `value` holds only the rows (dimension 0) of the
    positions along its split that this client's devices hold, in order: a
    client's own part of a batch, in a multi-client run.
    """
    if dtensor.is_dtensor(value):
        current = dtensor.fetch_layout(value)
        if current == layout:
            return value
        _check_divides(value.shape, layout)
        if current.mesh == layout.mesh:
            if current.is_fully_replicated():
                return _sliced_on_each_device(dtensor.unpack(value), layout)
            return dtensor.relayout(value, layout)
        value = to_host(value)
    elif not local_rows:
        value = tf.convert_to_tensor(value)
        _check_divides(value.shape, layout)
    return HostShards.split(value, layout, local_rows).pack()


def _check_divides(shape: tf.TensorShape, layout: dtensor.Layout) -> None:
    """Raises a ValueError naming the dimension of `shape` that `layout`
    splits over a mesh axis whose size does not divide it."""
    for dim, spec in enumerate(layout.sharding_specs):
        if spec != dtensor.UNSHARDED and shape[dim] % layout.mesh.dim_size(spec):
            raise ValueError(
                f"A value of shape {tuple(shape)} cannot take layout {list(layout.sharding_specs)}: "
                f"dimension {dim} ({shape[dim]}) does not divide by mesh axis {spec!r} of size "
                f"{layout.mesh.dim_size(spec)}. Split only dimensions that divide by their axis, "
                "or leave this one unsharded."
            )


def _sliced_on_each_device(copies: list[tf.Tensor], layout: dtensor.Layout) -> tf.Tensor:
    """A DTensor with `layout` made from `copies`, the whole value on each of
    this client's devices in the mesh's order (`dtensor.unpack` of a
    replicated DTensor): each device slices its own shard from its own copy.

    What `dtensor.relayout` computes from a replicated value, as plain eager
    ops: DTensor compiles an eager relayout for each shape and layout (12-79
    ms each on a 2x4 CPU mesh), and laying out a planned model's variables
    before its first step took that for each of them.
    """
    shape = copies[0].shape
    size = [
        length if spec == dtensor.UNSHARDED else length // layout.mesh.dim_size(spec)
        for length, spec in zip(shape, layout.sharding_specs)
    ]
    shards = []
    for copy, location in zip(copies, layout.mesh.local_device_locations()):
        begin = [
            0 if spec == dtensor.UNSHARDED else location[spec] * part
            for part, spec in zip(size, layout.sharding_specs)
        ]
        with tf.device(copy.device):
            shards.append(tf.slice(copy, begin, size))
    return dtensor.pack(shards, layout)


@dataclasses.dataclass(frozen=True)
class HostShards:
    """A host value cut into the shard of each of this client's devices, in
    the mesh's device order: `pack` puts them on the mesh.

    Cutting is plain host work; only `pack` uses the DTensor device, so the
    cut can run on another thread than the steps (DTensor's device is not
    safe to use from two threads at once).
    """

    shards: list[tf.Tensor]
    layout: dtensor.Layout

    @classmethod
    def split(cls, value: Any, layout: dtensor.Layout, local_rows: bool = False) -> "HostShards":
        value = tf.convert_to_tensor(value)
        mesh = layout.mesh
        locations = mesh.local_device_locations()
        split_dims = [
            (dim, spec)
            for dim, spec in enumerate(layout.sharding_specs)
            if spec != dtensor.UNSHARDED
        ]
        # Which piece of each split dimension a position along its axis takes.
        pieces = {spec: list(range(mesh.dim_size(spec))) for _, spec in split_dims}
        if local_rows and split_dims and split_dims[0][0] == 0:
            spec = split_dims[0][1]
            pieces[spec] = sorted({location[spec] for location in locations})
        with tf.device(value.device):  # split on the host, not on the mesh
            blocks = {(): value}
            for dim, spec in split_dims:
                blocks = {
                    key + (position,): piece
                    for key, block in blocks.items()
                    for position, piece in zip(
                        pieces[spec], tf.split(block, len(pieces[spec]), axis=dim)
                    )
                }
        shards = [blocks[tuple(location[spec] for _, spec in split_dims)] for location in locations]
        return cls(shards, layout)

    def pack(self) -> tf.Tensor:
        return dtensor.pack(self.shards, self.layout)


def replicate(
    value: tf.Tensor, mesh: dtensor.Mesh | None = None, sequence_axis: str | None = None
) -> tf.Tensor:
    """Relayouts a sharded DTensor to replicated, one mesh axis at a time
    (`tfmp.layout.replicated`).

    Inside a function, where layouts are not known until DTensor expands it,
    `mesh` says which mesh the value lives on, and `sequence_axis` the axis
    context parallelism splits sequences over.
    """
    if value.shape.rank is None:
        return value
    if tf.executing_eagerly():
        if not dtensor.is_dtensor(value):
            return value
        mesh = dtensor.fetch_layout(value).mesh
    if mesh is None:
        return value
    return replicated(value, mesh, sequence_axis)


def to_host(value: tf.Tensor) -> tf.Tensor:
    """Returns the full value of a DTensor as a regular tensor."""
    if not dtensor.is_dtensor(value):
        return value
    return dtensor.unpack(replicate(value))[0]


class BatchPlacer:
    """Packs host input batches onto a mesh, split over its batch axis.

    A batch whose size does not divide by the batch axis is replicated over it:
    every device of that axis computes the whole batch, which gives exactly the
    single-device result for a partial last batch. When whole batches do not
    divide, a warning says that data parallelism is lost and how to fix it.

    Inputs may go to another mesh than targets and sample weights (in a
    pipeline, the first stage's; the loss is computed on the last stage's).

    Args:
        mesh: The DTensor mesh of targets and sample weights.
        batch_axis: Name of the mesh axis that splits the batch, or None.
        input_mesh: The DTensor mesh of inputs; None: `mesh`.
        check_rows: Called with the rows of each `(x, y, sample_weight)`
            batch (all clients' rows) before it is placed; raises ValueError
            for a batch that cannot run.
        on_batch_read: Called with each `(x, y, sample_weight)` host batch
            a dataset's iterator cuts, in the order they are read, and
            whether it holds only this client's rows.
    """

    def __init__(
        self,
        mesh: dtensor.Mesh,
        batch_axis: str | None,
        input_mesh: dtensor.Mesh | None = None,
        check_rows: Callable[[int], None] | None = None,
        on_batch_read: Callable[[Any, bool], None] | None = None,
    ):
        self.mesh = mesh
        self.input_mesh = input_mesh or mesh
        self.batch_axis = batch_axis
        self.batch_parts = mesh.dim_size(batch_axis) if batch_axis else 1
        self._check_rows = check_rows
        self._on_batch_read = on_batch_read
        self._warned = False

    def place(
        self,
        structure: Any,
        is_last_batch: bool = True,
        targets: bool = False,
        local_rows: bool = False,
    ) -> Any:
        """Packs every host tensor or array in `structure` onto the mesh
        (inputs onto the input mesh, `targets` onto the output mesh); with
        `local_rows`, each holds only this client's rows of the batch."""
        return pack(self._split(structure, is_last_batch, targets, local_rows))

    def split_batch(self, batch: Any, is_last_batch: bool = True, local_rows: bool = False) -> Any:
        """Checks an `(x, y, sample_weight)` batch and cuts each of its host
        tensors into `HostShards` (host work only: `pack` places them)."""
        self.check_batch(batch, local_rows)
        if self._on_batch_read is not None:
            self._on_batch_read(batch, local_rows)
        if self.input_mesh is self.mesh or not isinstance(batch, tuple) or len(batch) < 2:
            return self._split(batch, is_last_batch, local_rows=local_rows)
        return (self._split(batch[0], is_last_batch, local_rows=local_rows),) + self._split(
            batch[1:], is_last_batch, targets=True, local_rows=local_rows
        )

    def _split(
        self, structure: Any, is_last_batch: bool, targets: bool = False, local_rows: bool = False
    ) -> Any:
        mesh = self.mesh if targets else self.input_mesh
        return tf.nest.map_structure(
            lambda x: self._split_tensor(x, is_last_batch, mesh, local_rows), structure
        )

    def check_batch(self, batch: Any, local_rows: bool = False) -> None:
        """Runs `check_rows` on a host batch's rows (with `local_rows`, the
        batch is this client's rows of a global batch)."""
        rows = self.batch_rows(batch)
        if self._check_rows is None or rows is None:
            return
        self._check_rows(rows * self.local_parts() if local_rows else rows)

    def batch_rows(self, batch: Any) -> int | None:
        """The rows of a host batch: dimension 0 of its first host array (None
        when it has none)."""
        first = next(
            (v for v in tf.nest.flatten(batch) if _is_array(v) and not dtensor.is_dtensor(v)), None
        )
        if first is None or not len(first.shape):
            return None
        return first.shape[0]

    def local_parts(self) -> int:
        """How many clients' parts (distinct position sets) a batch has."""
        return self.batch_parts // len(
            {location[self.batch_axis] for location in self.input_mesh.local_device_locations()}
        )

    def _split_tensor(
        self,
        value: Any,
        is_last_batch: bool,
        mesh: dtensor.Mesh,
        local_rows: bool,
    ) -> Any:
        if value is None or dtensor.is_dtensor(value) or not _is_array(value):
            return value
        value = tf.convert_to_tensor(value)
        shape = value.shape
        if local_rows and shape.rank:
            parts = self.local_parts()
            if parts > 1 and shape[0] % (self.batch_parts // parts):
                raise ValueError(
                    f"This client's part of a batch has {shape[0]} rows, which do not "
                    f"split over its {self.batch_parts // parts} positions of mesh axis "
                    f"{self.batch_axis!r}. Batch each client's data with a multiple of "
                    f"{self.batch_parts // parts} rows (drop_remainder=True)."
                )
            shape = tf.TensorShape([shape[0] * parts]).concatenate(shape[1:])
        return HostShards.split(value, self.layout_for(shape, is_last_batch, mesh), local_rows)

    def layout_for(
        self,
        shape: tf.TensorShape,
        is_last_batch: bool = True,
        mesh: dtensor.Mesh | None = None,
    ) -> dtensor.Layout:
        mesh = mesh or self.input_mesh
        rank = shape.rank
        if rank == 0 or self.batch_parts == 1:
            return dtensor.Layout.replicated(mesh, rank)
        if shape[0] % self.batch_parts:
            if not is_last_batch:
                self.warn_undivided(shape[0])
            return dtensor.Layout.replicated(mesh, rank)
        return dtensor.Layout.batch_sharded(mesh, self.batch_axis, rank)

    def warn_undivided(self, rows: int) -> None:
        """Warns once that batches of `rows` rows, more than just the last
        one, run without data parallelism."""
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"tfmp: batch size {rows} does not divide by mesh axis "
            f"{self.batch_axis!r} of size {self.batch_parts}, so such batches "
            f"run whole on every device of that axis (exact, but without data "
            f"parallelism). Use a batch size that is a multiple of "
            f"{self.batch_parts}.",
            stacklevel=4,
        )


def pack(structure: Any) -> Any:
    """`structure` with each `HostShards` packed onto its mesh."""
    return tf.nest.map_structure(
        lambda x: x.pack() if isinstance(x, HostShards) else x, structure
    )


def input_pipelines(
    client_positions: dict[int, tuple[int, ...]], client: int, batch_axis: str
) -> tuple[int, int]:
    """How many parts a batch has when each client reads its own rows, and
    which part is `client`'s.

    Clients that hold the same positions along the batch axis read the same
    rows; each other set of positions is its own part, in the order of its
    first position (the device order may interleave clients).

    Args:
        client_positions: Each client's positions along the batch axis.
        client: This client.
        batch_axis: The batch axis' name, for errors.

    Raises:
        ValueError: If two clients hold some positions in common but not all,
            or different numbers of positions: no split of the batch's rows
            gives every client whole parts.
    """
    parts = sorted(set(client_positions.values()))
    for first, second in zip(parts, parts[1:]):
        if set(first) & set(second) or len(first) != len(second):
            raise ValueError(
                f"Along the batch axis {batch_axis!r}, one client's devices hold "
                f"positions {list(first)} and another's {list(second)}: each client's "
                "rows of a batch must go to positions that other clients hold all of "
                "or none of, equally many per client. Order the mesh's devices so "
                "that each client holds whole positions of the batch axis (e.g. "
                "client by client along it), or feed whole batches with "
                "strategy.experimental_distribute_dataset."
            )
    return len(parts), parts.index(client_positions[client])


def _is_array(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable)) or hasattr(value, "__array__")
