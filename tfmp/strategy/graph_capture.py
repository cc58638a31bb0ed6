"""Keeping the device graphs DTensor runs for the first training step.

DTensor inserts the collectives when it first runs a step function, so they
exist only in the expanded per-device graphs. TensorFlow reports those graphs
when graph collection is on while a function first runs; tfmp turns it on for
the first batches it feeds and off again, so later steps pay nothing. Until a
training step has been seen (say, after a `predict`), the next dataset is
watched again.
"""

from __future__ import annotations

from typing import Any


from tfmp.integrations.internals import eager_context as context
from tfmp.state import ModelState, state_of
from tfmp.strategy.replicated_ops import note_replicated_ops

# Batches fed with collection on: the first step runs on one of the first
# two whether or not a loop reads a batch of its own before it (Keras' fit
# reads none under tfmp: `tfmp.strategy.epoch_iterator`); the graphs are read
# when the third batch is asked for, or at the end of the data.
_BATCHES_TO_CAPTURE = 2


class FirstStepGraphs:
    """Collects the per-device graphs of the functions run for the first batches."""

    def __init__(self):
        self.function_graphs: list[Any] = []
        self._batches_left = 0
        self._collecting = False
        self._has_train_step = False

    def on_new_iterator(self) -> None:
        """Called when a dataset starts an epoch: watch it if no step is known yet."""
        if not self._has_train_step and not self._collecting:
            self._batches_left = _BATCHES_TO_CAPTURE

    def on_batch(self) -> None:
        """Called before each batch is handed to Keras."""
        if self._collecting and self._batches_left == 0:
            self.finish()
        elif self._batches_left:
            if not self._collecting:
                self._start()
            self._batches_left -= 1

    def finish(self) -> None:
        """Stops collecting and keeps what was collected."""
        self._batches_left = 0
        if not self._collecting:
            return
        self._collecting = False
        metadata = context.export_run_metadata()
        context.disable_graph_collection()
        context.disable_run_metadata()
        if metadata is not None:
            captured = [graph for graph in metadata.function_graphs if graph.partition_graphs]
            note_replicated_ops(captured)
            self.function_graphs += captured
        self._has_train_step = any(map(is_train_step, self.function_graphs))

    def _start(self) -> None:
        self._collecting = True
        context.enable_run_metadata()
        context.enable_graph_collection()


def is_train_step(function_graph: Any) -> bool:
    """Whether a captured function computes gradients (a training step)."""
    return any(
        "gradient_tape/" in node.name
        for partition in function_graph.partition_graphs
        for node in partition.node
    )


def first_step_graphs_of(model: Any) -> FirstStepGraphs:
    """The graphs kept for `model` (created empty the first time)."""
    state = state_of(model, ModelState)
    if state.first_step_graphs is None:
        state.first_step_graphs = FirstStepGraphs()
    return state.first_step_graphs
