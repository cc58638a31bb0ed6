"""Activations laid out in a traced step: a layer's output by its
`LayoutMap["<layer path>/output"]` rule, else by sequence or context
parallelism; an attention layer's inputs gathered whole under sequence
parallelism, its keys and values under context parallelism.

Under a Keras distribution Keras' own `Layer.__call__` looks the output rule
up and calls `distribute_tensor`; for a tfmp strategy the patched
`Layer.__call__` calls `laid_out_call` instead, with the path Keras uses
(the enclosing layers' names and the layer's).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf

from tfmp.forward import forward_mesh, relayout_with_gradient
from tfmp.integrations.internals import get_keras_mask, set_keras_mask
from tfmp.integrations.internals import keras_current_path as current_path
from tfmp.layout import layout_axes
from tfmp.tracing import context, scoped
from tfmp.strategy.keras_distribution import distribute_tensor, traced_layout
from tfmp.strategy.sequence_parallel import (
    gathers_sequence,
    gradient_whole_over_sequence,
    is_embedding,
    keys_and_values_whole,
    sequence_axes,
    splits_queries,
)
from tfmp.strategy.strategy import ModelParallelStrategy


def laid_out_call(layer: Any, layer_call: Callable, args: tuple, kwargs: dict) -> Any:
    """`layer_call(layer, *args, **kwargs)`, traced on a mesh, with the
    strategy's activation layouts applied to its inputs and output."""
    strategy = tf.distribute.get_strategy()
    mesh = forward_mesh()
    if (
        keras.distribution.distribution() is not None
        or not isinstance(strategy, ModelParallelStrategy)
        or mesh is None
    ):
        return layer_call(layer, *args, **kwargs)
    option, axis = "sequence_parallel", strategy.sequence_parallel_axis
    if strategy.context_parallel_axis is not None:
        option, axis = "context_parallel", strategy.context_parallel_axis
    if axis not in mesh.dim_names:  # None, or not on a pipeline stage's mesh
        axis = None
    attention = axis is not None and gathers_sequence(layer)
    splits_queries = attention and option == "context_parallel"
    whole_keys = _whole_keys_and_values(layer, strategy.batch_axis, axis, mesh) if splits_queries else None
    splits_sequences = option == "context_parallel" and axis is not None
    sequences_split_by = option if axis is not None else None
    with whole_keys or contextlib.nullcontext(False) as queries_split, scoped(sequences_split_by=sequences_split_by):
        if attention:
            inputs_axis = axis if queries_split else None
            args, kwargs = tf.nest.map_structure(
                lambda value: _sequence_inputs(
                    value, strategy.batch_axis, inputs_axis, mesh, whole_gradient=option == "sequence_parallel"
                ),
                (args, kwargs),
            )
        outputs = layer_call(layer, *args, **kwargs)
    path = "/".join(filter(None, (current_path(), layer.name)))
    axes = strategy.layout_map.output_axes(path)
    if axes is None and axis is not None:
        axes = sequence_axes(layer, outputs, axis, strategy.batch_axis, mesh.dim_size(axis), option)
        if axes is not None:
            strategy.layout_map.note_output(path, f"{option}={axis!r}", axes)
    # Under context parallelism the gradient of an embedding's output, and
    # of the output of a layer that mixes positions and computed them whole
    # (no queries of its own to split), reaches it whole: DTensor would carry
    # the split of the later layers into their backward passes, through a
    # lookup's gradient (rows of batch x sequence) and a linear attention's
    # shifts and chunks, which it cannot split. Such a layer's output is
    # first laid out whole in the forward pass too: DTensor carried the
    # split of the relayout after it back onto the time steps a recurrence
    # stacks, which it then could not stack.
    if splits_sequences and ((attention and not queries_split) or (axes is None and is_embedding(layer))):
        computed_whole = attention and not queries_split

        def kept_whole(tensor: tf.Tensor) -> tf.Tensor:
            if computed_whole:
                tensor = _sequence_inputs(tensor, strategy.batch_axis, None, mesh)
            return gradient_whole_over_sequence(
                tensor, lambda gradient: _sequence_inputs(gradient, strategy.batch_axis, None, mesh)
            )

        outputs = tf.nest.map_structure(
            lambda tensor: _with_mask_of(tensor, kept_whole(tensor))
            if isinstance(tensor, tf.Tensor) and tensor.dtype.is_floating else tensor,
            outputs,
        )
    if axes is None:
        return outputs
    if not attention and strategy.layout_map.output_axes(path) is None:
        # A norm's or dropout's output split by sequence or context
        # parallelism gets an explicit gradient: DTensor's own gradient of the
        # relayout (`RelayoutLike`, the gradient laid out as DTensor
        # propagated the relayout's input) failed its layout check in a step
        # whose batch runs whole (a last partial batch), where a norm's split
        # output feeds a dropout (the BERT family). Under context parallelism
        # the gradient keeps the split, as the layers before computed; under
        # sequence parallelism it is whole over the sequence, as the
        # tensor-parallel block before computed: kept split there, it broke
        # the demo LM's vocabulary-parallel embedding.
        gradient_axes = axes if splits_sequences else (strategy.batch_axis, None, None)

        def lay_out(tensor: tf.Tensor) -> tf.Tensor:
            return relayout_with_gradient(
                tensor,
                traced_layout(tensor, axes, mesh, strategy.batch_axis),
                traced_layout(tensor, gradient_axes, mesh, strategy.batch_axis),
            )
    else:
        def lay_out(tensor: tf.Tensor) -> tf.Tensor:
            return distribute_tensor(tensor, axes)

    return tf.nest.map_structure(
        lambda tensor: _with_mask_of(tensor, lay_out(tensor)) if isinstance(tensor, tf.Tensor) else tensor,
        outputs,
    )


def _with_mask_of(tensor: tf.Tensor, laid_out: tf.Tensor) -> tf.Tensor:
    """`laid_out`, a relayout of `tensor`, with `tensor`'s Keras mask (an
    embedding's `mask_zero`): Keras reads a layer's input masks from its
    arguments, and a new tensor has none."""
    mask = get_keras_mask(tensor)
    if mask is not None and laid_out is not tensor:
        set_keras_mask(laid_out, mask)
    return laid_out


@contextlib.contextmanager
def _whole_keys_and_values(layer: Any, batch_axis: str | None, axis: str, mesh: Any) -> Iterator[bool]:
    """While the block runs, the attention layer's `_compute_attention` gets
    its key and value whole over `axis` (`keys_and_values_whole`); yields
    whether its queries are split (`splits_queries`)."""
    if not splits_queries(layer):
        yield False
        return
    compute_attention = layer._compute_attention  # noqa: SLF001
    heads_axis = _heads_axis(layer, batch_axis, axis)

    def gather(value: Any) -> Any:
        gathered = _key_or_value(value, batch_axis, None, heads_axis, mesh)
        if gathered is not value:
            context.sequence_gathers[gathered.ref()] = (value, gather_again)
        return gathered

    def gather_again(value: tf.Tensor) -> tf.Tensor:
        # Laid out split first: DTensor would otherwise compute `value` whole
        # from the forward pass's gather, which then stays alive.
        split = _key_or_value(value, batch_axis, axis, heads_axis, mesh)
        return _key_or_value(split, batch_axis, None, heads_axis, mesh)

    # On the instance, for this call only: Keras' tracking of layer
    # attributes is bypassed, and the class's method shows through after.
    object.__setattr__(layer, "_compute_attention", keys_and_values_whole(compute_attention, gather))
    try:
        with scoped(sequence_gathers={}):
            yield True
    finally:
        object.__delattr__(layer, "_compute_attention")


def _heads_axis(layer: Any, batch_axis: str | None, sequence_axis: str) -> str | None:
    """The mesh axis an attention layer's heads are split over: the one axis
    its weights are split over besides the batch and sequence axes (the
    tensor-parallel axis of its projections), else None."""
    axes = {
        axis
        for weight in layer.weights
        if (layout := getattr(getattr(weight, "value", None), "layout", None)) is not None
        for axis in layout_axes(layout)
        if axis not in (None, batch_axis, sequence_axis)
    }
    return axes.pop() if len(axes) == 1 else None


def _sequence_inputs(
    value: Any, batch_axis: str | None, sequence_axis: str | None, mesh: Any, whole_gradient: bool = False
) -> Any:
    """An attention layer's `(batch, sequence, features)` floating input with
    its sequence split over `sequence_axis` where it divides (else whole: the
    layer's output then names the length), or whole for None; other values
    as they are.

    With `whole_gradient` (sequence parallelism), laid out whole, its
    gradient is whole too: DTensor's own gradient of the relayout
    (`RelayoutLike`) failed its layout check at ALBERT's first step, where
    attention reads a projection of the embeddings' split norm and dropout.
    Under context parallelism such an explicit gradient made ESM's
    `RelayoutLike` fail instead (its attention computes whole), so there
    DTensor's stays."""
    if not isinstance(value, tf.Tensor) or value.shape.rank != 3 or not value.dtype.is_floating:
        return value
    length = value.shape[1]
    if sequence_axis is not None and (length is None or length % mesh.dim_size(sequence_axis)):
        sequence_axis = None
    if sequence_axis is None and whole_gradient:
        whole = traced_layout(value, (batch_axis, None, None), mesh, batch_axis)
        return _with_mask_of(value, relayout_with_gradient(value, whole, whole))
    return _with_mask_of(value, distribute_tensor(value, (batch_axis, sequence_axis, None)))


def _key_or_value(
    value: Any, batch_axis: str | None, sequence_axis: str | None, heads_axis: str | None, mesh: Any
) -> Any:
    """A key or value of attention, `(batch, sequence, heads, features)` or
    `(batch, sequence, features)`, laid out with its sequence split over
    `sequence_axis` (whole for None); heads stay split over `heads_axis`
    where they divide by it."""
    if not isinstance(value, tf.Tensor) or value.shape.rank not in (3, 4):
        return value
    axes = [batch_axis, sequence_axis] + [None] * (value.shape.rank - 2)
    heads = value.shape[2] if value.shape.rank == 4 else None
    if heads_axis is not None and heads is not None and heads % mesh.dim_size(heads_axis) == 0:
        axes[2] = heads_axis
    return distribute_tensor(value, tuple(axes))
