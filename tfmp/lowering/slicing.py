"""TensorFlow's `strided_slice` (`tensor[...]`) on a mesh, as slices and
gathers; Keras' `slice` and `pad` where DTensor cannot pad a split dimension.

- RandomCrop crops with `images[:, h:h + height, w:w + width]` at an offset
  drawn in the step. DTensor sizes a `StridedSlice` whose bounds are tensors
  wrongly: every shard comes out empty (then "input image must be of non-zero
  size" in the resize that follows) or the process aborts ("Check failed:
  size >= 0"). On a mesh, TensorFlow's `strided_slice`, which `tensor[...]`
  calls, reads each such range `a:a + k` as a gather of `a + range(k)`,
  whose values and gradient DTensor lays out (such a range must lie inside
  the tensor: TensorFlow would clip it, the gather fails); a slice whose size
  tfmp cannot tell raises an error naming the layer. Slices with fixed
  bounds run as before.
- DTensor's `StridedSlice` with a `shrink_axis_mask` (`tensor[i]`, `tensor[:, i]`)
  drops the wrong dimension's sharding: `stack[0]` of a `(2, batch, ...)`
  stack split over "batch" on its second dimension comes out labelled split
  on its second dimension again, and its shards hold other rows than that
  label says (wrong values, and layout propagation that oscillates between
  the two labels until a `Transpose` is left with layouts it refuses: Gemma
  3n's AltUp). On a mesh such a slice with fixed bounds keeps the indexed
  dimensions (`i:i + 1`) and squeezes them, which DTensor lays out right.
- DTensor's `StridedSlice` with a negative step over a whole split
  dimension (`x[:, ::-1]`, `x[::-2]`) reverses each device's shard in place
  (values and gradient wrong, silently). On a mesh such a dimension is
  sliced whole and gathered at the positions the range names.
- The gradient of Keras' `slice` (`keras.ops.slice`) is TensorFlow's: a
  `Pad` of the slice's gradient back to the input's shape. DTensor's `Pad`
  fails on a padded dimension split over a mesh axis ("SPMD expansion
  resulted in op output inconsistent with the provided layout"), and layout
  propagation splits it so where the slice meets split activations: a
  position embedding's rows, added to a sequence split by context
  parallelism (BERT, RoBERTa, OPT, in the step of a last partial batch) or
  by sequence parallelism (OPT). Under either the gradient is gathered
  whole first, padded, and left whole; the slice itself is TensorFlow's.
- Keras' `pad` (`keras.ops.pad`) is that `Pad`. Under context or sequence
  parallelism it meets activations split over the sequence: RWKV-7 shifts
  each sequence by one position with a pad and a slice. There a floating tensor
  of rank 3 or more is padded with every dimension but the first (the
  batch's) whole, and left so, its gradient too; elsewhere it is Keras'
  own (a convolution's `ZeroPadding2D` pads dimensions no rule splits, and
  gathering its channels would cost a filter-split convnet a collective).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf
from keras.src.backend.common.name_scope import current_path
from tensorflow.experimental import dtensor

from tfmp.forward import BACKWARD_SCOPE, forward_mesh, relayout_with_gradient
from tfmp.layout import replicated
from tfmp.lowering.registry import Lowering, keras_original
from tfmp.tracing import context

_ARRAY_OPS = "tensorflow.python.ops.array_ops"
_KERAS_CORE = "keras.src.backend.tensorflow.core"
_KERAS_NUMPY = "keras.src.backend.tensorflow.numpy"


def slice(inputs: Any, start_indices: Any, shape: Any) -> tf.Tensor:  # noqa: A001 (Keras' name)
    """`keras.ops.slice`; under context or sequence parallelism, of a
    floating tensor, with its gradient padded whole (DTensor's `Pad` fails
    on a split padded dimension)."""
    original = keras_original(_KERAS_CORE, "slice")
    inputs = tf.convert_to_tensor(inputs)
    if context.sequences_split_by is None or not inputs.dtype.is_floating or not inputs.shape.rank:
        return original(inputs, start_indices, shape)
    mesh = forward_mesh()

    @tf.custom_gradient
    def sliced(value: tf.Tensor) -> Any:
        result = original(value, start_indices, shape)

        def gradient(upstream: tf.Tensor) -> tf.Tensor:
            with tf.name_scope(BACKWARD_SCOPE):
                begin = tf.cast(tf.convert_to_tensor(start_indices), tf.int32)
                end = tf.shape(value) - begin - tf.shape(result)
                padded = tf.pad(replicated(upstream, mesh), tf.stack([begin, end], axis=1))
                return dtensor.relayout(padded, dtensor.Layout.replicated(mesh, padded.shape.rank))

        return result, gradient

    return sliced(inputs)


def pad(x: Any, pad_width: Any, mode: str = "constant", constant_values: Any = None) -> tf.Tensor:
    """`keras.ops.pad`; under context or sequence parallelism, of a
    floating tensor of rank 3 or more, with every dimension but the first
    whole (DTensor's `Pad` fails on a split padded dimension)."""
    original = keras_original(_KERAS_NUMPY, "pad")
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    if context.sequences_split_by is None or rank is None or rank < 3 or not x.dtype.is_floating:
        return original(x, pad_width, mode, constant_values)
    # DTensor allows one MATCH per layout: the batch's dimension keeps its split.
    batch_kept = dtensor.Layout([dtensor.MATCH] + [dtensor.UNSHARDED] * (rank - 1), forward_mesh())
    padded = original(relayout_with_gradient(x, batch_kept, batch_kept), pad_width, mode, constant_values)
    return relayout_with_gradient(padded, batch_kept, batch_kept)


def strided_slice(
    input_: Any,
    begin: Any,
    end: Any,
    strides: Any = None,
    begin_mask: int = 0,
    end_mask: int = 0,
    ellipsis_mask: int = 0,
    new_axis_mask: int = 0,
    shrink_axis_mask: int = 0,
    var: Any = None,
    name: Any = None,
) -> tf.Tensor:
    """TensorFlow's `strided_slice` on a mesh: a range whose bounds are
    computed in the step becomes a gather of a fixed number of indices;
    fixed bounds run TensorFlow's own, indexed dimensions of a tensor of rank
    2 or more as a slice and a squeeze (a variable's slice, whose result can
    `assign`, stays TensorFlow's own)."""
    if all(bound is None or tf.get_static_value(bound) is not None for bound in (begin, end, strides)):
        rank = tf.TensorShape(getattr(input_, "shape", None)).rank
        if strides is not None and var is None and rank is not None and np.any(np.asarray(tf.get_static_value(strides)) < 0):
            fixed = _FixedSlice.of(begin, end, strides, begin_mask, end_mask, ellipsis_mask, new_axis_mask, shrink_axis_mask)
            return _backward_ranges_as_gathers(tf.convert_to_tensor(input_), fixed, name)
        if new_axis_mask and not ellipsis_mask and var is None and rank is not None:
            begin, end, strides, begin_mask, end_mask = _every_dimension_named(
                begin, end, strides, begin_mask, end_mask, new_axis_mask, rank
            )
        if shrink_axis_mask and var is None and rank is not None and rank >= 2:
            fixed = _FixedSlice.of(begin, end, strides, begin_mask, end_mask, ellipsis_mask, new_axis_mask, shrink_axis_mask)
            return _slice_then_squeeze(tf.convert_to_tensor(input_), fixed, name)
        return keras_original(_ARRAY_OPS, "strided_slice")(
            input_, begin, end, strides, begin_mask, end_mask, ellipsis_mask,
            new_axis_mask, shrink_axis_mask, var, name,
        )
    input_ = tf.convert_to_tensor(input_)
    starts, stops = _elements(begin), _elements(end)
    unit_strides = strides is None or np.all(tf.get_static_value(strides) == 1)
    if not starts or new_axis_mask or not unit_strides:
        raise _traced_slice_error(input_)
    corner, sizes, squeezed = [], [], []
    for entry, (start, stop) in enumerate(zip(starts, stops)):
        bit, dim = 1 << entry, len(corner)
        if ellipsis_mask & bit:
            whole = input_.shape.rank - (len(starts) - 1)
            corner, sizes = corner + [0] * whole, sizes + [-1] * whole
            continue
        if shrink_axis_mask & bit:
            start, size = _normalized(start, input_.shape[dim]), 1
            squeezed.append(dim)
        else:
            start, size = _window(
                None if begin_mask & bit else start, None if end_mask & bit else stop, input_.shape[dim]
            )
        if size is None:
            raise _traced_slice_error(input_)
        corner, sizes = corner + [start], sizes + [size]
    rest = input_.shape.rank - len(corner)
    corner, sizes = corner + [0] * rest, sizes + [-1] * rest
    return _gathered_slice(input_, corner, sizes, squeezed)


def _every_dimension_named(
    begin: Any, end: Any, strides: Any, begin_mask: int, end_mask: int, new_axis_mask: int, rank: int
) -> tuple[Any, Any, Any, int, int]:
    """Fixed slice entries with a new axis (`x[:, None]`) extended by a whole
    range for each input dimension they leave unnamed. DTensor's StridedSlice
    layout rule reads a sharding spec past the named entries for those
    (garbage text in its error, which Python cannot decode, or a crash);
    `x[:, None, :]` is the same slice, laid out right."""
    starts, stops = (list(np.reshape(tf.get_static_value(v), [-1])) for v in (begin, end))
    steps = [1] * len(starts) if strides is None else list(np.reshape(tf.get_static_value(strides), [-1]))
    named = len(starts) - bin(new_axis_mask & ((1 << len(starts)) - 1)).count("1")
    for entry in range(len(starts), len(starts) + max(rank - named, 0)):
        starts, stops, steps = starts + [0], stops + [0], steps + [1]
        begin_mask, end_mask = begin_mask | (1 << entry), end_mask | (1 << entry)
    return starts, stops, steps, begin_mask, end_mask


@dataclasses.dataclass
class _FixedSlice:
    """The arguments of a `strided_slice` whose bounds are known when traced."""

    starts: list[int]
    stops: list[int]
    steps: list[int] | None
    begin_mask: int
    end_mask: int
    ellipsis_mask: int
    new_axis_mask: int
    shrink_axis_mask: int

    @classmethod
    def of(cls, begin: Any, end: Any, strides: Any, *masks: int) -> _FixedSlice:
        starts, stops = (
            [int(value) for value in np.reshape(tf.get_static_value(bound), [-1])] for bound in (begin, end)
        )
        steps = None if strides is None else [int(v) for v in np.reshape(tf.get_static_value(strides), [-1])]
        return cls(starts, stops, steps, *masks)

    def entries(self) -> range:
        return range(len(self.starts))

    def unnamed_dimensions(self, rank: int) -> int:
        """How many input dimensions the ellipsis stands for."""
        new_axes = sum(1 for entry in self.entries() if self.new_axis_mask & (1 << entry))
        return rank - (len(self.starts) - 1 - new_axes)

    def run(self, input_: tf.Tensor, name: Any) -> tf.Tensor:
        """TensorFlow's own `strided_slice` with these arguments."""
        return keras_original(_ARRAY_OPS, "strided_slice")(
            input_, self.starts, self.stops, self.steps, self.begin_mask, self.end_mask,
            self.ellipsis_mask, self.new_axis_mask, self.shrink_axis_mask, None, name,
        )


def _backward_ranges_as_gathers(input_: tf.Tensor, fixed: _FixedSlice, name: Any) -> tf.Tensor:
    """`input_[..., a:b:-k, ...]` with fixed bounds on a mesh: the dimensions
    read backward are sliced whole, then gathered at the positions the range
    names. DTensor's `StridedSlice` with a negative step over a whole
    dimension (`x[:, ::-1]`) reverses each device's shard in place: the
    shards come out in the order of the mesh, each reversed."""
    forward = dataclasses.replace(fixed, starts=list(fixed.starts), stops=list(fixed.stops), steps=list(fixed.steps))
    backward, input_dim, output_dim = [], 0, 0
    for entry in fixed.entries():
        bit = 1 << entry
        if fixed.ellipsis_mask & bit:
            unnamed = fixed.unnamed_dimensions(input_.shape.rank)
            input_dim, output_dim = input_dim + unnamed, output_dim + unnamed
            continue
        if fixed.new_axis_mask & bit:
            output_dim += 1
            continue
        shrunk = fixed.shrink_axis_mask & bit
        if not shrunk and fixed.steps[entry] < 0:
            start = None if fixed.begin_mask & bit else fixed.starts[entry]
            stop = None if fixed.end_mask & bit else fixed.stops[entry]
            backward.append((output_dim, _backward_positions(input_, input_dim, start, stop, fixed.steps[entry])))
            forward.starts[entry], forward.stops[entry], forward.steps[entry] = 0, 0, 1
            forward.begin_mask, forward.end_mask = forward.begin_mask | bit, forward.end_mask | bit
        input_dim += 1
        output_dim += 0 if shrunk else 1
    sliced = strided_slice(
        input_, forward.starts, forward.stops, forward.steps, forward.begin_mask, forward.end_mask,
        forward.ellipsis_mask, forward.new_axis_mask, forward.shrink_axis_mask, None, name,
    )
    for dim, positions in backward:
        sliced = tf.gather(sliced, positions, axis=dim)
    return sliced


def _backward_positions(input_: tf.Tensor, dim: int, start: int | None, stop: int | None, step: int) -> tf.Tensor:
    """The positions `start:stop:step` (step < 0) names in dimension `dim`,
    as Python's `range(size)[start:stop:step]` counts them."""
    size = input_.shape[dim]
    if size is not None:
        return tf.constant(list(range(size)[start:stop:step]), "int32")
    size = tf.shape(input_, out_type="int32")[dim]
    first = size - 1 if start is None else tf.clip_by_value(start + size if start < 0 else start, -1, size - 1)
    last = -1 if stop is None else tf.clip_by_value(stop + size if stop < 0 else stop, -1, size - 1)
    return tf.range(first, last, step)


def _slice_then_squeeze(input_: tf.Tensor, fixed: _FixedSlice, name: Any) -> tf.Tensor:
    """`input_[..., i, ...]` with fixed bounds on a mesh: the slice keeps
    each indexed dimension (`i:i + 1`) and a squeeze drops it. DTensor's own
    `StridedSlice` with a `shrink_axis_mask` drops the wrong dimension's
    sharding: `stack[0]` of a `(2, batch, seq, features)` stack split on its
    second dimension comes out labelled split on its second dimension again
    (the sequence), and its shards hold other rows than that label says."""
    kept = dataclasses.replace(fixed, stops=list(fixed.stops), shrink_axis_mask=0)
    squeezed, output_dim = [], 0
    for entry in fixed.entries():
        bit = 1 << entry
        if fixed.ellipsis_mask & bit:
            output_dim += fixed.unnamed_dimensions(input_.shape.rank)
            continue
        if fixed.shrink_axis_mask & bit:
            # The index alone: `-1` reads to the end, others up to the next.
            kept.stops[entry] = fixed.starts[entry] + 1
            if fixed.starts[entry] == -1:
                kept.end_mask |= bit
            kept.begin_mask &= ~bit
            squeezed.append(output_dim)
        output_dim += 1
    if fixed.steps is not None:
        kept.steps = [1 if fixed.shrink_axis_mask & (1 << entry) else step for entry, step in enumerate(fixed.steps)]
    return tf.squeeze(kept.run(input_, name), squeezed)


def _gathered_slice(
    input_: tf.Tensor, corner: list[Any], sizes: list[int], squeezed: list[int]
) -> tf.Tensor:
    """`input_[corner:corner + sizes]`, squeezed: fixed starts by a slice,
    traced ones by a gather of `start + range(size)` (whose gradient DTensor
    lays out; tf.slice's is a pad by traced amounts, sized wrongly again)."""
    traced = [not isinstance(start, int) for start in corner]
    sliced = tf.slice(
        input_,
        [0 if is_traced else start for start, is_traced in zip(corner, traced)],
        [-1 if is_traced else size for size, is_traced in zip(sizes, traced)],
    )
    for dim, (start, size, is_traced) in enumerate(zip(corner, sizes, traced)):
        if is_traced:
            sliced = tf.gather(sliced, start + tf.range(size, dtype=start.dtype), axis=dim)
    return tf.squeeze(sliced, squeezed) if squeezed else sliced


def _elements(vector: tf.Tensor) -> list[tf.Tensor]:
    """The scalars `tensor[...]` stacked into a slice's bounds (none for a
    bounds vector computed otherwise)."""
    if vector.op.type == "Cast":  # `tensor[...]` widens mixed int32/int64 bounds
        vector = vector.op.inputs[0]
    if vector.op.type != "Pack":
        return []
    return list(vector.op.inputs)


def _normalized(index: tf.Tensor, size: int | None) -> Any:
    """A fixed index as an int (a negative one counted from the end); a
    traced one as it is."""
    value = tf.get_static_value(index)
    if value is None:
        return index
    return int(value) + size if value < 0 and size is not None else int(value)


def _window(start: tf.Tensor | None, stop: tf.Tensor | None, size: int | None) -> tuple[Any, int | None]:
    """The start and length of `start:stop` (None: from the beginning, to the
    end) in a dimension of `size`. The length is known for fixed bounds and
    for bounds that add fixed numbers to one tensor (`a:a + k`,
    `a - 1:a + 2`); else it is None. A whole dimension is (0, -1): all of
    it, whatever its size (the batch's is unknown when Keras traces the step
    again for a second batch size)."""
    if start is None and stop is None:
        return 0, -1
    start_value = 0 if start is None else tf.get_static_value(start)
    stop_value = size if stop is None else tf.get_static_value(stop)
    if start_value is not None and stop_value is not None and size is not None:
        indices = range(size)[int(start_value) : int(stop_value)]
        return indices.start, len(indices)
    if start is None or stop is None:
        return start, None
    (start_base, start_offset), (stop_base, stop_offset) = _base_and_offset(start), _base_and_offset(stop)
    if start_base is None or start_base != stop_base or stop_offset < start_offset:
        return start, None
    return start, stop_offset - start_offset


def _base_and_offset(bound: tf.Tensor) -> tuple[str | None, int]:
    """(name of tensor a, fixed k) for a bound computed as a + k, k + a or
    a - k; (a's name, 0) for any other a; (None, value) for a fixed bound."""
    value = tf.get_static_value(bound)
    if value is not None:
        return None, int(value)
    if bound.op.type in ("AddV2", "Add", "Sub"):
        left, right = bound.op.inputs
        right_value, left_value = tf.get_static_value(right), tf.get_static_value(left)
        if right_value is not None:
            return left.name, int(right_value) * (-1 if bound.op.type == "Sub" else 1)
        if left_value is not None and bound.op.type != "Sub":
            return right.name, int(left_value)
    return bound.name, 0


def _traced_slice_error(input_: tf.Tensor) -> ValueError:
    return ValueError(
        f"Layer {current_path() or '?'!r} slices a tensor of shape {input_.shape} with "
        "bounds computed in the step, on a tfmp mesh. DTensor sizes such a slice "
        "wrongly (empty shards), and tfmp rewrites only ranges of a fixed size with "
        "step 1 and no new axes. Write each range as `x[a:a + k]` with a Python int "
        "k, or use keras.ops.slice(x, start_indices, shape)."
    )


LOWERINGS = (
    Lowering(
        _KERAS_CORE,
        "slice",
        slice,
        "Pad, Slice's gradient, fails on a padded dimension split over a mesh axis (a position"
        " embedding's rows under context or sequence parallelism)",
    ),
    Lowering(
        _KERAS_NUMPY,
        "pad",
        pad,
        "Pad fails on a padded dimension split over a mesh axis (a sequence under context or"
        " sequence parallelism)",
    ),
    Lowering(
        _ARRAY_OPS,
        "strided_slice",
        strided_slice,
        "DTensor sizes a StridedSlice with bounds computed in the step wrongly (empty shards),"
        " and drops the wrong dimension's sharding where it shrinks one",
    ),
)
