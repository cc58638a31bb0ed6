"""`steps_per_execution=k` on a mesh: k training steps per host round trip.

Keras runs a dataset it cannot iterate in a `tf.while_loop` (tfmp's batches
are read on the host and placed on the mesh one step ahead) as k calls of its
one-step function. On a mesh each call costs DTensor a dispatch to every
device and a wait for the step's outputs; tfmp instead reads k placed batches
and runs their k steps in one function, traced with the steps one after the
other, so each step reads the variables the step before wrote: the same
updates, in the same order, as k calls.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf
from keras.src.backend.tensorflow.trainer import reduce_per_replica

from tfmp.strategy.extended import extended_of


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

    @tf.autograph.experimental.do_not_convert
    def steps_on_batches(batches):
        for data in batches:
            outputs = strategy.run(step_function, args=(data,))
            outputs = reduce_per_replica(outputs, strategy, reduction="auto")
        return outputs

    compiled = tf.function(
        steps_on_batches, reduce_retracing=True, jit_compile=model.jit_compile
    )

    def function(iterator):
        batches = _read(iterator, model.steps_per_execution)
        return compiled(tuple(batches))

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
