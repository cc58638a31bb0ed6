"""`steps_per_execution=k` on a mesh: k training steps per host round trip.

Keras runs a dataset it cannot iterate in a `tf.while_loop` (tfmp's batches
are read on the host and placed on the mesh one step ahead) as k calls of its
one-step function. On a mesh each call costs DTensor a dispatch to every
device and a wait for the step's outputs; tfmp instead reads k placed batches
and runs their k steps in one function, in order, so each step reads the
variables the step before wrote: the same updates, in the same order, as k
calls. When the k batches have the same shapes and layouts, the function
runs the first step, then the other k-1 in a `tf.while_loop` over the
stacked batches: two traced copies of the step instead of k, and, since
TensorFlow keeps a record per collective copy and call, fewer records per
step (docs/performance.md, host memory). Otherwise (the last call of an
epoch, a partial last batch) the k steps are traced one after the other.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor
from keras.src.backend.tensorflow.trainer import reduce_per_replica

from tfmp.strategy.extended import extended_of
from tfmp.strategy.small_batch_values import SmallBatchValue


def steps_per_call(make_function: Callable) -> Callable:
    """Wraps Keras' `TensorFlowTrainer._make_function` so that a model of a
    tfmp strategy runs `steps_per_execution` steps per function call."""

    @functools.wraps(make_function)
    def wrapper(self, step_function):
        if (
            extended_of(self.distribute_strategy) is None
            or self.run_eagerly
            or self.steps_per_execution == 1
        ):
            return make_function(self, step_function)
        return _multi_step_function(self, step_function)

    return wrapper


def _multi_step_function(model: Any, step_function: Callable) -> Callable:
    strategy = model.distribute_strategy

    def step(data):
        outputs = strategy.run(step_function, args=(data,))
        return reduce_per_replica(outputs, strategy, reduction="auto")

    @tf.autograph.experimental.do_not_convert
    def steps_on_batches(batches):
        for data in batches:
            outputs = step(data)
        return outputs

    @tf.autograph.experimental.do_not_convert
    def steps_in_a_loop(first, rest):
        # One copy of the step for all the batches after the first: within a
        # call a collective run again by the loop reuses TensorFlow's record
        # of it, where k traced copies would keep k (docs/performance.md).
        stacked = tf.nest.map_structure(_stacked, *rest)
        outputs = step(first)

        def body(index, outputs):
            del outputs
            return index + 1, step(tf.nest.map_structure(lambda leaves: _at(leaves, index), stacked))

        _, outputs = tf.while_loop(
            lambda index, _: index < len(rest), body, (tf.constant(0), outputs)
        )
        return outputs

    compiled_batches = tf.function(steps_on_batches, reduce_retracing=True, jit_compile=model.jit_compile)
    compiled_loop = tf.function(steps_in_a_loop, reduce_retracing=True, jit_compile=model.jit_compile)

    def function(iterator):
        batches = _read(iterator, model.steps_per_execution)
        if len(batches) == model.steps_per_execution and _same_layouts(batches):
            return compiled_loop(batches[0], tuple(batches[1:]))
        # The last call of an epoch, or batches of other shapes (a partial
        # last batch): one traced copy per batch.
        return compiled_batches(tuple(batches))

    return function


def _stacked(*leaves: Any) -> Any:
    """The same value of each batch, stacked on a new first dimension."""
    if leaves[0] is None:
        return None
    if isinstance(leaves[0], SmallBatchValue):
        return SmallBatchValue(tf.stack([leaf.carried for leaf in leaves]), leaves[0].dtype_name)
    return tf.stack(leaves)


def _at(leaves: Any, index: tf.Tensor) -> Any:
    """One batch's value out of `_stacked`'s."""
    if leaves is None:
        return None
    if isinstance(leaves, SmallBatchValue):
        return SmallBatchValue(tf.gather(leaves.carried, index), leaves.dtype_name)
    return tf.gather(leaves, index)


def _same_layouts(batches: list[Any]) -> bool:
    """Whether every batch has the first one's structure, shapes, dtypes and
    layouts (so that one traced step runs them all)."""
    def described(leaf):
        if isinstance(leaf, SmallBatchValue):
            return (leaf.dtype_name, *described(leaf.carried))
        if isinstance(leaf, tf.Tensor):
            return (leaf.shape, leaf.dtype, dtensor.fetch_layout(leaf) if dtensor.is_dtensor(leaf) else None)
        return leaf

    def signature(batch):
        return [described(leaf) for leaf in tf.nest.flatten(batch)]

    try:
        for batch in batches[1:]:
            tf.nest.assert_same_structure(batches[0], batch)
    except (TypeError, ValueError):
        return False
    want = signature(batches[0])
    return all(signature(batch) == want for batch in batches[1:])


def _read(iterator: Any, count: int) -> list[Any]:
    """Up to `count` batches; what the iterator raised at its end is raised
    again only if no batch came (the steps of the batches read must run, as
    they would one call each; the iterator raises again when asked next)."""
    batches = []
    try:
        for _ in range(count):
            batches.append(next(iterator))
    except (StopIteration, tf.errors.OutOfRangeError):
        if not batches:
            raise
    return batches
