"""Time-first buffers a loop reads and writes one time step at a time.

A loop over time on a mesh keeps what each step gives in a tensor of shape
`(time, batch, ...)`, written one row per step with ops DTensor lays out.
TensorFlow's `TensorScatterAdd` copies its whole input for every write (its
kernel offers the *updates'* buffer to the output, never the input's), so a
loop writing one row per step copies `time` rows per step, `time**2` per
sequence. On a one-device mesh a 2-layer LSTM over 128 tokens stepped 3.7x
as long as in Keras' own loop, and a bare loop writing one buffer over 512
steps took 165 ms against 21 ms in blocks. Ops that would write in place
(`InplaceUpdate`, `ScatterNdNonAliasingAdd`) have no DTensor layout rule, and
DTensor's `TensorStridedSliceUpdate` at a time step known only at run time
left the buffer unwritten. `over_time` therefore runs long loops in blocks
of about `sqrt(time)` steps: each step writes a row of its block's buffer,
each block is written into the whole buffer at once, `2 * time**1.5` rows
copied per sequence.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import tensorflow as tf

# A loop writes in blocks where it is over this many steps long and each
# straight write would copy a buffer of at least this many bytes on a
# device (`time` rows): below that, the blocks' own loops cost more than
# the copies they save. Measured on CPU (2 cores; a 2-layer LSTM of 64
# units, batch 32; docs/performance.md): over 128 steps, blocks took 0.51x
# as long on one device (buffers of 1 MiB), 0.93x on 2x4 (the batch split
# in 2: 512 KiB), 1.10x on 8x1 (128 KiB); on one device 52 against 60 ms
# over 64 steps (512 KiB), 29 against 26 ms over 32 (256 KiB).
_LONGEST_UNBLOCKED = 32
_FEWEST_BYTES_BLOCKED = 512 * 1024


def time_buffer(steps: Any, row: tf.Tensor) -> tf.Tensor:
    """Zeros of shape `(steps, *row.shape)`."""
    if isinstance(steps, int):
        return tf.zeros([steps, *row.shape], row.dtype)
    return tf.zeros(tf.concat([[steps], tf.shape(row)], 0), row.dtype)


def written(buffer: tf.Tensor, t: Any, value: tf.Tensor, steps: Any) -> tf.Tensor:
    """`buffer` (time first, zero at time step `t`) with `value` at `t`: a
    scatter of one row, which DTensor lays out with the row's layout, or,
    where the number of time steps is unknown when traced, a sum against a
    one-hot of `t` (see `read`)."""
    if buffer.shape[0] is not None:
        return tf.tensor_scatter_nd_add(buffer, tf.reshape(t, [1, 1]), tf.expand_dims(value, 0))
    one_hot = tf.one_hot(t, steps, dtype=value.dtype)
    return buffer + tf.reshape(one_hot, [-1] + [1] * value.shape.rank) * tf.expand_dims(value, 0)


def read(buffer: tf.Tensor, t: Any, steps: Any) -> tf.Tensor:
    """Time step `t` of `buffer` (time first).

    A slice of static size, where the number of time steps is known when
    traced: DTensor's `StridedSlice` refuses an index known only at run time,
    and its `Slice` lays out one of unknown size wrongly. Where it is not
    known, a sum against a one-hot of `t`, O(time) work per read: with slices
    and scatters there, DTensor stops on the gradient of a reversed sequence
    ("Reshape ... value shape is not static").
    """
    t = tf.math.floormod(t, steps)
    row = buffer.shape[1:]
    if buffer.shape[0] is not None:
        begin = tf.concat([tf.reshape(t, [1]), tf.zeros([row.rank], t.dtype)], 0)
        return tf.reshape(tf.slice(buffer, begin, [1, *row.as_list()]), row)
    shape = [-1] + [1] * row.rank
    if buffer.dtype == tf.bool:
        return tf.reduce_any(tf.logical_and(buffer, tf.reshape(tf.one_hot(t, steps, True, False), shape)), 0)
    return tf.reduce_sum(buffer * tf.reshape(tf.one_hot(t, steps, dtype=buffer.dtype), shape), 0)


def over_time(
    start: int,
    stop: Any,
    body: Callable[[Any, Any], tuple[Any, list[tf.Tensor], list[tf.Tensor]]],
    carry: Any,
    buffers: list[tf.Tensor],
    sums: list[tf.Tensor] = (),
    reverse: bool = False,
    batch_shards: int = 1,
) -> tuple[Any, list[tf.Tensor], list[tf.Tensor]]:
    """Runs `carry, rows, addends = body(t, carry)` for `t` in
    `range(start, stop)` (from `stop - 1` down with `reverse`), writing
    `rows[i]` at time step `t` of `buffers[i]` (time first, `stop` steps,
    zero where written) and adding `addends[i]` to `sums[i]`; returns the
    last carry, the buffers and the sums. In blocks where `stop` is known
    when traced and the straight writes would copy enough (see the module's
    note and `_FEWEST_BYTES_BLOCKED`); `batch_shards` is the number of
    devices the buffers' batch is split over.

    A sum over a split batch (a weight's gradient) stays a partial sum on
    each device through a loop, all-reduced once after it; a block's loop
    starts its own sums from zeros for the same reason (carried into it,
    DTensor all-reduced them at every step: a 2-layer LSTM on 8x1 over 128
    time steps stepped 6.8x as long)."""
    size = None
    if isinstance(stop, int):
        largest = max((b.shape.num_elements() or 0) * b.dtype.size for b in buffers) if buffers else 0
        size = _block_size(stop - start, largest // batch_shards)
    delta = -1 if reverse else 1
    if size is None:
        def step(t, carry, buffers, sums):
            carry, rows, addends = body(t, carry)
            buffers = [written(b, t, r, stop) for b, r in zip(buffers, rows)]
            return t + delta, carry, buffers, [s + a for s, a in zip(sums, addends)]

        first = tf.convert_to_tensor(stop - 1 if reverse else start)
        _, carry, buffers, sums = tf.while_loop(
            (lambda t, *_: t >= start) if reverse else (lambda t, *_: t < stop),
            step,
            (first, carry, buffers, list(sums)),
        )
        return carry, buffers, sums
    # As a function of its own, as the recurrences' gradient already is:
    # while this was built, the blocks traced inline in a training step made
    # DTensor export a masked LSTM's block loop twice under one name ("Cannot
    # add function '.../while/while_body' because a different function with
    # the same name already exists"), every time; as a function they ran.
    # With the code as it is now, inline ran too; the cause was not found.
    in_blocks = functools.partial(_in_blocks, start, stop, size, body, reverse)
    return tf.function(in_blocks, autograph=False)(carry, buffers, list(sums))


def _in_blocks(
    start: int, stop: int, size: int, body: Callable, reverse: bool, carry: Any, buffers: list, sums: list
) -> tuple[Any, list[tf.Tensor], list[tf.Tensor]]:
    """`over_time`'s loop over blocks of `size` steps, each block a loop."""
    delta = -1 if reverse else 1
    blocks = -(-(stop - start) // size)
    padded = start + blocks * size
    if padded > stop:
        buffers = [tf.concat([b, tf.zeros([padded - stop, *b.shape[1:]], b.dtype)], 0) for b in buffers]

    def block(b, carry, buffers, sums):
        # DTensor refuses a loop that starts from (or reads) the enclosing
        # loop's variables themselves ("Block argument must be enclosed by a
        # function"): the inner loop starts from copies, and counts the time
        # step as well as the step in the block (TensorFlow would pass a
        # loop variable that never changes as a read of the outer one's).
        def step(k, t, carry, rows_so_far, sums):
            carry, rows, addends = body(t, carry)
            rows_so_far = [written(s, k, r, size) for s, r in zip(rows_so_far, rows)]
            return k + delta, t + delta, carry, rows_so_far, [s + a for s, a in zip(sums, addends)]

        first_t = start + b * size
        carry = tf.nest.map_structure(tf.identity, carry)
        empty = [tf.zeros([size, *buffer.shape[1:]], buffer.dtype) for buffer in buffers]
        zeros = [tf.zeros(s.shape, s.dtype) for s in sums]
        if reverse:  # the last block may end past `stop`
            first_k = tf.minimum(size - 1, stop - 1 - first_t)
            first_t = first_t + first_k
            in_this_block = lambda k, t, *_: k >= 0  # noqa: E731
        else:
            first_k = tf.constant(0)
            in_this_block = lambda k, t, *_: tf.logical_and(k < size, t < stop)  # noqa: E731
        _, _, carry, in_block, block_sums = tf.while_loop(in_this_block, step, (first_k, first_t, carry, empty, zeros))
        at = tf.reshape(start + b * size + tf.range(size), [size, 1])
        buffers = [tf.tensor_scatter_nd_add(whole, at, rows) for whole, rows in zip(buffers, in_block)]
        return b + delta, carry, buffers, [s + a for s, a in zip(sums, block_sums)]

    first = tf.constant(blocks - 1 if reverse else 0)
    _, carry, buffers, sums = tf.while_loop(
        (lambda b, *_: b >= 0) if reverse else (lambda b, *_: b < blocks), block, (first, carry, buffers, list(sums))
    )
    if padded > stop:
        buffers = [b[:stop] for b in buffers]
    return carry, buffers, sums


def _block_size(steps: int, buffer_bytes: int) -> int | None:
    """Steps per block for a loop of `steps` steps whose straight writes
    copy a buffer of `buffer_bytes` on a device each: `ceil(sqrt(steps))`,
    which copies fewest rows, or None to write straight into the buffers."""
    if steps <= _LONGEST_UNBLOCKED or buffer_bytes < _FEWEST_BYTES_BLOCKED:
        return None
    return math.isqrt(steps - 1) + 1
