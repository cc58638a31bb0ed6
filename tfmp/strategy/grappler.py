"""Functions run on a mesh without Grappler: Grappler rewrites each device's
graph with the shapes of whole variables.

DTensor hands each device's graph the variables' shards, but leaves on each
resource argument the shape of the whole variable (`_handle_shapes` [3, 4]
beside `_assigned_resource_local_shape` [3, 1] for a kernel split in 4).
Grappler infers shapes from it and rewrites the graph by them: it folded
`zeros_like(x @ kernel)` into a constant of the whole width, so
`where(mask, x @ kernel, zeros_like(...))` came out 4 columns wide where its
layout says 1 (a masked SimpleRNN's unrolled step, a last batch of one row):
later ops failed ('Matrix size-incompatible: In[0]: [1,4], In[1]: [1,2]',
'Fusion is not implemented: [BiasAdd,Add]'), or, where they broadcast, would
have computed with the wrong values. Every Grappler pass that reads inferred
shapes can do the same (constant folding, arithmetic, remapping, layout), so
all of Grappler stays off for a call whose inputs live on a mesh. Functions
on one device keep it: their numbers stay those of a process without tfmp.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.integrations.internals import eager_context

_variants: dict[tuple[Any, bytes], Any] = {}


def mesh_calls_without_grappler(call_flat: Callable) -> Callable:
    """TensorFlow's `AtomicFunction.call_flat`, which runs a traced function
    eagerly: with Grappler's meta-optimizer disabled when its first or last
    input (the captured variables come last) is on DTensor's device."""

    @functools.wraps(call_flat)
    def wrapper(self, *args):
        if not args or not (_on_mesh(args[0]) or _on_mesh(args[-1])):
            return call_flat(self, *args)
        context = eager_context.context()
        options = context.function_call_options
        context.function_call_options = _without_grappler(options)
        try:
            return call_flat(self, *args)
        finally:
            context.function_call_options = options

    return wrapper


def _on_mesh(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and tf.executing_eagerly() and value.device == dtensor.device_name()


def _without_grappler(options: Any) -> Any:
    key = (options.executor_type, options.config_proto_serialized)
    variant = _variants.get(key)
    if variant is None:
        config = tf.compat.v1.ConfigProto.FromString(options.config_proto_serialized)
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        variant = _variants[key] = eager_context.FunctionCallOptions(options.executor_type, config)
    return variant
