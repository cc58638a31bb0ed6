"""Functions run without Grappler while a strategy exists: Grappler rewrites a
mesh function's per-device graphs with the shapes of whole variables.

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
all of Grappler stays off.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from tfmp.integrations.internals import eager_context


def without_grappler(function_call_options: property) -> property:
    """TensorFlow's `Context.function_call_options`, the options each
    `tf.function` call runs with, with Grappler's meta-optimizer disabled."""
    variants: dict[tuple[Any, bytes], eager_context.FunctionCallOptions] = {}

    @functools.wraps(function_call_options.fget)
    def options_without_grappler(context: Any) -> eager_context.FunctionCallOptions:
        options = function_call_options.fget(context)
        key = (options.executor_type, options.config_proto_serialized)
        variant = variants.get(key)
        if variant is None:
            config = tf.compat.v1.ConfigProto.FromString(options.config_proto_serialized)
            config.graph_options.rewrite_options.disable_meta_optimizer = True
            variant = variants[key] = eager_context.FunctionCallOptions(options.executor_type, config)
        return variant

    return property(options_without_grappler, function_call_options.fset)
