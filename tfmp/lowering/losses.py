"""Losses that check their labels and read logits where they are laid out.

- **Labels outside the classes.** TensorFlow's CPU kernel of
  `SparseSoftmaxCrossEntropyWithLogits` (Keras' `sparse_categorical_crossentropy`)
  refuses a label outside `[0, classes)`. On a mesh, DTensor's expansion of
  it with the classes split (a vocabulary-parallel head) trained on such a
  label without a word, and with the batch split only the device holding it
  failed: the others' collectives were cancelled, and the step's error said
  only that. In a step on a mesh the labels are checked over the whole
  batch (every device reaches the same verdict) before any device computes
  its loss, with TensorFlow's words; which device's error the step reports
  first stays a race (`tfmp.strategy.errors.explain_cancellation`).
- **A split sequence.** The kernel's Python wrapper reshapes logits of rank
  3 or more into rows `(batch x sequence, classes)`; DTensor splits a
  dimension over one mesh axis, so under context parallelism it gathered the
  sequence of a language model's logits to make the rows: every device held
  the whole `(batch, sequence, vocabulary)` logits, the largest activation
  of a long-context model. Under context parallelism the loss is computed
  per position instead, as the kernel computes it (the log of the sum of
  the exponentials of the logits less their maximum, less the label's),
  with the kernel's gradient (softmax less one-hot): reductions over the
  classes, which DTensor lays out whatever splits the other dimensions.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.nn import _get_logits

from tfmp.lowering.registry import Lowering, keras_original
from tfmp.tracing import context

_KERAS_NN = "keras.src.backend.tensorflow.nn"


def sparse_categorical_crossentropy(target: Any, output: Any, from_logits: bool = False, axis: int = -1) -> tf.Tensor:
    """`keras.ops.sparse_categorical_crossentropy`; in a step on a mesh, with
    its labels checked, and under context parallelism, for outputs of rank 3
    or more, computed per position without reshaping positions into rows."""
    keras_loss = keras_original(_KERAS_NN, "sparse_categorical_crossentropy")
    rank = getattr(output, "shape", tf.TensorShape(None)).rank
    if tf.executing_eagerly() or not context.step_on_mesh or rank is None or axis not in (-1, rank - 1):
        return keras_loss(target, output, from_logits, axis)
    output, from_logits = _get_logits(output, from_logits, "Softmax", "sparse_categorical_crossentropy")
    target = tf.convert_to_tensor(target)
    output = tf.convert_to_tensor(output)
    if len(target.shape) == len(output.shape) and target.shape[-1] == 1:
        target = tf.squeeze(target, axis=-1)
    if len(target.shape) != len(output.shape) - 1 or not output.dtype.is_floating:
        return keras_loss(target, output, from_logits, axis)  # Keras' own error
    target = _checked_labels(tf.cast(target, "int64"), output)
    if context.step_sequence_axis is None or rank < 3:
        return keras_loss(target, output, from_logits, axis)
    if not from_logits:
        epsilon = keras.backend.epsilon()
        output = tf.math.log(tf.clip_by_value(output, epsilon, 1 - epsilon))
    return _per_position_cross_entropy(target, output)


def _checked_labels(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """`labels`, once every one of them is a class of `logits`: the step
    stops with TensorFlow's words otherwise. The labels depend on the
    verdict through their values (DTensor's expansion keeps data
    dependencies, not control ones), so no device's loss runs before it."""
    classes = logits.shape[-1] or "classes"
    in_range = tf.reduce_all((labels >= 0) & (labels < tf.shape(logits, out_type=labels.dtype)[-1]))
    verdict = tf.debugging.check_numerics(
        tf.where(in_range, tf.zeros([], logits.dtype), tf.constant(float("nan"), logits.dtype)),
        f"Received a label value outside the valid range of [0, {classes}) "
        "(a label of the batch is negative or not a class of the output)",
    )
    return labels + tf.cast(verdict, labels.dtype)


@tf.custom_gradient
def _per_position_cross_entropy(labels: tf.Tensor, logits: tf.Tensor) -> tuple[tf.Tensor, Any]:
    classes = tf.shape(logits, out_type=labels.dtype)[-1]
    shifted = logits - tf.reduce_max(logits, axis=-1, keepdims=True)
    sum_exp = tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True)
    is_label = tf.equal(tf.range(classes, dtype=labels.dtype), labels[..., None])
    picked = tf.reduce_sum(tf.where(is_label, shifted, tf.zeros([], logits.dtype)), axis=-1)
    loss = tf.math.log(sum_exp[..., 0]) - picked

    def gradient(upstream: tf.Tensor) -> tuple[None, tf.Tensor]:
        softmax_less_one_hot = tf.exp(shifted) / sum_exp - tf.cast(is_label, logits.dtype)
        return None, upstream[..., None] * softmax_less_one_hot

    return loss, gradient


LOWERINGS = (
    Lowering(
        _KERAS_NN,
        "sparse_categorical_crossentropy",
        sparse_categorical_crossentropy,
        "SparseSoftmaxCrossEntropyWithLogits with its classes split trains on labels "
        "outside them, and its reshape of positions into rows gathers a split sequence",
        outside_layers=True,
    ),
)
