"""Activations laid out in a traced step: a layer's output by its
`LayoutMap["<layer path>/output"]` rule, else by sequence parallelism, and
an attention layer's inputs gathered whole under sequence parallelism.

Under a Keras distribution Keras' own `Layer.__call__` looks the output rule
up and calls `distribute_tensor`; for a tfmp strategy the patched
`Layer.__call__` calls `laid_out_call` instead, with the path Keras uses
(the enclosing layers' names and the layer's).
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from tfmp.forward import forward_mesh
from tfmp.integrations.internals import keras_current_path as current_path
from tfmp.strategy.keras_distribution import distribute_tensor
from tfmp.strategy.sequence_parallel import gathers_sequence, sequence_axes
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
    axis = strategy.sequence_parallel_axis
    if axis not in mesh.dim_names:  # None, or not on a pipeline stage's mesh
        axis = None
    if axis is not None and gathers_sequence(layer):
        whole = (strategy.batch_axis, None, None)
        args, kwargs = tf.nest.map_structure(
            lambda value: distribute_tensor(value, whole)
            if isinstance(value, tf.Tensor) and value.shape.rank == 3 and value.dtype.is_floating
            else value,
            (args, kwargs),
        )
    outputs = layer_call(layer, *args, **kwargs)
    path = "/".join(filter(None, (current_path(), layer.name)))
    axes = strategy.layout_map.output_axes(path)
    if axes is None and axis is not None:
        axes = sequence_axes(layer, outputs, axis, strategy.batch_axis, mesh.dim_size(axis))
        if axes is not None:
            strategy.layout_map.note_output(path, f"sequence_parallel={axis!r}", axes)
    if axes is None:
        return outputs
    return tf.nest.map_structure(
        lambda tensor: distribute_tensor(tensor, axes) if isinstance(tensor, tf.Tensor) else tensor,
        outputs,
    )
