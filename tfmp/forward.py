"""A layer's forward pass on a mesh: which mesh it runs on, and how it reads weights.

A variable's layout (from a rule or a layer's declaration) is its storage
layout: where its shards live between steps. A layer's forward pass reads it
in its compute layout: the storage layout with the batch axis gathered, since
the activations a weight meets are split over that axis already (DTensor
refuses a contraction split over two mesh axes, and a dimension split over
the axis that splits the batch), and with the axes of a `tfmp.gather_on_use`
layout gathered (a weight split for memory only). Gathering on use, and
DTensor reducing the gradient back to the stored layout, is fully sharded
data parallelism (ZeRO-3); it is also what GSPMD does on JAX with the same
rules.

While a layer's forward pass is traced on a mesh, `forward_mesh()` names that
mesh: tfmp's lowerings of ops DTensor cannot expand (`tfmp.lowering`) use it
to decide whether to run, and where. While a pipeline traces one stage's
forward pass of one micro-batch, `microbatched_step()` says which micro-batch
of how many: random draws use it to draw what one device draws for the whole
batch.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.tracing import context, scoped

# Name scope of the relayouts that gather weights on use: `tfmp.comm_report`
# tells their collectives from the others by it.
GATHER_SCOPE = "tfmp_gather_on_use"

# Name scope prefix, followed by the op's name, of the relayouts that gather
# the inputs of an op DTensor has no layout rule for (`tfmp.lowering.replicated`):
# `tfmp.comm_report` and the first step's note find those gathers by it.
REPLICATED_SCOPE = "tfmp_replicated_"

# Name scope of the ops of tfmp's custom gradients: TensorFlow's own gradient
# ops live under "gradient_tape/", which is how tfmp.comm_report tells the
# backward pass from the forward one.
BACKWARD_SCOPE = "gradient_tape"


def compute_specs(weight: Any) -> tuple[str, ...] | None:
    """How a tfmp variable (or the Keras variable around one) is split in
    the forward pass (its compute layout's specs); None for any other value."""
    variable = getattr(weight, "_value", weight)  # a Keras variable's backend variable
    layout = getattr(variable, "compute_layout", None)
    return None if layout is None else tuple(layout.sharding_specs)


def relayout_with_gradient(value: tf.Tensor, layout: dtensor.Layout, gradient_layout: dtensor.Layout) -> tf.Tensor:
    """`value` in `layout`; its gradient in `gradient_layout`.

    Autodiff would relayout the gradient "like" the value, a layout DTensor
    infers, and then fails to meet ("output layout of Relayout op after layout
    propagation does not match").
    """

    @tf.custom_gradient
    def relayout(value: tf.Tensor):
        def grad(dy: tf.Tensor) -> tf.Tensor:
            with tf.name_scope(BACKWARD_SCOPE):
                return dtensor.relayout(dy, gradient_layout)

        return dtensor.relayout(value, layout), grad

    return relayout(value)


def forward_on(mesh: dtensor.Mesh | None) -> contextlib.AbstractContextManager:
    """A layer's forward pass on `mesh` is traced in the block (None: on no mesh)."""
    return scoped(forward_mesh=mesh)


def forward_mesh() -> dtensor.Mesh | None:
    """The mesh of the layer whose forward pass is being traced, or None
    (also when running eagerly: DTensor lays out only traced functions)."""
    if tf.executing_eagerly():
        return None
    return context.forward_mesh


class MicrobatchedStep:
    """A pipeline training step being traced, whose layers run once per micro-batch.

    On one device each random layer draws once per step, with the next seed
    of its `SeedGenerator`, for the whole batch. In a pipeline it runs once
    per micro-batch; the step keeps what makes those runs draw alike: the
    seeds drawn so far (the first micro-batch to draw advances the generator,
    the others reuse its seed), and which micro-batch is being traced.

    Args:
        count: Micro-batches per step.
        rows: Samples per micro-batch, or None where unknown until the step runs.
    """

    def __init__(self, count: int, rows: int | None):
        self.count = count
        self.rows = rows
        self.index: int | None = None  # of the micro-batch being traced
        self._seeds: dict[tuple[Any, int], Any] = {}
        # Seeds taken from each generator so far in the pass being traced:
        # a layer may draw several times per call.
        self._draws: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """One stage's forward pass of micro-batch `index` is traced in the block."""
        self.index = index
        self._draws.clear()
        try:
            with scoped(microbatched_step=self):
                yield
        finally:
            self.index = None

    def seed(self, generator: Any, draw: Callable[[], Any]) -> Any:
        """The step's seed for `generator`'s next draw in this pass: `draw()`
        (which advances the generator) for the first micro-batch to ask, the
        same seed for the others."""
        key = (generator, self._draws[generator])
        self._draws[generator] += 1
        if key not in self._seeds:
            self._seeds[key] = draw()
        return self._seeds[key]


def microbatched_step() -> MicrobatchedStep | None:
    """The pipeline step whose micro-batch is being traced, or None."""
    if tf.executing_eagerly():
        return None
    return context.microbatched_step


def batch_spec(inputs: Any, mesh: dtensor.Mesh, other_axis: str) -> str:
    """The mesh axis the batch of `inputs` is split over, or UNSHARDED.

    That is the running strategy's batch axis, unless it is `other_axis` (the
    layer's own), missing from the mesh, or does not divide this batch (which
    the strategy then runs whole on every device).

    A batch size unknown when traced is UNSHARDED too: Keras traces the step
    again with an unknown batch size for a second size (the partial last
    batch), and that trace runs batches the strategy split and batches it
    left whole. A layout pinned split would stop the whole ones (DTensor:
    "requires dimension 0 to be divisible by sharding"); pinned whole, both
    run, and a batch split over the axis is gathered where pinned. Batches of
    the size first traced keep their own trace, split.
    """
    batch_axis = getattr(tf.distribute.get_strategy(), "batch_axis", None)
    if batch_axis in (None, other_axis) or batch_axis not in mesh.dim_names:
        return dtensor.UNSHARDED
    size = inputs.shape[0]
    if size is None or size % mesh.dim_size(batch_axis):
        return dtensor.UNSHARDED
    return batch_axis
