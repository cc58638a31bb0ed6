"""Custom gradients that live as long as the graph they were traced in.

In a traced function `tf.custom_gradient` registers the gradient function
in TensorFlow's global gradient registry, under a name of its own, and
never takes it out. That function closes over the traced tensors, so the
registry holds every graph that used a custom gradient for the life of the
process: a model's train, test and predict steps stayed alive after the
model was gone. tfmp's lowerings and layouts trace custom gradients into
every step on a mesh, so each model trained kept its steps' graphs: a
notebook that builds models in a loop grew with each, and the test
suite's workers reached 13 GB (under 5 GB once the graphs went with their
models).

`released_with_graph` leaves the registry a weak reference to the function,
hands the graph the strong one, and takes the entry out when the graph
goes: the gradient is there for as long as anything can differentiate the
graph, and no longer.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import tensorflow as tf

from tfmp.integrations.internals import tf_ops


def released_with_graph(graph_mode_decorator: Callable) -> Callable:
    """TensorFlow's `_graph_mode_decorator(f, args, kwargs)` (the traced
    path of `tf.custom_gradient`), with its registered gradient function
    held by the graph of its outputs instead of the global registry."""

    @functools.wraps(graph_mode_decorator)
    def decorated(f: Callable, args: Any, kwargs: Any) -> Any:
        result = graph_mode_decorator(f, args, kwargs)
        for tensor in tf.nest.flatten(result, expand_composites=True):
            op = getattr(tensor, "op", None)
            if op is not None and op.type == "IdentityN":
                try:
                    name = op.get_attr("_gradient_op_type").decode()
                except ValueError:  # not a custom gradient's IdentityN
                    continue
                _hold_by_graph(name, op.graph)
                break
        return result

    return decorated


def _hold_by_graph(name: str, graph: Any) -> None:
    entries = tf_ops._gradient_registry._registry
    entry = entries.get(name)
    if entry is None:
        return
    function = entry["type"]
    held = getattr(graph, "_tfmp_custom_gradients", None)
    if held is None:
        held = []
        setattr(graph, "_tfmp_custom_gradients", held)
    held.append(function)
    reference = weakref.ref(function)

    def registered(op: Any, *gradients: Any) -> Any:
        return reference()(op, *gradients)

    entry["type"] = registered
    weakref.finalize(graph, entries.pop, name, None)
