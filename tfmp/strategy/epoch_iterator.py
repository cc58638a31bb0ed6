"""Keras' epoch iterator for a model on a tfmp mesh: each element read once,
when and as Keras reads it without a strategy.

Under any tf.distribute strategy Keras' `fit` and `evaluate` first read a
batch to build the model symbolically (`_maybe_symbolic_build`): that pass
begins the data adapter's epoch and opens an iterator of its own, then
`reset()` ends the epoch. Without a strategy only the `reset()` happens. The
extra pass started another pass of a shuffle (each `iter()` moves a seeded
`reshuffle_each_iteration` shuffle on), took a batch from a Python generator
or moved a `tf.random.Generator` in a `map` on, and began a `PyDataset`'s
epoch early: the first epoch trained on other rows than on one device.

Here that pass reads nothing: it hands the build the dataset's element
spec, whose shapes and dtypes are all the symbolic build uses (the batch
dimension unknown, as in a `keras.Input`). Batches come from an
`OnDemandDataset`, which reads nothing Keras does not ask for.

A `BackupAndRestore` backup taken in the middle of an epoch resumes at the
batch after it (`tfmp.strategy.backups`): the first epoch the next training
pass opens reads the batches already trained on and hands them to no step,
so the rest of the epoch trains on the rows it would have (with the data
order of an uninterrupted run: no shuffling, or a seeded one). Keras itself
restarts such an epoch from its first batch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import tensorflow as tf

from tfmp.integrations.internals import EpochIterator
from tfmp.strategy.extended import extended_of
from tfmp.strategy.input import MeshDataset, OnDemandDataset
from tfmp.tracing import context, scoped


def skip_in_next_epoch(batches: int) -> None:
    """The next epoch any training pass opens starts after `batches` batches
    (0: at its first); `BackupAndRestore` sets it when it restores."""
    context.skip_in_next_epoch = batches


class ResumesMidEpoch:
    """Skips the batches `skip_in_next_epoch` names (mixed in before Keras'
    `TFEpochIterator` by `read_once`, for every model)."""

    def __iter__(self) -> Any:
        iterator = super().__iter__()
        skip = context.skip_in_next_epoch
        if skip and self._epoch_iterator is not None:
            context.skip_in_next_epoch = 0
            self._epoch_iterator = _after(self._epoch_iterator, skip)
        return iterator


def _after(steps: Iterator[tuple[int, int, Any]], skip: int) -> Iterator[tuple[int, int, Any]]:
    """Keras' `(first step, last step, iterator)` of an epoch from step `skip`
    on, the batches before it read and dropped."""
    for begin, end, iterator in steps:
        if end < skip:
            drop = getattr(iterator, "skip", None)
            if drop is not None:
                drop(end - begin + 1)
            else:
                for _ in range(end - begin + 1):
                    next(iterator)
            continue
        if begin < skip:
            raise ValueError(
                f"BackupAndRestore: the backup was taken after batch {skip} of its epoch, "
                f"which falls inside a call of {end - begin + 1} steps (batches {begin} to "
                f"{end}): resume with the steps_per_execution the backup was written with."
            )
        yield begin, end, iterator


def build_pass_expected() -> contextlib.AbstractContextManager:
    """Keras' `fit` or `evaluate` of a tfmp model runs in the block: the next
    pass over one of its epoch iterators, until a `reset()`, is the symbolic
    build's."""
    return scoped(build_pass_expected=True)


class ReadOnceEpochs:
    """What a tfmp model's `TFEpochIterator` does differently from Keras'
    (mixed in before it by `read_once`)."""

    def __init__(self, distribute_strategy: Any = None, *args: Any, **kwargs: Any):
        # Keras' own __init__ would distribute the dataset with
        # `experimental_distribute_dataset`, whose iterators read ahead.
        EpochIterator.__init__(self, *args, **kwargs)
        self._distribute_strategy = distribute_strategy
        extended = extended_of(distribute_strategy)
        extended.warn_about_layout_rules()
        dataset = self.data_adapter.get_tf_dataset()
        self._element_spec = dataset.element_spec
        if isinstance(dataset, MeshDataset):
            # Already the mesh's (`distribute_datasets_from_function`: each
            # client packs its own rows), as Keras takes a distributed dataset.
            self._distributed_dataset = dataset
        else:
            self._distributed_dataset = OnDemandDataset(
                dataset, extended.placer, extended.first_step_graphs
            )

    def __iter__(self) -> Any:
        if not context.build_pass_expected:
            return super().__iter__()
        context.build_pass_expected = False
        self._epoch_iterator = iter([(0, self.steps_per_execution - 1, iter([self._element_spec]))])
        return self

    @contextlib.contextmanager
    def catch_stop_iteration(self) -> Iterator[None]:
        # Keras runs every step of the epoch in this block.
        first = tf.nest.flatten(self._element_spec)[0]
        with scoped(unknown_batch_rows=bool(first.shape.rank) and first.shape[0] is None):
            with super().catch_stop_iteration():
                yield

    def reset(self) -> None:
        # Keras resets right after its symbolic build, whether or not the
        # build made a pass.
        context.build_pass_expected = False
        super().reset()


def read_once(keras_class: type) -> Callable:
    """Wraps Keras' `TFEpochIterator` class: for a model of a tfmp strategy,
    an epoch iterator with `ReadOnceEpochs` mixed in; any other, Keras' own;
    both resume mid-epoch (`ResumesMidEpoch`)."""
    resuming_class = type(keras_class.__name__, (ResumesMidEpoch, keras_class), {})
    read_once_class = type(keras_class.__name__, (ReadOnceEpochs, ResumesMidEpoch, keras_class), {})

    def epoch_iterator(*args: Any, distribute_strategy: Any = None, **kwargs: Any) -> Any:
        chosen = resuming_class if extended_of(distribute_strategy) is None else read_once_class
        return chosen(*args, distribute_strategy=distribute_strategy, **kwargs)

    return epoch_iterator


def loss_trackers_weighted_as_on_one_device(call: Callable) -> Callable:
    """Keras' `CompileLoss.call`: in a step of a tfmp epoch, the per-output
    loss trackers (`<output>_loss` in the logs) weigh the batch as one device
    does.

    Keras weighs each output's loss by the static batch size of the step's
    trace. One device traces `fit`'s step once, from the dataset's element
    spec: with its batch dimension unknown, every batch weighs one. tfmp's
    step is traced from the batch on the mesh (its size known, to split it),
    and again with an unknown size for a last batch that does not divide the
    batch axis: the last batch weighed 1 where the others weighed their rows.
    """

    @functools.wraps(call)
    def wrapper(self, y_true, y_pred, sample_weight=None):
        if not context.unknown_batch_rows or tf.executing_eagerly():
            return call(self, y_true, y_pred, sample_weight)
        if not self.built:
            self.build(y_true, y_pred)
        trackers = [tracker for tracker in self.metrics if tracker is not None]
        for tracker in trackers:
            tracker.update_state = functools.partial(_weighing_one, type(tracker).update_state, tracker)
        try:
            return call(self, y_true, y_pred, sample_weight)
        finally:
            for tracker in trackers:
                del tracker.update_state

    return wrapper


def _weighing_one(update_state: Callable, tracker: Any, values: Any, sample_weight: Any = None) -> Any:
    return update_state(tracker, values, sample_weight=None)
