"""Small replicated batch values reach a step as inputs, never as constants
DTensor bakes into it.

DTensor folds each fully replicated int32, int64 or float32 input of fewer
than 20 elements into the function it expands, as a constant, and expands
the function once more, without that constant, when a later call brings
another value (TensorFlow's `dtensor/cc/small_constant_optimization.cc` and
`ExecutableManager::ShouldFoldInput`). A last batch that does not divide the
batch axis runs replicated, and its targets (5 labels at batch 8 of 37
rows) are such a value: the second epoch laid out the partial batch's step
a second time (39 s for a 2-layer bidirectional LSTM on 2 CPU cores, against
70 ms for a step once laid out), where plain Keras traces nothing after the
first epoch. On a mesh whose batch axis has one device every batch is
replicated, so every step with fewer than 20 labels was expanded twice.

Every batch value of such a dtype with fewer than 20 elements per row (a
label, a short row of tokens or features) travels as `SmallBatchValue`, in
a dtype of the same values that DTensor never folds (the unsigned integer of
its width, float64), and the step casts it back before anything reads it
(`ModelParallelExtended.call_for_each_replica`): exact both ways. Full
batches travel so too, split or not, so that a step function sees one
structure for all its batches and Keras' relaxed trace of a partial batch
takes a partial batch of another size (evaluate after fit) as on one device.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfmp.strategy.placement import HostShards, pack

# DTensor's `kSmallTensorThreshold`: inputs with fewer elements are folded.
_FOLDED_BELOW_ELEMENTS = 20
# The dtypes DTensor folds, and the dtype each travels in instead.
_CARRIED_AS = {tf.int32: tf.uint32, tf.int64: tf.uint64, tf.float32: tf.float64}


class SmallBatchValue(tf.experimental.ExtensionType):
    """A batch value on the mesh, held in a dtype DTensor does not fold.

    Examples:
        >>> from tfmp.strategy.small_batch_values import SmallBatchValue, restored
        >>> labels = SmallBatchValue(tf.constant([3, 1], tf.uint64), "int64")
        >>> restored(labels).dtype
        tf.int64
    """

    carried: tf.Tensor
    dtype_name: str


def _may_be_folded(shards: Any) -> bool:
    """Whether a batch value (its shards) has a dtype DTensor folds and fewer
    than 20 elements per row: replicated, a batch of it may be folded, and
    every batch of it travels alike, split or not."""
    if not isinstance(shards, HostShards):
        return False
    shard = shards.shards[0]
    per_row = shard.shape[1:].num_elements() if shard.shape.rank else None
    return shard.dtype in _CARRIED_AS and per_row is not None and per_row < _FOLDED_BELOW_ELEMENTS


def packed_for_step(batch: Any) -> Any:
    """`batch` (`HostShards` from `BatchPlacer.split_batch`) packed onto the
    mesh, each value DTensor may fold carried as a `SmallBatchValue`."""

    def packed(value: Any) -> Any:
        if not _may_be_folded(value):
            return pack(value)
        # Devices that hold the same piece share one host tensor: cast it once.
        cast = {}
        for shard in value.shards:
            if id(shard) not in cast:
                cast[id(shard)] = tf.cast(shard, _CARRIED_AS[shard.dtype])
        carried = [cast[id(shard)] for shard in value.shards]
        return SmallBatchValue(HostShards(carried, value.layout).pack(), value.shards[0].dtype.name)

    return tf.nest.map_structure(packed, batch)


def restored(structure: Any) -> Any:
    """`structure` with each `SmallBatchValue` cast back to its own dtype."""
    return tf.nest.map_structure(
        lambda value: tf.cast(value.carried, value.dtype_name)
        if isinstance(value, SmallBatchValue)
        else value,
        structure,
    )


def carried_dtype(value: tf.Tensor) -> tf.DType | None:
    """The dtype `value` (an input of a function on the mesh) travels in so
    that DTensor never folds it, or None where it may travel as it is."""
    if value.dtype in _CARRIED_AS and value.shape.num_elements() < _FOLDED_BELOW_ELEMENTS:
        return _CARRIED_AS[value.dtype]
    return None
