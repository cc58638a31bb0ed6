"""Summaries of mesh values, written in the order the program writes them.

DTensor runs eager ops on a mesh asynchronously, and a summary writer made
the usual way (`tf.summary.create_file_writer(logdir)`, as Keras'
TensorBoard callback and Orbit make theirs) lives on the host. A
`tf.summary.scalar` of a loss on the mesh is then queued behind the step,
while the writer's flush and its deletion run at once on the host: a
writer dropped at the end of a run was gone before the queued write ran
("Resource .../SummaryWriterInterface does not exist", which then poisons
every later op of the program). The written value is fetched to the host
first, so the write runs on the host in the program's order.

A histogram, an image or an audio clip is computed from its data on the
host too (TensorBoard mixes the data with host tensors, which DTensor
refuses: Keras' `TensorBoard(histogram_freq=1)` stopped at its first epoch's
end), from the value fetched once a writer would record it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.strategy.placement import to_host


def written_from_host(write_summary: Callable) -> Callable:
    """TensorFlow's summary-writing op, with a mesh step or value fetched to
    the host where the writer lives there."""

    @functools.wraps(write_summary)
    def wrapper(writer: Any, step: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if tf.executing_eagerly() and not dtensor.is_dtensor(writer):
            step, tensor = _on_host(step), _on_host(tensor)
        return write_summary(writer, step, tensor, *args, **kwargs)

    return wrapper


def computed_from_host(summary: Callable) -> Callable:
    """`tf.summary.histogram`, `image` or `audio`, computed from data on a
    mesh fetched to the host."""

    @functools.wraps(summary)
    def wrapper(name: str, data: Any, *args: Any, **kwargs: Any) -> Any:
        if tf.executing_eagerly() and bool(tf.summary.should_record_summaries()):
            data = _on_host(data)
        return summary(name, data, *args, **kwargs)

    return wrapper


def _on_host(value: Any) -> Any:
    if isinstance(value, (tf.Variable, keras.Variable)):
        value = tf.convert_to_tensor(value)
    return to_host(value) if isinstance(value, tf.Tensor) else value
