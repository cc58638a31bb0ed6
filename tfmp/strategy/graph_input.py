"""Reading a distributed dataset's batches inside a `tf.function`.

TensorFlow's multi-step loops call `next(iterator)` (or
`get_next_as_optional()`) in a `tf.range` loop of a `tf.function`, so the
batch must come from an op of the graph, not from the host at the call.
`GraphBatches` turns the host iterator of a `MeshDataset` into that op, as
DTensor's own `DTensorDataset` does: one `tf.data` iterator per device,
packed into one DTensor resource whose `IteratorGetNext` gives each device
its shard. Here the devices' iterators share one read of the host iterator
(a `tf.data` multi-device iterator), so every element is read once, in the
order one device reads it, whatever the pipeline shuffles or draws.

DTensor lays out only static shapes (the gradient of a mean over a batch of
unknown rows fails to expand), and a loop's body is traced once: every batch
read in the graph has the first batch's shapes, split over the batch axis
if its rows divide it, else whole on every device
(`tfmp.strategy.placement.BatchPlacer`). A batch of other shapes (a partial
last batch) stops the step with an error that says to batch with
`drop_remainder=True`; it is never dropped or padded.

The stream never ends: after the last batch it gives empty elements of kind
`_END`, so that a graph never runs the iterator past its end (DTensor's
eager context is poisoned by that), and `get_next_as_optional()` can say
that no batch is left.
"""

from __future__ import annotations

from typing import Any, Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.integrations.internals import dtensor_api
from tfmp.integrations.internals import gen_dataset_ops, multi_device_iterator_ops
from tfmp.strategy.placement import BatchPlacer

_END, _BATCH, _OTHER_SHAPES = 0, 1, 2
_HOST = "CPU:0"


class GraphBatches:
    """A host iterator's batches as ops on the mesh, for loops traced into a
    `tf.function`.

    Args:
        host_iterator: The `tf.data` iterator on the host; from here on only
            this object reads it.
        placer: Says how batches are laid out on the mesh.
    """

    def __init__(self, host_iterator: Iterator, placer: BatchPlacer):
        check_graph_input_supported(placer)
        self._placer = placer
        self._mesh = placer.mesh
        self._structure = host_iterator.element_spec
        specs = tf.nest.flatten(self._structure)
        self._dtypes = [spec.dtype for spec in specs]
        with tf.init_scope(), tf.device(_HOST):
            first = _first_batch(host_iterator)
            if first is None:
                self._shapes = [_empty_shape(spec) for spec in specs]
            else:
                self._shapes = [leaf.shape for leaf in tf.nest.flatten(first)]
            # Kept: the multi-device iterator and the devices' iterators the resource packs.
            self._iterators, self._resource = self._device_iterators(host_iterator, first)

    def _splits(self, shape: tf.TensorShape) -> bool:
        parts = self._placer.batch_parts
        return bool(shape.rank) and parts > 1 and shape[0] % parts == 0

    def _device_iterators(self, host_iterator: Iterator, first: Any) -> tuple[tuple[Any, list], tf.Tensor]:
        host_mesh = self._mesh.host_mesh()
        positions = [
            location[self._placer.batch_axis] if self._placer.batch_axis else 0
            for location in self._mesh.local_device_locations()
        ]
        parts = self._placer.batch_parts

        def device_elements(*leaves):
            same = tf.constant(True)
            for leaf, shape in zip(leaves, self._shapes):
                same &= tf.reduce_all(tf.equal(tf.shape(leaf), shape.as_list()))
            kind = tf.where(same, _BATCH, _OTHER_SHAPES)
            columns = [tf.fill([len(positions)], kind)]
            for leaf, shape in zip(leaves, self._shapes):
                leaf = tf.cond(same, lambda leaf=leaf: leaf, lambda leaf=leaf: tf.zeros(shape, leaf.dtype))
                leaf = tf.ensure_shape(leaf, shape)
                if self._splits(shape):
                    pieces = tf.split(leaf, parts)
                    columns.append(tf.stack([pieces[position] for position in positions]))
                else:
                    columns.append(tf.stack([leaf] * len(positions)))
            return tf.data.Dataset.from_tensor_slices(tuple(columns))

        # Each map call reads one host batch, until the host iterator's end.
        host_batches = (
            tf.data.Dataset.from_tensors(0)
            .repeat()
            .map(lambda _: host_iterator.get_next_as_optional())
            .take_while(lambda optional: optional.has_value())
            .map(lambda optional: tuple(tf.nest.flatten(optional.get_value())))
        )
        if first is not None:
            host_batches = tf.data.Dataset.from_tensors(tuple(tf.nest.flatten(first))).concatenate(
                host_batches
            )
        elements = host_batches.flat_map(device_elements).concatenate(
            tf.data.Dataset.from_tensors(self._end_element()).repeat()
        )
        devices = host_mesh.local_devices()
        iterator = multi_device_iterator_ops.OwnedMultiDeviceIterator(
            without_autotune(elements), devices, prefetch_buffer_size=0, source_device=_HOST
        )
        # Each device's iterator again, over its dataset without tf.data's
        # autotuning (the multi-device iterator's own, never read, start no
        # thread): closing an iterator waits for its autotuning thread, which
        # held a garbage collection for minutes on a loaded machine.
        device_iterators = []
        for device, device_iterator in zip(devices, iterator._device_iterators):  # noqa: SLF001
            with tf.device(device):
                device_iterators.append(iter(without_autotune(device_iterator._dataset)))  # noqa: SLF001
        resource = dtensor.pack(
            [it._iterator_resource for it in device_iterators],  # noqa: SLF001
            dtensor.Layout.replicated(host_mesh, 0),
        )
        # DTensor's own dataset sets its elements' layouts this way.
        dtensor_api._dtensor_device().set_iterator_element_layouts(  # noqa: SLF001
            resource, self._layouts(host_mesh)
        )
        return (iterator, device_iterators), resource

    def _layouts(self, mesh: dtensor.Mesh) -> list[dtensor.Layout]:
        """The layout of each tensor of an element (its kind first) on `mesh`."""
        layouts = [dtensor.Layout.replicated(mesh, 0)]
        for shape in self._shapes:
            if self._splits(shape):
                layouts.append(dtensor.Layout.batch_sharded(mesh, self._placer.batch_axis, shape.rank))
            else:
                layouts.append(dtensor.Layout.replicated(mesh, shape.rank))
        return layouts

    def _end_element(self) -> tuple:
        per_device = [
            _local_shape(shape, self._placer.batch_parts if self._splits(shape) else 1)
            for shape in self._shapes
        ]
        zeros = [tf.zeros(shape, dtype) for shape, dtype in zip(per_device, self._dtypes)]
        return (tf.constant(_END),) + tuple(zeros)

    def _get_next(self) -> tuple[tf.Tensor, Any]:
        flat = gen_dataset_ops.iterator_get_next(
            self._resource,
            output_types=[tf.int32] + self._dtypes,
            output_shapes=[tf.TensorShape([])] + self._shapes,
        )
        if self._mesh.host_mesh() != self._mesh:
            flat = list(map(dtensor.copy_to_mesh, flat, self._layouts(self._mesh)))
        kind = flat[0]
        same_shapes = tf.debugging.Assert(
            tf.not_equal(kind, _OTHER_SHAPES),
            [
                "A batch read inside a tf.function on tfmp's ModelParallelStrategy has other "
                f"shapes than the first batch {[s.as_list() for s in self._shapes]} (a partial "
                "last batch?). DTensor compiles a loop's step for one shape: batch the dataset "
                "with drop_remainder=True, or read it with a Python loop and compile the step."
            ],
        )
        with tf.control_dependencies([same_shapes]):
            batch = [tf.identity(value) for value in flat[1:]]
        return kind, tf.nest.pack_sequence_as(self._structure, batch)

    def next(self) -> Any:
        """The next batch; past the end, the step stops with an error."""
        kind, batch = self._get_next()
        not_ended = tf.debugging.Assert(
            tf.not_equal(kind, _END),
            [
                "End of the distributed dataset: next() was called inside a tf.function past "
                "its last batch. Loop over get_next_as_optional() until has_value() is "
                "False, or run fewer steps."
            ],
        )
        with tf.control_dependencies([not_ended]):
            return tf.nest.map_structure(tf.identity, batch)

    def next_as_optional(self) -> "GraphBatchOptional":
        kind, batch = self._get_next()
        return GraphBatchOptional(tf.not_equal(kind, _END), batch)


class GraphBatchOptional:
    """What `get_next_as_optional()` returns inside a `tf.function`: the next
    batch, and whether there was one (past the end, the batch is zeros)."""

    def __init__(self, has_value: tf.Tensor, batch: Any):
        self._has_value = has_value
        self._batch = batch

    def has_value(self) -> tf.Tensor:
        return self._has_value

    def get_value(self) -> Any:
        return self._batch


def check_graph_input_supported(placer: BatchPlacer) -> None:
    """Raises ValueError where batches cannot be read inside a graph."""
    where = None
    if dtensor.num_clients() > 1:
        where = f"with several DTensor clients ({dtensor.num_clients()} here)"
    elif placer.input_mesh is not placer.mesh:
        where = "with pipeline stages (inputs and targets live on different meshes)"
    if where:
        raise ValueError(
            "next() and get_next_as_optional() on an iterator of a distributed dataset "
            f"inside a tf.function are not supported {where}. Call next() outside the "
            "tf.function and pass the batch to the compiled step."
        )


def _first_batch(host_iterator: Iterator) -> Any:
    try:
        return host_iterator.get_next()
    except tf.errors.OutOfRangeError:
        return None


def _empty_shape(spec: tf.TensorSpec) -> tf.TensorShape:
    """The shape of an empty dataset's (never read) batches."""
    return tf.TensorShape([0 if size is None else size for size in spec.shape.as_list()])


def _local_shape(shape: tf.TensorShape, parts: int) -> list[int]:
    dims = shape.as_list()
    if dims:
        dims[0] //= parts
    return dims


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` with tf.data's autotuning off, unless its options set it.

    Closing an iterator with autotuning on waits for its autotuning thread.
    An iterator read one element at a time beside the mesh's steps took
    170-275 ms to close after a `fit` of ten 40 ms steps and up to 2.6 s
    after a first step (plain Keras: 2 ms); the iterators of graph loops,
    collected by Python's garbage collector, held it 79 s alone and minutes
    with the cores loaded. Off, they close in milliseconds; `AUTOTUNE`
    settings then take tf.data's fixed defaults (a parallel `map`: the
    cores)."""
    if dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)
