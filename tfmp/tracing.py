"""The context of the call tfmp's code runs in: one record per thread.

Keras and TensorFlow call tfmp's wrappers from deep inside their own code (a
layer's call, an epoch iterator, an optimizer's sparse update, a variable's
initializer), where tfmp cannot pass an argument. What a wrapper needs to
know about the call around it is a field of `context`, set for the extent of
a block by the one module that owns it (`scoped`) and read by the wrapper.
Every such field is listed here; nothing else in tfmp keeps state per thread.

Examples:
    >>> from tfmp.tracing import context, scoped
    >>> with scoped(building_stage=1):
    ...     context.building_stage
    1
    >>> context.building_stage is None
    True
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


class TracingContext(threading.local):
    """This thread's context; each field is its default outside its block.

    Attributes:
        forward_mesh: The mesh a layer's forward pass is traced on
            (`tfmp.forward.forward_on`), which the lowerings rewrite for.
        microbatched_step: The pipeline step whose micro-batch is being
            traced (`tfmp.forward.MicrobatchedStep`).
        eager_mesh_call: Inside a layer called eagerly that tfmp runs on its
            mesh (`tfmp.strategy.keras_hooks`): its sublayers run as they are.
        creating_variable: The Keras variable whose `tf.Variable` is being
            created (`tfmp.strategy.variable_layout.creating`).
        layout_declarations: `(layer, {path: axes})` of the layers whose
            `build` is running, innermost last (`tfmp.layout.declared_layouts`).
        building_stage: The pipeline stage whose variables are being created
            (`tfmp.pipeline.stages.building_stage`).
        stage_scalar_copies: `(Keras variable, its value on each stage's
            mesh)` of the optimizer's scalars while a pipeline updates its
            weights (`tfmp.pipeline.stages.scalars_on_stages`).
        sparse_update_mesh: The mesh of a variable being updated with a
            sparse gradient (`tfmp.strategy.sparse_division.sparse_update_on`).
        sparse_divided: Whether that update divided its sparse gradient whole.
        skip_in_next_epoch: Batches the next training epoch skips
            (`BackupAndRestore` resuming mid-epoch; `tfmp.strategy.epoch_iterator`).
        build_pass_expected: Whether the next pass over a tfmp model's epoch
            iterator is Keras' symbolic build (`tfmp.strategy.epoch_iterator`).
        unknown_batch_rows: Whether the epoch being run traces its steps with
            a batch size unknown, as one device does (`tfmp.strategy.epoch_iterator`).
        sequences_split_by: The option under which the layer being traced
            runs with its sequences split over a mesh axis,
            `"context_parallel"` or `"sequence_parallel"`, else None
            (`tfmp.strategy.activation_layouts`). Under context parallelism
            Keras' matmul keeps a split sequence (`tfmp.lowering.arrays.matmul`)
            and attention takes its keys in blocks; under either, a slice's
            gradient and a pad meet split sequences (`tfmp.lowering.slicing`).
        step_on_mesh: Whether a strategy's step on a mesh is being traced
            (`ModelParallelExtended.call_for_each_replica`): the losses it
            computes are lowered too (`tfmp.lowering.losses`).
        step_sequence_axis: The mesh axis that splits sequences in that
            step (context parallelism), or None.
        sequence_gathers: The keys and values of the attention layer being
            traced that context parallelism gathered whole over the
            sequence, `{gathered.ref(): (split, gather)}`: attention's
            backward pass gathers them again from `split` instead of
            keeping them (`tfmp.lowering.attention`).
        fused_attention: Whether the KerasHub attention layer being traced
            takes `ops.dot_product_attention` rather than its own softmax
            (`tfmp.lowering.hub_attention`).
    """

    def __init__(self) -> None:
        self.forward_mesh: Any = None
        self.microbatched_step: Any = None
        self.eager_mesh_call = False
        self.creating_variable: Any = None
        self.layout_declarations: list[tuple[str, dict]] = []
        self.building_stage: int | None = None
        self.stage_scalar_copies: list[tuple[Any, list]] = []
        self.sparse_update_mesh: Any = None
        self.sparse_divided = False
        self.skip_in_next_epoch = 0
        self.build_pass_expected = False
        self.unknown_batch_rows = False
        self.sequences_split_by: str | None = None
        self.step_on_mesh = False
        self.step_sequence_axis: str | None = None
        self.sequence_gathers: dict = {}
        self.fused_attention = False


context = TracingContext()


@contextlib.contextmanager
def scoped(**fields: Any) -> Iterator[None]:
    """Sets this thread's `fields` of `context` for the block, then puts back
    what they were.

    Raises:
        AttributeError: If a name is not a field of `TracingContext`.
    """
    previous = {name: getattr(context, name) for name in fields}
    for name, value in fields.items():
        setattr(context, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(context, name, value)
