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
"""

from __future__ import annotations

import re
from typing import Any

import keras
import tensorflow as tf

# KerasHub's own norms (LlamaLayerNorm, Gemma's RMSNormalization, ...) and
# attention layers (CachedLlamaAttention, ...) are recognized by their class
# names, as Keras' are by theirs.
_NORM_CLASS = re.compile(r"(LayerNorm|RMSNorm)(alization)?$")
_ATTENTION_CLASS = re.compile(r"Attention$")


def is_sequence_region(layer: Any) -> bool:
    """Whether `layer` is a norm or a dropout: the layers sequence
    parallelism splits the sequence of."""
    return isinstance(layer, keras.layers.Dropout) or any(
        _NORM_CLASS.search(cls.__name__) for cls in type(layer).__mro__
    )


def gathers_sequence(layer: Any) -> bool:
    """Whether `layer` reads its inputs' sequence whole: an attention layer.
    DTensor would otherwise carry the split into its heads, whose transposes
    it cannot move (KerasHub's Llama attention); Megatron gathers there too."""
    return any(_ATTENTION_CLASS.search(cls.__name__) for cls in type(layer).__mro__)


def sequence_axes(layer: Any, outputs: Any, axis: str, batch_axis: str | None, axis_size: int) -> tuple | None:
    """The layout of `layer`'s output under sequence parallelism over `axis`:
    `(batch_axis, axis, None)` for a norm's or dropout's `(batch, sequence,
    features)` output; None for any other layer or output.

    Raises:
        ValueError: If the sequence does not divide by the axis.
    """
    if not is_sequence_region(layer) or not isinstance(outputs, tf.Tensor) or outputs.shape.rank != 3:
        return None
    length = outputs.shape[1]
    if length is not None and length % axis_size:
        raise ValueError(
            f"sequence_parallel splits the sequence of the output of layer {layer.name!r}, "
            f"shaped {tuple(outputs.shape)}, over mesh axis {axis!r} of size {axis_size}, and "
            f"{length} does not divide by {axis_size}: pad the sequences to a multiple "
            f"of {axis_size}, or turn sequence_parallel off."
        )
    return (batch_axis, axis, None)
