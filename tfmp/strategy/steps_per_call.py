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

from tfmp.integrations.internals import reduce_per_replica
from tfmp.strategy.extended import extended_of
from tfmp.strategy import stacked_batches


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
        stacked = stacked_batches.stack(list(rest))
        outputs = step(first)

        def body(index, outputs):
            del outputs
            return index + 1, step(stacked_batches.batch_at(stacked, index))

        _, outputs = tf.while_loop(
            lambda index, _: index < len(rest), body, (tf.constant(0), outputs)
        )
        return outputs

    compiled_batches = tf.function(steps_on_batches, reduce_retracing=True, jit_compile=model.jit_compile)
    compiled_loop = tf.function(steps_in_a_loop, reduce_retracing=True, jit_compile=model.jit_compile)

    def function(iterator):
        batches = _read(iterator, model.steps_per_execution)
        if len(batches) == model.steps_per_execution and stacked_batches.same_layouts(batches):
            return compiled_loop(batches[0], tuple(batches[1:]))
        # The last call of an epoch, or batches of other shapes (a partial
        # last batch): one traced copy per batch.
        return compiled_batches(tuple(batches))

    return function


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
