"""Feeding `tf.data` batches to the mesh, one host batch at a time.

`MeshDataset` is what `strategy.experimental_distribute_dataset` returns, for
custom loops; `OnDemandDataset` is what Keras' `fit`, `evaluate` and
`predict` iterate (`tfmp.strategy.epoch_iterator`): it reads each element
only when Keras asks for it, so a step trains on the rows it would train on
without a strategy.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf

from tfmp.integrations.internals import distribute_types, input_lib
from tfmp.strategy.graph_capture import FirstStepGraphs
from tfmp.strategy.graph_input import GraphBatches, without_autotune
from tfmp.strategy.placement import BatchPlacer, pack
from tfmp.strategy import small_batch_values, stacked_batches

_HOST = "CPU:0"


class MeshDataset(distribute_types.Iterable):
    """A dataset whose batches arrive on the mesh, split over the batch axis.

    What `ModelParallelStrategy.experimental_distribute_dataset` returns. Each
    batch is read on the host and packed onto the mesh, so any batch size and a
    partial last batch work (DTensor's own dataset drops the remainder).
    Iterated eagerly, it reads one batch ahead on the host, and Keras runs one
    step function call per batch. `for batch in dataset:` inside a
    `tf.function` runs through `reduce`, as it does for `tf.distribute`'s
    datasets: the epoch's batches are inputs of the function, read on the host
    at each call, and the step is traced once for the full batches and once
    for a partial last batch.

    Args:
        dataset: A batched `tf.data.Dataset`.
        placer: Packs each batch onto the mesh.
        first_step_graphs: Told of every batch, to keep the first step's graphs.
        local_rows: Whether each batch is only this client's rows of the
            global batch (from `distribute_datasets_from_function`).
        on_batch: Called with each batch on the mesh as it is handed out.
    """

    def __init__(
        self,
        dataset: tf.data.Dataset,
        placer: BatchPlacer,
        first_step_graphs: FirstStepGraphs,
        local_rows: bool = False,
        on_batch: Callable[[Any], None] | None = None,
    ):
        self._dataset = dataset
        self._placer = placer
        self._first_step_graphs = first_step_graphs
        self._local_rows = local_rows
        self._on_batch = on_batch

    @property
    def cardinality(self) -> np.int64:
        """Batches per epoch, as Keras reads it from a distributed dataset."""
        return np.int64(self._dataset.cardinality())

    @property
    def element_spec(self) -> Any:
        return self._dataset.element_spec

    def reduce(self, initial_state: Any, reduce_fn: Callable[[Any, Any], Any]) -> Any:
        """Folds `reduce_fn(state, batch)` over one epoch's batches.

        What AutoGraph runs for `for batch in dataset:` inside a
        `tf.function`. Eagerly it is a Python loop over the batches. Traced,
        the batches are the function's inputs, read on the host at each call;
        the batches of one shape run in one `tf.while_loop`, a partial last
        batch after them, so the step is traced at most twice per epoch.

        Args:
            initial_state: The state before the first batch: a structure of
                tensors (Python numbers become tensors).
            reduce_fn: Takes the state and a batch on the mesh, returns the
                state of the same structure.

        Returns:
            The state after the last batch.

        Examples:
            >>> strategy = tfmp.ModelParallelStrategy(mesh)
            >>> dataset = strategy.experimental_distribute_dataset(
            ...     tf.data.Dataset.range(37).batch(8))
            >>> def add_rows(total, batch):
            ...     rows = strategy.run(tf.reduce_sum, args=(batch,))
            ...     return total + strategy.reduce("SUM", rows, axis=None)
            >>> int(tf.function(lambda: dataset.reduce(tf.constant(0, tf.int64), add_rows))())
            666
        """
        if not tf.executing_eagerly():
            return _reduce_in_graph(self, initial_state, reduce_fn)
        state = initial_state
        for batch in self:
            state = reduce_fn(state, batch)
        return state

    def __iter__(self) -> "MeshIterator | Iterator[Any]":
        if not tf.executing_eagerly():
            return iter(_call_time_epoch(self)[0])
        cardinality = int(self._dataset.cardinality())
        # tf_keras iterates inside the strategy's scope, whose default device
        # is the mesh: the host pipeline must stay on the host.
        with tf.device(_HOST):
            host_iterator = iter(without_autotune(self._dataset))
        return MeshIterator(
            host_iterator,
            self._placer,
            cardinality != tf.data.UNKNOWN_CARDINALITY,
            self._first_step_graphs,
            self._local_rows,
            self._on_batch,
            self.element_spec,
        )


def _call_time_epoch(dataset: MeshDataset) -> tuple[list[Any], list[tuple[int, int]]]:
    """The batches of one epoch as inputs of the `tf.function` being traced,
    read on the host at each call, and the runs of them one traced step can
    run (`stacked_batches.runs`).

    Each batch is a separate input of the function (so a partial last batch
    keeps its own shape and layout). Tracing reads one epoch to learn the
    batches, which the first call trains on; each later call reads a new
    epoch, as `for` over a `tf.data.Dataset` in a `tf.function` opens a new
    iterator at each call. Small values (a partial batch's labels, replicated)
    travel in a dtype DTensor does not fold (`small_batch_values`), so that a
    later call's new labels do not make DTensor lay the function out again.
    """
    graph = tf.compat.v1.get_default_graph()
    with tf.init_scope():
        epoch = _HostEpoch(dataset, _read_epoch(dataset))
        runs = stacked_batches.runs(epoch.batches)
    inputs = []
    for index, (value, carried) in enumerate(zip(epoch.leaves, epoch.carried)):
        spec = tf.TensorSpec(value.shape, carried or value.dtype)
        placeholder = graph.capture_call_time_value(functools.partial(epoch.leaf, index), spec)
        inputs.append(placeholder if carried is None else tf.cast(placeholder, value.dtype))
    return tf.nest.pack_sequence_as(epoch.batches, inputs), runs


def _reduce_in_graph(dataset: MeshDataset, initial_state: Any, reduce_fn: Callable) -> Any:
    """`MeshDataset.reduce` traced: each run of batches of one shape and
    layout in one `tf.while_loop` (a partial last batch on its own), so the
    step is traced once or twice per epoch, not once per batch."""
    batches, runs = _call_time_epoch(dataset)
    state = tf.nest.map_structure(_as_loop_value, initial_state)
    for start, count in runs:
        if count == 1:
            state = reduce_fn(state, batches[start])
            continue
        stacked = stacked_batches.stack(batches[start : start + count])

        def body(index, state, stacked=stacked):
            return index + 1, reduce_fn(state, stacked_batches.batch_at(stacked, index))

        # In order: each step reads the variables the step before wrote.
        _, state = tf.while_loop(
            lambda index, _, count=count: index < count,
            body,
            (tf.constant(0), state),
            parallel_iterations=1,
        )
    return state


def _as_loop_value(value: Any) -> Any:
    """A Python or numpy number of a loop's state as a tensor, as
    `tf.data.Dataset.reduce` takes it (so a counter started at 0 ends an int32)."""
    if isinstance(value, (bool, int, float, np.ndarray, np.generic)):
        return tf.convert_to_tensor(value)
    return value


def _read_epoch(dataset: MeshDataset) -> list[Any]:
    """All batches of one pass over `dataset`, on the mesh."""
    batches = []
    try:
        for batch in dataset:
            batches.append(batch)
    except tf.errors.OutOfRangeError:  # the end of a dataset of unknown length
        pass
    return batches


class _HostEpoch:
    """The batches on the mesh that a call of a compiled epoch trains on,
    handed out leaf by leaf as the call asks for its inputs; once all are
    handed out, the next call's ask reads a new epoch."""

    def __init__(self, dataset: MeshDataset, batches: list[Any]):
        self._dataset = dataset
        self.batches = batches
        self.leaves: list[tf.Tensor] | None = tf.nest.flatten(batches)
        self.carried = [small_batch_values.carried_dtype(value) for value in self.leaves]
        self._specs = [(value.shape, value.dtype) for value in self.leaves]
        self._unread = len(self.leaves)

    def leaf(self, index: int) -> tf.Tensor:
        if self.leaves is None:
            self.leaves = tf.nest.flatten(_read_epoch(self._dataset))
            specs = [(value.shape, value.dtype) for value in self.leaves]
            if specs != self._specs:
                raise ValueError(
                    "A tf.function that iterates a distributed dataset of tfmp's "
                    "ModelParallelStrategy is compiled for the batches of the epoch it "
                    f"was traced with ({self._specs}), but this epoch has others "
                    f"({specs}). Keep the dataset's batches the same from epoch to "
                    "epoch, or iterate it eagerly and compile the step."
                )
            self._unread = len(self.leaves)
        value = self.leaves[index]
        self._unread -= 1
        if self._unread == 0:
            self.leaves = None
        carried = self.carried[index]
        return value if carried is None else tf.cast(value, carried)


class ClientMeshDataset(MeshDataset, input_lib.DistributedDatasetsFromFunction):
    """What `distribute_datasets_from_function` returns: a `MeshDataset` that
    Keras' `fit` takes as it is (it recognizes the TF class by name)."""


class MeshIterator(distribute_types.Iterator):
    """Iterator over a `MeshDataset` that prepares each batch one step ahead.

    While the step on batch k runs, a worker thread reads batch k+2 on the
    host and cuts batch k+1 into its devices' shards, so the step does not
    wait for the host. Reading one batch further ahead tells whether a batch
    is the last (a partial last batch is laid out to stay exact). Packing the
    shards onto the mesh happens in the caller's thread, when the batch is
    asked for: DTensor's device is not safe to use from two threads at once
    (a worker packing while a step ran crashed the process now and then).

    Nothing is read before the first eager `next()`. A `next()` or
    `get_next_as_optional()` traced into a `tf.function` instead hands the
    host iterator to `GraphBatches`, whose batches are ops of the graph
    (TensorFlow's multi-step loops).
    """

    def __init__(
        self,
        host_iterator: Iterator,
        placer: BatchPlacer,
        known_length: bool,
        first_step_graphs: FirstStepGraphs,
        local_rows: bool = False,
        on_batch: Callable[[Any], None] | None = None,
        element_spec: Any = None,
    ):
        self._local_rows = local_rows
        self._on_batch = on_batch
        self.element_spec = element_spec
        self._host_iterator = host_iterator
        self._placer = placer
        self._known_length = known_length
        self._first_step_graphs = first_step_graphs
        first_step_graphs.on_new_iterator()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tfmp-input")
        self._ahead: concurrent.futures.Future | None = None
        self._graph_batches: GraphBatches | None = None

    def _submit(self, batch: Any) -> concurrent.futures.Future:
        """Cuts `batch` into shards (and reads the one after it) on the worker
        thread."""
        return self._worker.submit(self._split_next, batch)

    def _pull(self) -> Any:
        try:
            with tf.device(_HOST):
                return next(self._host_iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            return None

    def _split_next(self, batch: Any) -> tuple[Any, Any] | None:
        """`batch` cut into its devices' shards and the host batch after it;
        None at the end."""
        if batch is None:
            return None
        following = self._pull()
        return self._placer.split_batch(batch, following is None, self._local_rows), following

    def __iter__(self) -> "MeshIterator":
        return self

    def __next__(self) -> Any:
        if not tf.executing_eagerly():
            return self._in_graph().next()
        if self._graph_batches is not None:
            raise RuntimeError(
                "This iterator of a distributed dataset is read inside a tf.function, which "
                "reads its batches ahead: read it there only, or make another iterator with "
                "iter() for eager reads."
            )
        if self._ahead is None:
            self._ahead = self._submit(self._pull())
        ahead = self._ahead.result()
        if ahead is None:
            self._worker.shutdown(wait=False)
            self._first_step_graphs.finish()
            if self._known_length:
                raise StopIteration
            # Keras stops an epoch of unknown length on OutOfRangeError; a plain
            # StopIteration inside its step loop would leave it without outputs.
            raise tf.errors.OutOfRangeError(None, None, "End of dataset.")
        shards, following = ahead
        self._first_step_graphs.on_batch()
        self._ahead = self._submit(following)
        batch = pack(shards)
        if self._on_batch is not None:
            self._on_batch(batch)
        return batch

    def get_next(self) -> Any:
        return next(self)

    def _in_graph(self) -> GraphBatches:
        """The batches as ops of the function being traced (the first trace
        takes the host iterator over)."""
        if self._graph_batches is None:
            if self._ahead is not None:
                raise RuntimeError(
                    "next() or get_next_as_optional() inside a tf.function on an iterator of a "
                    "distributed dataset that was already read eagerly: tfmp has read batches "
                    "ahead on the host. Make a new iterator with iter() for the tf.function, "
                    "or keep reading this one eagerly."
                )
            self._graph_batches = GraphBatches(self._host_iterator, self._placer)
            self._worker.shutdown(wait=False)
        return self._graph_batches

    def get_next_as_optional(self) -> "BatchOptional":
        """The next batch, or none at the end, as `tf.distribute`'s iterators
        give it (DTensor cannot lay out a `tf.experimental.Optional`)."""
        if not tf.executing_eagerly():
            return self._in_graph().next_as_optional()
        try:
            return BatchOptional(next(self))
        except (StopIteration, tf.errors.OutOfRangeError):
            return BatchOptional(None)


class BatchOptional:
    """What `MeshIterator.get_next_as_optional` returns: a batch, or none at
    the end of the dataset, with `tf.experimental.Optional`'s methods.

    Examples:
        >>> strategy = tfmp.ModelParallelStrategy(mesh)
        >>> iterator = iter(strategy.experimental_distribute_dataset(
        ...     tf.data.Dataset.from_tensor_slices(x).batch(48)))
        >>> [iterator.get_next_as_optional().get_value().shape[0] for _ in range(2)]
        [48, 16]
        >>> bool(iterator.get_next_as_optional().has_value())
        False
    """

    def __init__(self, batch: Any):
        self._batch = batch

    def has_value(self) -> tf.Tensor:
        return tf.constant(self._batch is not None)

    def get_value(self) -> Any:
        if self._batch is None:
            raise tf.errors.InvalidArgumentError(
                None, None, "The dataset has no more batches: check has_value() first."
            )
        return self._batch


class OnDemandDataset:
    """The batches of Keras' `fit`, `evaluate` or `predict`, read from the host
    one at a time, when Keras asks for them.

    `iter()` opens the host iterator at once, as `iter()` of a `tf.data`
    dataset does: each opening starts a new pass of a shuffle with
    `reshuffle_each_iteration`, so the passes are the ones Keras opens
    without a strategy. Nothing is read ahead: a read Keras does not ask for
    would take an element from a Python generator or a `PyDataset`, or a draw
    from a `tf.random.Generator` in a `map`, that one device would train on.

    Args:
        dataset: The batched `tf.data.Dataset` of Keras' data adapter.
        placer: Packs each batch onto the mesh.
        first_step_graphs: Told of every batch, to keep the first step's graphs.
    """

    def __init__(self, dataset: tf.data.Dataset, placer: BatchPlacer, first_step_graphs: FirstStepGraphs):
        self._dataset = without_autotune(dataset)
        self._placer = placer
        self._first_step_graphs = first_step_graphs

    def __iter__(self) -> "OnDemandIterator":
        known_length = int(self._dataset.cardinality()) != tf.data.UNKNOWN_CARDINALITY
        with tf.device(_HOST):
            host_iterator = iter(self._dataset)
        return OnDemandIterator(host_iterator, self._placer, known_length, self._first_step_graphs)


class OnDemandIterator:
    """Iterator over an `OnDemandDataset`: each `next()` reads one host batch,
    cuts it into its devices' shards and packs them onto the mesh, in the
    caller's thread.
    """

    def __init__(
        self,
        host_iterator: Iterator,
        placer: BatchPlacer,
        known_length: bool,
        first_step_graphs: FirstStepGraphs,
    ):
        self._host_iterator = host_iterator
        self._placer = placer
        self._known_length = known_length
        self._first_step_graphs = first_step_graphs
        first_step_graphs.on_new_iterator()
        # Rows of the last batch when they do not divide the batch axis: a
        # batch after it makes such batches more than the last one.
        self._undivided_rows: int | None = None

    def __iter__(self) -> "OnDemandIterator":
        return self

    def skip(self, count: int) -> None:
        """Reads `count` batches on the host and drops them (a backup taken
        mid-epoch resumes after them): nothing is sent to the mesh."""
        for _ in range(count):
            self._read_host()
        self._undivided_rows = None

    def __next__(self) -> Any:
        batch = self._read_host()
        if self._undivided_rows is not None:
            self._placer.warn_undivided(self._undivided_rows)
        rows = self._placer.batch_rows(batch)
        divides = rows is None or rows % self._placer.batch_parts == 0
        self._undivided_rows = None if divides else rows
        self._first_step_graphs.on_batch()
        return small_batch_values.packed_for_step(self._placer.split_batch(batch))

    def _read_host(self) -> Any:
        try:
            with tf.device(_HOST):
                return next(self._host_iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            self._first_step_graphs.finish()
            if self._known_length:
                raise StopIteration from None
            # Keras stops an epoch of unknown length on OutOfRangeError; a plain
            # StopIteration inside its step loop would leave it without outputs.
            raise tf.errors.OutOfRangeError(None, None, "End of dataset.") from None


class OneBatch(collections.namedtuple("OneBatch", ["batch"])):
    """One batch, passed to a compiled step where it expects an iterator: a
    structure of tensors to `tf.function`, the batch to `next`.

    How training loops that call `next(iterator)` inside their step (tf_keras,
    Orbit) train on tfmp's host-read batches: the loop reads each batch
    eagerly and hands it to the same step.
    """

    __slots__ = ()

    def __next__(self) -> Any:
        return self.batch
