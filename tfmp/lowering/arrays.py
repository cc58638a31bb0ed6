"""Triangles, sorts, transposes and products written with ops DTensor lays out.

- `tril`/`triu` are `MatrixBandPart`, which DTensor has no layout rule for
  ("'tf.MatrixBandPart' op does not implement layout propagation"): a causal
  mask built from a tensor. Run replicated (`tfmp.lowering.replicated`), it
  gathers its input; on a mesh tfmp keeps the entries where `column - row`
  lies in the band, selected elementwise: no communication, and faster
  (`bench/generic_path.py`).
- `sort` and `argsort` run `TopKV2`, whose outputs DTensor refuses split
  on the sorted dimension ("The last dimensions of TopKV2Op outputs should
  be UNSHARDED"), which layout propagation asks for when a split tensor is
  sorted along its split dimension; its gradient scatters by global
  positions into a split input. On a mesh the order is read whole along the
  sorted dimension, and `sort` takes the values in that order
  (`take_along_axis`, whose gradient DTensor lays out).
- DTensor's `Transpose` requires its result laid out as its input,
  permuted, and refuses anything else ("TransposeOp SPMD needs communication
  is not supported yet"): CLIP's (batch, batch) logits, split on rows,
  transposed, then asked for split on rows again. On a mesh a transpose of
  a float tensor is a one-operand einsum, which DTensor relayouts as its
  consumers ask (no communication where the layouts already agree).
- Keras' `matmul` of a `(batch, sequence, ..., features)` tensor and a
  kernel (every `Dense` on a sequence) is `tf.tensordot`, which reshapes the
  leading dimensions into rows; DTensor gathers a sequence split over a mesh
  axis to do so, and under context parallelism each device computed its MLP
  over the whole sequence (`bench/long_context.py`, 64 tokens: 2.5 MB of
  forward activations per device, 1.0 MB without that gather). Under
  context parallelism it is a `MatMul` that broadcasts the kernel over the
  leading dimensions, which keeps them as they are laid out. (An einsum
  does too, but everywhere on a mesh it made the demo LM under sequence
  parallelism stop: DTensor's RelayoutLike "output layout ... does not
  match".)
- Keras' `einsum` rewrites the subscripts it knows into transposes and
  reshapes around a matmul. Those of grouped heads' 5-D scores (Gemma's
  own attention: `(batch, key heads, groups, queries, keys)`) merge the
  groups with the queries, which context parallelism splits, and DTensor's
  transposes around that asked for another split than their input's,
  permuted (with dropout on the scores). Under context parallelism an
  einsum of floating operands, one of rank 5 or more, is TensorFlow's
  `Einsum` op itself, which DTensor lays out as its consumers ask. Not for
  every einsum: the `Einsum` kernel sums in another order than Keras'
  matmul, and T5 and T5Gemma, whose 4-D rewrites DTensor lays out, then
  ended 4 Adam steps 1.2e-5 and 3.8e-5 from one device (within the float64
  yardstick, but outside 1e-5 where they had been within it).
"""

from __future__ import annotations

import string
from typing import Any

import tensorflow as tf
from keras.src.backend.tensorflow.core import convert_to_tensor

from tfmp.lowering.joins import read_whole_along
from tfmp.lowering.registry import Lowering, keras_original
from tfmp.tracing import context

_KERAS_NUMPY = "keras.src.backend.tensorflow.numpy"


def tril(x: Any, k: Any = 0) -> tf.Tensor:
    """`keras.ops.tril`: the entries on and below the `k`-th diagonal."""
    x = convert_to_tensor(x)
    return tf.where(_diagonal_offsets(x) <= tf.cast(k, "int32"), x, tf.zeros([], x.dtype))


def triu(x: Any, k: Any = 0) -> tf.Tensor:
    """`keras.ops.triu`: the entries on and above the `k`-th diagonal."""
    x = convert_to_tensor(x)
    return tf.where(_diagonal_offsets(x) >= tf.cast(k, "int32"), x, tf.zeros([], x.dtype))


def _diagonal_offsets(x: tf.Tensor) -> tf.Tensor:
    """`column - row` of each entry of `x`'s last two dimensions."""
    return tf.range(_length(x, -1))[None, :] - tf.range(_length(x, -2))[:, None]


def _length(x: tf.Tensor, dim: int) -> Any:
    """`x`'s length along `dim`: static where known, else read in the step."""
    return x.shape[dim] if x.shape[dim] is not None else tf.shape(x)[dim]


def argsort(x: Any, axis: int | None = -1) -> tf.Tensor:
    """`keras.ops.argsort`, its result whole along the sorted dimension."""
    order = keras_original(_KERAS_NUMPY, "argsort")(x, axis)
    if order.shape.rank in (None, 0):
        return order
    return read_whole_along(order, -1 if axis is None else axis % order.shape.rank)


def sort(x: Any, axis: int | None = -1) -> tf.Tensor:
    """`keras.ops.sort`: `x` taken in the order `argsort` gives."""
    x = convert_to_tensor(x)
    if axis is None:
        x, axis = tf.reshape(x, [-1]), 0
    if x.dtype == tf.bool or x.shape.rank in (None, 0):
        return keras_original(_KERAS_NUMPY, "sort")(x, axis)
    order = argsort(tf.stop_gradient(x), axis)
    return keras_original(_KERAS_NUMPY, "take_along_axis")(x, order, axis)


def transpose(x: Any, axes: Any = None) -> tf.Tensor:
    """`keras.ops.transpose` of a float tensor as an einsum; other tensors
    (integers, booleans, sparse) Keras' own."""
    original = keras_original(_KERAS_NUMPY, "transpose")
    if isinstance(x, tf.SparseTensor):
        return original(x, axes)
    x = convert_to_tensor(x)
    rank = x.shape.rank
    dtype = tf.as_dtype(x.dtype)
    if rank is None or rank > len(string.ascii_lowercase) or not (dtype.is_floating or dtype.is_complex):
        return original(x, axes)
    order = list(reversed(range(rank))) if axes is None else [int(axis) % rank for axis in axes]
    if sorted(order) != list(range(rank)):
        return original(x, axes)  # Keras' error for a bad permutation
    letters = string.ascii_lowercase[:rank]
    return tf.einsum(f"{letters}->{''.join(letters[axis] for axis in order)}", x)


def matmul(x1: Any, x2: Any) -> tf.Tensor:
    """`keras.ops.matmul`; under context parallelism a floating tensor of
    rank 3 or more times a matrix of its dtype as a matmul that broadcasts
    the matrix over the leading dimensions."""
    x1, x2 = convert_to_tensor(x1), convert_to_tensor(x2)
    rank = x1.shape.rank
    if (
        context.sequences_split_by != "context_parallel"
        or isinstance(x1, tf.SparseTensor)
        or isinstance(x2, tf.SparseTensor)
        or rank is None
        or rank < 3
        or x2.shape.rank != 2
        or not x1.dtype.is_floating
        or x1.dtype != x2.dtype
    ):
        return keras_original(_KERAS_NUMPY, "matmul")(x1, x2)
    return tf.linalg.matmul(x1, x2)


def einsum(subscripts: str, *operands: Any, **kwargs: Any) -> tf.Tensor:
    """`keras.ops.einsum`; under context parallelism, of floating operands
    of one dtype, one of rank 5 or more, TensorFlow's `Einsum` op itself."""
    operands = [convert_to_tensor(operand) for operand in operands]
    if (
        context.sequences_split_by != "context_parallel"
        or kwargs
        or len({operand.dtype for operand in operands}) != 1
        or not operands[0].dtype.is_floating
        or max(operand.shape.rank or 0 for operand in operands) < 5
    ):
        return keras_original(_KERAS_NUMPY, "einsum")(subscripts, *operands, **kwargs)
    return tf.einsum(subscripts, *operands)


LOWERINGS = (
    Lowering(
        _KERAS_NUMPY,
        "tril",
        tril,
        "MatrixBandPart has no layout rule; replicated, it gathers its input and was "
        "slower (bench/generic_path.py)",
    ),
    Lowering(
        _KERAS_NUMPY,
        "triu",
        triu,
        "MatrixBandPart has no layout rule; replicated, it gathers its input and was "
        "slower (bench/generic_path.py)",
    ),
    Lowering(
        _KERAS_NUMPY,
        "transpose",
        transpose,
        "Transpose refuses a result laid out other than its input, permuted",
    ),
    Lowering(
        _KERAS_NUMPY,
        "argsort",
        argsort,
        "TopKV2 refuses outputs split on the sorted dimension",
    ),
    Lowering(
        _KERAS_NUMPY,
        "sort",
        sort,
        "TopKV2 refuses outputs split on the sorted dimension; its gradient "
        "scatters by global positions",
    ),
    Lowering(
        _KERAS_NUMPY,
        "matmul",
        matmul,
        "tensordot reshapes the leading dimensions into rows, for which DTensor "
        "gathers a sequence that context parallelism splits",
    ),
    Lowering(
        _KERAS_NUMPY,
        "einsum",
        einsum,
        "Keras rewrites 5-D einsums into transposes and reshapes that merge a split sequence "
        "with another dimension; Transpose refuses a result laid out other than its input, "
        "permuted",
    ),
)
