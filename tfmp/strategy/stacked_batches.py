"""Batches of one shape and layout, stacked so that one traced step runs them
all in a `tf.while_loop`.

Used where several batches reach one function call: `steps_per_execution`
(`tfmp.strategy.steps_per_call`) and a compiled epoch over a distributed
dataset (`MeshDataset.reduce`). A loop traces its step once, where a step per
batch would trace, lay out and instantiate one copy each; within a call a
collective run again by the loop also reuses TensorFlow's record of it
(docs/performance.md, host memory).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.strategy.small_batch_values import SmallBatchValue


def stack(batches: list[Any]) -> Any:
    """The batches, each value stacked with its twins on a new first
    dimension (traced: DTensor keeps each value's layout below it)."""
    return tf.nest.map_structure(_stacked, *batches)


def batch_at(stacked: Any, index: tf.Tensor) -> Any:
    """Batch `index` of `stack`'s result."""
    return tf.nest.map_structure(lambda leaves: _at(leaves, index), stacked)


def _stacked(*leaves: Any) -> Any:
    if leaves[0] is None:
        return None
    if isinstance(leaves[0], SmallBatchValue):
        return SmallBatchValue(tf.stack([leaf.carried for leaf in leaves]), leaves[0].dtype_name)
    return tf.stack(leaves)


def _at(leaves: Any, index: tf.Tensor) -> Any:
    if leaves is None:
        return None
    if isinstance(leaves, SmallBatchValue):
        return SmallBatchValue(tf.gather(leaves.carried, index), leaves.dtype_name)
    return tf.gather(leaves, index)


def _signature(batch: Any) -> list[Any]:
    """What one traced step must share with a batch to run it: each value's
    shape, dtype and layout (eager batches on the mesh)."""

    def described(leaf):
        if isinstance(leaf, SmallBatchValue):
            return (leaf.dtype_name, *described(leaf.carried))
        if isinstance(leaf, tf.Tensor):
            return (leaf.shape, leaf.dtype, dtensor.fetch_layout(leaf) if dtensor.is_dtensor(leaf) else None)
        return leaf

    return [described(leaf) for leaf in tf.nest.flatten(batch)]


def same_layouts(batches: list[Any]) -> bool:
    """Whether every batch has the first one's structure, shapes, dtypes and
    layouts (so that one traced step runs them all)."""
    try:
        for batch in batches[1:]:
            tf.nest.assert_same_structure(batches[0], batch)
    except (TypeError, ValueError):
        return False
    want = _signature(batches[0])
    return all(_signature(batch) == want for batch in batches[1:])


def runs(batches: list[Any]) -> list[tuple[int, int]]:
    """`(start, count)` of each run of consecutive batches that one traced
    step can run (`same_layouts`), in order."""
    found: list[tuple[int, int]] = []
    for index, batch in enumerate(batches):
        if found and same_layouts([batches[found[-1][0]], batch]):
            start, count = found[-1]
            found[-1] = (start, count + 1)
        else:
            found.append((index, 1))
    return found
