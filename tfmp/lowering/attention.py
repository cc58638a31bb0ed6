"""Attention a block of keys at a time under context parallelism.

Keras' `dot_product_attention` on TensorFlow computes each query's scores
against every key, `(batch, heads, queries, keys)`, and the backward pass
keeps them and their softmax. Under context parallelism the queries are
split over the sequence axis and the keys and values gathered whole, so each
device kept `queries / N x keys` scores per layer: the largest activation of
a long sequence, growing with its square. Under context parallelism tfmp
computes it as flash attention does:

- the keys and values in blocks: each device's part of the sequence, as a
  ring would pass them, halved while a block's scores exceed
  `SCORES_PER_BLOCK` per batch row and head (512 queries x 512 keys), down
  to `MIN_KEYS_PER_BLOCK` keys;
- per query a running maximum of the scores and a running sum of their
  exponentials (the online softmax), the output rescaled as the maximum
  grows;
- the backward pass keeps only the queries, the keys and values as each
  device holds its part of them (it gathers them again), the output and
  each query's maximum and sum, and computes each block's scores and causal
  mask again.

Every score of a query is one device's `query . key * scale`, masked by the
same causal and padding masks with Keras' large negative number, so a fully
masked query attends to every key evenly as Keras' softmax makes it; the
sums run in another order, so outputs differ from Keras' in the last bits.
Scores, softmax and the weighted sum run in float32 (Keras' softmax does;
its sum runs in the inputs' dtype), and the output is cast back.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.core import convert_to_tensor
from keras.src.backend.tensorflow.nn import _get_large_negative

from tfmp.forward import BACKWARD_SCOPE, forward_mesh, forward_on
from tfmp.lowering.registry import Lowering, keras_original
from tfmp.tracing import context

_KERAS_NN = "keras.src.backend.tensorflow.nn"

# A block's scores, `(batch, heads, queries on a device, keys in the
# block)`, are the largest value the layer computes: the blocks narrow until
# each batch row and head holds at most this many scores (512 queries x 512
# keys), so that value stays the same size at any length, as flash
# attention's tiles do...
SCORES_PER_BLOCK = 512 * 512
# ... but no narrower than this many keys: the blocks are unrolled in the
# graph, twice (forward and backward), and a narrower block is more ops for
# less work each.
MIN_KEYS_PER_BLOCK = 128


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    scale: Any = None,
    is_causal: bool = False,
    flash_attention: Any = None,
    attn_logits_soft_cap: Any = None,
) -> tf.Tensor:
    """`keras.ops.dot_product_attention`; under context parallelism a block
    of keys at a time, keeping no scores for the backward pass, unless flash
    attention is off (`keras.config.disable_flash_attention()`, or a
    layer's `flash_attention=False`): Keras' own is faster where its scores
    fit."""
    blocks = _key_blocks(query, key, value)
    if not blocks or bias is not None or flash_attention is False or attn_logits_soft_cap is not None:
        return keras_original(_KERAS_NN, "dot_product_attention")(
            query, key, value, bias, mask, scale, is_causal, flash_attention, attn_logits_soft_cap
        )
    dtype = keras.backend.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (tf.cast(convert_to_tensor(t), dtype) for t in (query, key, value))
    groups = query.shape[2] // key.shape[2]
    if groups > 1:
        key = tf.repeat(key, repeats=groups, axis=2)
        value = tf.repeat(value, repeats=groups, axis=2)
    if scale is None:
        scale = 1.0 / tf.sqrt(tf.cast(tf.shape(key)[-1], "float32"))
    if mask is not None:
        mask = tf.cast(convert_to_tensor(mask), "bool")
    return _blockwise_attention(query, key, value, mask, scale, is_causal, blocks)


def _split_before_gather(tensor: tf.Tensor, query: tf.Tensor) -> tuple[tf.Tensor, Callable | None]:
    """`(split, gather)`: the tensor context parallelism gathered whole
    into `tensor` and the gather, where the backward pass can gather it
    again (`_after` needs the query's batch, length and heads); else
    `(tensor, None)`."""
    split, gather = context.sequence_gathers.get(tensor.ref(), (tensor, None))
    if gather is None or split.shape[:3] != query.shape[:3]:
        return tensor, None
    return split, gather


def _after(tensor: tf.Tensor, upstream: tf.Tensor) -> tf.Tensor:
    """`tensor` (B, S, N, H), once `upstream` (B, S, N, H') is computed.

    DTensor's expansion keeps data dependencies, not control ones, and a
    gather with no input from the backward pass could run as soon as its
    input is, in the forward pass, and hold the whole key until the
    backward pass: adding zeros computed from the upstream gradient makes
    it wait."""
    return tensor + tf.cast(_zeros_of(upstream), tensor.dtype)


def _zeros_of(upstream: tf.Tensor) -> tf.Tensor:
    """Zeros shaped like `upstream`'s first feature, computed from it (NaN
    where it is NaN): a value the backward pass has to wait for, that
    changes no finite value it is added to. (`zeros_like` would not do: its
    static shape makes it a constant, and what it is added to is folded
    back into the forward pass's value.)"""
    return tf.minimum(tf.abs(upstream[..., :1]), tf.zeros([], upstream.dtype))


def _key_blocks(query: Any, key: Any, value: Any) -> int:
    """How many blocks the keys are taken in (`key_blocks`), where this call
    runs under context parallelism with 4-D inputs of static lengths that
    divide by the sequence axis; 0 otherwise."""
    axis = context.step_sequence_axis
    mesh = forward_mesh()
    if context.sequences_split_by != "context_parallel" or axis is None or mesh is None or axis not in mesh.dim_names:
        return 0
    shapes = [getattr(t, "shape", tf.TensorShape(None)) for t in (query, key, value)]
    if any(s.rank != 4 for s in shapes) or not all(s[1:].is_fully_defined() for s in shapes):
        return 0
    heads, key_heads, keys = shapes[0][2], shapes[1][2], shapes[1][1]
    devices = mesh.dim_size(axis)
    if heads % key_heads or keys % devices or shapes[2][1] != keys or shapes[2][2] != key_heads:
        return 0
    return key_blocks(shapes[0][1], keys, devices)


def key_blocks(queries: int, keys: int, devices: int) -> int:
    """How many blocks `keys` keys are taken in for `queries` queries split
    over `devices` devices of the sequence axis: each device's part of the
    keys, halved while a block's scores per batch row and head, `queries /
    devices x keys in the block`, exceed `SCORES_PER_BLOCK`, the halves
    divide and are at least `MIN_KEYS_PER_BLOCK` keys wide."""
    blocks = devices
    while (
        queries // devices * (keys // blocks) > SCORES_PER_BLOCK
        and keys % (2 * blocks) == 0
        and keys // (2 * blocks) >= MIN_KEYS_PER_BLOCK
    ):
        blocks *= 2
    return blocks


def _blockwise_attention(
    query: tf.Tensor,
    key: tf.Tensor,
    value: tf.Tensor,
    mask: tf.Tensor | None,
    scale: Any,
    is_causal: bool,
    blocks: int,
) -> tf.Tensor:
    """Attention of `query` (B, T, N, H) over `key` and `value` (B, S, N, H)
    in `blocks` blocks of keys, with flash attention's backward pass."""
    float32 = keras.backend.result_type(query.dtype, "float32")
    mesh = forward_mesh()
    queries, keys = query.shape[1], key.shape[1]
    width = keys // blocks
    scale = tf.cast(scale, float32)
    large_negative = _get_large_negative(float32)

    def block_of(tensor: tf.Tensor, block: int) -> tf.Tensor:
        return tensor[:, block * width:(block + 1) * width]

    def kept(block: int, zeros: tf.Tensor | None) -> tf.Tensor | None:
        """Which scores of the block are attended to, (.., T, width), or None.

        In the backward pass, `zeros` (B, N, T, 1) computed from the upstream
        gradient: the causal mask is then computed there, not shared with
        the forward pass's, which would hold it, `queries x keys` for the
        whole layer, until then."""
        keep = None
        if mask is not None:
            keep = mask[..., block * width:(block + 1) * width] if mask.shape[-1] != 1 else mask
        if is_causal:
            positions = tf.range(block * width, (block + 1) * width, dtype=float32)
            query_positions = tf.range(queries, dtype=float32)[:, None]
            if zeros is not None:
                query_positions = query_positions + zeros
            causal = query_positions >= positions
            keep = causal if keep is None else tf.logical_and(keep, causal)
        return keep

    def scores_of(
        q: tf.Tensor, k: tf.Tensor, block: int, zeros: tf.Tensor | None = None
    ) -> tuple[tf.Tensor, tf.Tensor | None]:
        scores = tf.cast(tf.einsum("BTNH,BSNH->BNTS", q, block_of(k, block)), float32) * scale
        keep = kept(block, zeros)
        if keep is not None:
            scores = tf.where(keep, scores, large_negative)
        return scores, keep

    # The backward pass gathers a key and value split over the sequence
    # again rather than keep them whole: each is as large as the sequence.
    (split_key, gather_key), (split_value, gather_value) = (_split_before_gather(t, query) for t in (key, value))

    @tf.custom_gradient
    def attention(q: tf.Tensor, split_k: tf.Tensor, split_v: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        k, v = key, value
        maximum = total = weighted = None
        for block in range(blocks):
            scores, _ = scores_of(q, k, block)
            block_max = tf.reduce_max(scores, axis=-1, keepdims=True)
            grown = block_max if maximum is None else tf.maximum(maximum, block_max)
            exps = tf.exp(scores - grown)
            block_total = tf.reduce_sum(exps, axis=-1, keepdims=True)
            block_weighted = tf.einsum("BNTS,BSNH->BNTH", exps, tf.cast(block_of(v, block), float32))
            if maximum is None:
                total, weighted = block_total, block_weighted
            else:
                rescale = tf.exp(maximum - grown)
                total = total * rescale + block_total
                weighted = weighted * rescale + block_weighted
            maximum = grown
        output = weighted / total

        def gradient(upstream: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            # On the forward pass's mesh, as far as tfmp's patches go: the
            # blocks' key and value gradients are joined whole along the
            # sequence, as `tf.concat` joins them there.
            with tf.name_scope(BACKWARD_SCOPE), forward_on(mesh):
                return backward(upstream)

        def backward(upstream: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            k, v = (
                gather(_after(split, upstream)) if gather is not None else whole
                for split, gather, whole in ((split_k, gather_key, key), (split_v, gather_value, value))
            )
            upstream = tf.einsum("BTNH->BNTH", tf.cast(upstream, float32))
            zeros = _zeros_of(upstream)
            # The derivative of the softmax through its normalizer, per query.
            through_total = tf.reduce_sum(upstream * output, axis=-1, keepdims=True)
            d_query, d_keys, d_values = 0.0, [], []
            for block in range(blocks):
                scores, keep = scores_of(q, k, block, zeros)
                # Not exp(scores - log-sum-exp): for a query whose keys are all
                # masked, adding the log of the sum to the large negative number
                # rounds it away.
                probabilities = tf.exp(scores - maximum) / total
                d_values.append(tf.einsum("BNTS,BNTH->BSNH", probabilities, upstream))
                d_probabilities = tf.einsum("BNTH,BSNH->BNTS", upstream, tf.cast(block_of(v, block), float32))
                d_scores = probabilities * (d_probabilities - through_total) * scale
                if keep is not None:
                    d_scores = tf.where(keep, d_scores, tf.zeros([], float32))
                d_query += tf.einsum("BNTS,BSNH->BTNH", d_scores, tf.cast(block_of(k, block), float32))
                d_keys.append(tf.einsum("BNTS,BTNH->BSNH", d_scores, tf.cast(q, float32)))
            return (
                tf.cast(d_query, q.dtype),
                tf.cast(tf.concat(d_keys, axis=1), k.dtype),
                tf.cast(tf.concat(d_values, axis=1), v.dtype),
            )

        return tf.cast(tf.einsum("BNTH->BTNH", output), q.dtype), gradient

    return attention(query, split_key, split_value)


LOWERINGS = (
    Lowering(
        _KERAS_NN,
        "dot_product_attention",
        dot_product_attention,
        "Keras' attention keeps every query's scores against every key for the backward "
        "pass: under context parallelism, a block of keys at a time keeps none",
    ),
)
