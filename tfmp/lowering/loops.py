"""Loops of a length known when traced, unrolled.

Keras' TensorFlow backend runs `fori_loop`, `scan` and `map` as a
`tf.while_loop` over TensorArrays. DTensor lays out neither the TensorList
ops of those arrays nor the ones while_v2's gradient adds to keep each
iteration's values ("'tf.EmptyTensorList' op does not implement layout
propagation"), so a model with such a loop trains on one device and stops
on a mesh. On a mesh, a loop whose trip count is a Python number (a
`fori_loop` with Python bounds, a `scan` or `map` over a dimension of known
length) runs as a Python loop: the same ops once per iteration, which DTensor
lays out, with the same results (the graph grows with the trip count). A
`map` over a dimension known only in the step (the batch) runs as
`vectorized_map`: the function applied to all elements at once. Other loops
are Keras' own.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow.core import convert_to_tensor

from tfmp.lowering.registry import Lowering, keras_original

_KERAS_CORE = "keras.src.backend.tensorflow.core"


def fori_loop(lower: Any, upper: Any, body_fun: Callable, init_val: Any) -> Any:
    """`keras.ops.fori_loop`, unrolled when both bounds are known when traced."""
    bounds = [tf.get_static_value(bound) for bound in (lower, upper)]
    if None in bounds:
        return keras_original(_KERAS_CORE, "fori_loop")(lower, upper, body_fun, init_val)
    value = init_val
    for index in range(int(bounds[0]), int(bounds[1])):
        value = body_fun(tf.constant(index, "int32"), value)
    return value


def scan(
    f: Callable, init: Any, xs: Any = None, length: int | None = None, reverse: bool = False, unroll: Any = 1
) -> tuple[Any, Any]:
    """`keras.ops.scan`, unrolled over a leading dimension of known length.

    Returns what `jax.lax.scan` returns: the last carry, and the outputs
    stacked in the order of `xs` (also with `reverse=True`)."""
    if xs is not None:
        xs = tree.map_structure(convert_to_tensor, xs)
    steps = _leading_length(xs, length)
    if steps is None:
        return keras_original(_KERAS_CORE, "scan")(f, init, xs, length, reverse, unroll)
    carry, outputs = init, [None] * steps
    for step in reversed(range(steps)) if reverse else range(steps):
        element = None if xs is None else tree.map_structure(lambda x: x[step], xs)
        carry, outputs[step] = f(carry, element)
    return carry, _stacked(outputs)


def map(f: Callable, xs: Any) -> Any:  # noqa: A001 (Keras' name)
    """`keras.ops.map`: a Python loop over a leading dimension of known
    length, else `vectorized_map`."""
    xs = tree.map_structure(convert_to_tensor, xs)
    steps = _leading_length(xs, None)
    if steps is None:
        return tf.vectorized_map(f, xs, fallback_to_while_loop=False)
    return _stacked([f(tree.map_structure(lambda x: x[step], xs)) for step in range(steps)])


def _leading_length(xs: Any, length: int | None) -> int | None:
    """The trip count over `xs`'s leading dimension (or `length`), if known."""
    if xs is None:
        return None if length is None else int(length)
    lengths = {x.shape[0] if x.shape.rank else None for x in tree.flatten(xs)}
    if len(lengths) != 1 or None in lengths:
        return None
    (steps,) = lengths
    return steps if length is None or length == steps else None


def _stacked(outputs: list[Any]) -> Any:
    """Per-iteration outputs (each a structure, or None) stacked leaf by leaf."""
    if not outputs or outputs[0] is None:
        return None
    return tree.map_structure(lambda *leaves: tf.stack(leaves), *outputs)


_TENSOR_LISTS = "tf.while_loop over TensorArrays: TensorList ops have no DTensor layout propagation"

LOWERINGS = (
    Lowering(_KERAS_CORE, "fori_loop", fori_loop, _TENSOR_LISTS),
    Lowering(_KERAS_CORE, "scan", scan, _TENSOR_LISTS),
    Lowering(_KERAS_CORE, "map", map, _TENSOR_LISTS),
)
