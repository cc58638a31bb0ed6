"""Sequence parallelism (Megatron-LM's): the regions of a tensor-parallel
Transformer outside attention and the MLP run with the sequence split.

Between tensor-parallel blocks every device of the "model" axis holds the
whole `(batch, sequence, hidden)` activation: the norms, dropouts and the
residual adds they feed compute it, and keep it for the backward pass, once
per device. With `ModelParallelStrategy(..., sequence_parallel=True)` the
output of each norm and dropout layer with such an output is laid out
`(batch, "model", None)`: its sequence is split over the axis, the residual
adds follow it, and DTensor gathers the sequence where a column-parallel
layer needs it whole. Each device then holds 1/N of those activations. The
numbers stay one device's: a relayout moves values, it computes nothing.

Context parallelism (`context_parallel=True`, axis `"sequence"`) splits the
sequence through the whole model instead: the outputs of norms, dropouts
and attention layers are laid out `(batch, "sequence", None)`, and the
layers between follow them; an embedding gets its output's gradient with
the sequence whole (`gradient_whole_over_sequence`). An attention layer's inputs
are split over the axis and its keys and values gathered whole just before
the scores (`keys_and_values_whole`), as Llama 3's training gathers them, so
each device computes the scores of its queries against the whole sequence,
causal and padding masks included: 1/N of the `(sequence, sequence)` scores,
or, where attention runs `keras.ops.dot_product_attention`, a block of keys
at a time, keeping none (`tfmp.lowering.attention`). A layer that mixes
positions without a `_compute_attention(query, key, value, ...)` method
its call computes through (some KerasHub encoders' attention, XLNet's
relative attention, Qwen 3.5's linear attention, RWKV-7's time mixing), or
whose method takes positions of its own (DeBERTa-v3's relative position
embeddings: `splits_queries`), computes with its inputs whole and its
output's gradient whole, and lays its output out split again: exact,
without the memory saving.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmp.forward import BACKWARD_SCOPE

# KerasHub's own norms (LlamaLayerNorm, Gemma's RMSNormalization, ...) and
# attention layers (CachedLlamaAttention, ...) are recognized by their class
# names, as Keras' are by theirs; so are Qwen 3.5's linear attention (a
# causal convolution and a recurrence over chunks of the sequence) and
# RWKV-7's time mixing (a recurrence over time steps).
_NORM_CLASS = re.compile(r"(LayerNorm|RMSNorm)(alization)?$")
_SEQUENCE_MIXING_CLASS = re.compile(r"(Attention|GatedDeltaNet|TimeMix)$")
_EMBEDDING_CLASS = re.compile(r"Embedding$")


def is_sequence_region(layer: Any) -> bool:
    """Whether `layer` is a norm or a dropout: the layers sequence
    parallelism splits the sequence of."""
    return isinstance(layer, keras.layers.Dropout) or any(
        _NORM_CLASS.search(cls.__name__) for cls in type(layer).__mro__
    )


def is_context_region(layer: Any) -> bool:
    """Whether context parallelism splits the sequence of `layer`'s output:
    a norm, a dropout or an attention layer."""
    return is_sequence_region(layer) or gathers_sequence(layer)


def is_embedding(layer: Any) -> bool:
    """Whether `layer` looks rows up in a table (Keras' and KerasHub's
    embeddings): under context parallelism the gradient of its output must
    reach it with the sequence whole (`gradient_whole_over_sequence`)."""
    return any(_EMBEDDING_CLASS.search(cls.__name__) for cls in type(layer).__mro__)


def gradient_whole_over_sequence(outputs: tf.Tensor, whole: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """`outputs` as they are, with their gradient passed through `whole`.

    The gradient of a lookup reshapes its `(batch, sequence, features)`
    gradient into rows, one dimension that DTensor cannot split over both
    the batch and the sequence axes: its collective lowering failed ('tf.Reshape'
    op requires 'output' number of elements to match). A relayout of the
    output alone does not pin its gradient: DTensor's Relayout gradient takes
    the layout the lookup's output was propagated, which can be split.
    """

    def gradient(upstream: tf.Tensor) -> tf.Tensor:
        with tf.name_scope(BACKWARD_SCOPE):
            return whole(upstream)

    @tf.custom_gradient
    def identity(value: tf.Tensor) -> Any:
        return tf.identity(value), gradient

    return identity(outputs)


def gathers_sequence(layer: Any) -> bool:
    """Whether `layer` reads its inputs' sequence whole: an attention layer,
    a linear attention, or RWKV-7's time mixing. DTensor would otherwise
    carry the split into its heads, whose transposes it cannot move
    (KerasHub's Llama attention), into the padded and chunked sequence a
    linear attention's convolution and recurrence take, or into the time
    steps a recurrence stacks; Megatron gathers there too."""
    return any(_SEQUENCE_MIXING_CLASS.search(cls.__name__) for cls in type(layer).__mro__)


def sequence_axes(
    layer: Any, outputs: Any, axis: str, batch_axis: str | None, axis_size: int, option: str
) -> tuple | None:
    """The layout of `layer`'s output when `option` (`"sequence_parallel"` or
    `"context_parallel"`) splits sequences over `axis`: `(batch_axis, axis,
    None)` for a `(batch, sequence, features)` floating output of a layer
    that option splits; None for any other layer or output.

    Raises:
        ValueError: If the sequence does not divide by the axis.
    """
    if not isinstance(outputs, tf.Tensor) or outputs.shape.rank != 3 or not outputs.dtype.is_floating:
        return None
    splits = is_context_region if option == "context_parallel" else is_sequence_region
    if not splits(layer):
        return None
    length = outputs.shape[1]
    if length is not None and length % axis_size:
        by_auto = " (layout_map='auto' turns it on over a 'sequence' axis)" if option == "context_parallel" else ""
        raise ValueError(
            f"{option} splits the sequence of the output of layer {layer.name!r}, "
            f"shaped {tuple(outputs.shape)}, over mesh axis {axis!r} of size {axis_size}, and "
            f"{length} does not divide by {axis_size}: pad the sequences to a multiple "
            f"of {axis_size}, or turn {option} off with {option}=False{by_auto}."
        )
    return (batch_axis, axis, None)


# Parameters of an attention layer's `_compute_attention` after its query,
# key and value (Keras', KerasHub's) that carry no positions of their own.
_MASKS_AND_FLAGS = frozenset(
    {"attention_mask", "training", "cache_update_index", "start_index", "use_causal_mask",
     "return_attention_scores", "kwargs"}
)


def splits_queries(layer: Any) -> bool:
    """Whether context parallelism can split an attention layer's queries:
    its `call` computes the scores through `_compute_attention(query, key,
    value, ...)`, whose other parameters are masks and flags.

    A relative attention computes each query's scores against positions
    relative to it, by shifts and gathers over the whole sequence that
    DTensor cannot split (its `Reshape`s stop): XLNet's calls a method of its
    own, DeBERTa-v3's `_compute_attention` takes relative position
    embeddings. Such a layer computes with its inputs whole."""
    compute_attention = getattr(layer, "_compute_attention", None)
    if not callable(compute_attention):
        return False
    call = inspect.unwrap(type(layer).call)
    if "_compute_attention" not in getattr(getattr(call, "__code__", None), "co_names", ("_compute_attention",)):
        return False
    return set(list(inspect.signature(compute_attention).parameters)[3:]) <= _MASKS_AND_FLAGS


def keys_and_values_whole(
    compute_attention: Callable, whole: Callable[[tf.Tensor], tf.Tensor]
) -> Callable:
    """An attention layer's bound `_compute_attention(query, key, value, ...)`
    that first passes its key and value (by position or by name) through
    `whole`."""
    names = list(inspect.signature(compute_attention).parameters)[1:3]

    def with_whole_keys_and_values(*args: Any, **kwargs: Any) -> Any:
        args = list(args)
        for position, name in enumerate(names, start=1):
            if position < len(args):
                args[position] = whole(args[position])
            elif name in kwargs:
                kwargs[name] = whole(kwargs[name])
        return compute_attention(*args, **kwargs)

    return with_whole_keys_and_values
