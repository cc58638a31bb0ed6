"""`balance`: split a chain of layers into pipeline stages of even cost.

A pipeline runs only as fast as its slowest stage, so `balance` picks the
consecutive split whose largest stage cost is smallest (exact linear-partition
dynamic programming). Among equally good splits it returns the one whose cut
points come earliest, so the answer is deterministic.

Per-layer costs:

| `by`       | cost of one layer                                                   |
|------------|---------------------------------------------------------------------|
| `"params"` | `layer.count_params()`: trainable and non-trainable weights          |
| `"flops"`  | forward multiply-adds x 2, per sample, from the layer's output shape |

FLOP estimates, with `out` the output shape without the batch dimension:

| layer                         | FLOPs                                                          |
|-------------------------------|----------------------------------------------------------------|
| Dense, EinsumDense            | 2 x kernel size x positions, positions = prod(out) / the size  |
|                               | of the kernel's output axes (`prod(out[:-1])` for a Dense)     |
| Conv1D, Conv2D, Conv3D        | 2 x kernel size x prod(output spatial dims)                    |
| Embedding                     | prod(out) (a lookup copies the output)                         |
| MultiHeadAttention            | 2 x (sum of projection kernel sizes) x T + 4 x T^2 x heads x   |
|                               | key_dim, T = prod(out[:-1]) query positions (self-attention)   |
| Keras model, tfmp LayerGroup  | the sum over its layers                                        |
| Wrapper (`Sharded`, ...)      | the wrapped layer's FLOPs at the wrapper's output shape        |
| anything else                 | prod(out) (elementwise)                                        |

Where the output shape comes from, first that applies:

1. the layer's functional history (`layer.output`), as left by `keras.Input`,
   by building or calling a `keras.Sequential`, or by a `LayerGroup`'s build;
2. the input shapes recorded when the layer was built (Keras keeps them in
   `layer._build_shapes_dict`), through `layer.compute_output_shape`;
3. the previous layer's output shape through `layer.compute_output_shape`,
   since the layers form a chain: this covers weightless layers (activations,
   dropout) that were called eagerly and so recorded no shape.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import keras

Shape = tuple[int | None, ...]

_BY = ("params", "flops")
_BUILD_HINT = "build the model first, e.g. by calling it on a batch or giving keras.Input"


def balance(
    model_or_layers: keras.Model | Sequence[keras.layers.Layer],
    num_stages: int,
    by: str = "params",
) -> list[list[keras.layers.Layer]]:
    """Suggests how to split layers into pipeline stages of even cost.

    Args:
        model_or_layers: The layers in the order they run, or a Keras model
            (its `layers`, without `keras.layers.InputLayer`s). The layers
            must be built.
        num_stages: How many consecutive, non-empty stages to make.
        by: The cost to even out: `"params"` (weights per stage, i.e. memory)
            or `"flops"` (forward FLOPs per sample, i.e. time).

    Returns:
        `num_stages` lists of layers, in order, that together hold every
        layer once, such that the largest stage cost is as small as possible.

    Raises:
        ValueError: If `by` is unknown, there are no layers, a layer appears
            twice, `num_stages` is not between 1 and the number of layers, a
            layer is not built, or (for `"flops"`) a layer's output shape is
            unknown.

    Examples:
        >>> import keras
        >>> from tfmp.pipeline.balance import balance, stage_costs
        >>> model = keras.Sequential([
        ...     keras.Input((8,)),
        ...     keras.layers.Dense(8),   # 72 parameters
        ...     keras.layers.Dense(8),   # 72
        ...     keras.layers.Dense(16),  # 144
        ...     keras.layers.Dense(4),   # 68
        ... ])
        >>> stages = balance(model, num_stages=2)
        >>> [len(stage) for stage in stages]
        [2, 2]
        >>> stage_costs(stages)
        [144, 212]
    """
    _check_by(by)
    layers = _layers_of(model_or_layers)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}: use an integer of at least 1.")
    if num_stages > len(layers):
        raise ValueError(
            f"num_stages={num_stages}, but the model has only {len(layers)} layers; "
            f"use at most {len(layers)} stages."
        )
    cuts = _partition(_costs(layers, by), num_stages)
    bounds = [0, *cuts, len(layers)]
    return [layers[start:end] for start, end in zip(bounds, bounds[1:])]


def stage_costs(
    groups: Sequence[Sequence[keras.layers.Layer]], by: str = "params"
) -> list[int]:
    """Returns the cost of each group of layers, as `balance` measures it.

    Args:
        groups: Stages of layers in the order they run, e.g. from `balance`.
        by: `"params"` or `"flops"`, as in `balance`.

    Returns:
        One integer per group: the sum of its layers' costs.

    Raises:
        ValueError: As `balance` does for an unknown `by` or a layer whose
            cost cannot be measured.
    """
    _check_by(by)
    # Costed as one chain so that a stage's first layer can take its shape
    # from the previous stage's last layer.
    costs = iter(_costs([layer for group in groups for layer in group], by))
    return [sum(next(costs) for _ in group) for group in groups]


def _check_by(by: str) -> None:
    if by not in _BY:
        raise ValueError(f"by={by!r} is not a cost balance knows; use 'params' or 'flops'.")


def _layers_of(model_or_layers: Any) -> list[keras.layers.Layer]:
    """The layers to split, checked to be non-empty Keras layers, each once."""
    if isinstance(model_or_layers, keras.Model):
        layers = [
            layer
            for layer in model_or_layers.layers
            if not isinstance(layer, keras.layers.InputLayer)
        ]
    elif isinstance(model_or_layers, (list, tuple)):
        layers = list(model_or_layers)
    else:
        raise TypeError(
            f"balance() takes a Keras model or a list of layers, "
            f"got {type(model_or_layers).__name__}."
        )
    if not layers:
        raise ValueError(
            "balance() got no layers: pass a non-empty list of layers or a model "
            "that has layers."
        )
    first_seen: dict[int, int] = {}
    for position, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"Entry {position} is a {type(layer).__name__}, not a Keras layer."
            )
        # By identity: two distinct layers may compare or hash alike.
        if id(layer) in first_seen:
            raise ValueError(
                f"Layer {layer.name!r} appears twice (positions {first_seen[id(layer)]} "
                f"and {position}); pass each layer once."
            )
        first_seen[id(layer)] = position
    return layers


def _partition(costs: list[int], num_stages: int) -> list[int]:
    """Cut points of the split of `costs` whose largest group sum is least.

    Returns the `num_stages - 1` indices where stages 2, 3, ... start; among
    optimal splits, the one whose cuts are lexicographically smallest.
    """
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # tail[j][i]: the least possible largest group sum when costs[i:] is
    # split into j non-empty groups (infinite when fewer than j layers remain).
    tail = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(n):
        tail[1][i] = prefix[n] - prefix[i]
    for j in range(2, num_stages + 1):
        for i in range(n - j + 1):
            tail[j][i] = min(
                max(prefix[end] - prefix[i], tail[j - 1][end])
                for end in range(i + 1, n - j + 2)
            )
    bottleneck = tail[num_stages][0]
    # Cutting as early as the optimum allows, stage after stage, yields the
    # lexicographically smallest optimal cuts; an admissible cut always
    # exists because tail[j][start] <= bottleneck holds at every step.
    cuts, start = [], 0
    for j in range(num_stages, 1, -1):
        start = next(
            end
            for end in range(start + 1, n - j + 2)
            if prefix[end] - prefix[start] <= bottleneck and tail[j - 1][end] <= bottleneck
        )
        cuts.append(start)
    return cuts


def _costs(layers: Sequence[keras.layers.Layer], by: str) -> list[int]:
    for layer in layers:
        if not layer.built:
            raise ValueError(
                f"Layer {layer.name!r} is not built, so its {by} are unknown; {_BUILD_HINT}."
            )
    if by == "params":
        return [int(layer.count_params()) for layer in layers]
    costs, _ = _chain_flops(layers, None)
    return costs


def _chain_flops(
    layers: Sequence[keras.layers.Layer], input_shape: Shape | None
) -> tuple[list[int], Shape | None]:
    """FLOPs of each layer of a chain, and the chain's output shape."""
    costs = []
    shape = input_shape
    for layer in layers:
        cost, shape = _layer_flops(layer, shape)
        costs.append(cost)
    return costs, shape


def _layer_flops(layer: keras.layers.Layer, input_shape: Shape | None) -> tuple[int, Shape]:
    """FLOPs of `layer` and its output shape; `input_shape` is the fallback."""
    sublayers = _sublayers(layer)
    if sublayers is not None:
        costs, output_shape = _chain_flops(sublayers, _input_shape(layer) or input_shape)
        if output_shape is None:
            raise ValueError(f"Layer {layer.name!r} has no layers to estimate FLOPs of.")
        return sum(costs), output_shape
    output_shape = _output_shape(layer, input_shape)
    return _flops_at(layer, output_shape), output_shape


def _sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer] | None:
    """The layers a container runs in order, or None if `layer` is no container."""
    if isinstance(layer, keras.Model):
        return [sub for sub in layer.layers if not isinstance(sub, keras.layers.InputLayer)]
    # tfmp's LayerGroup keeps its layers as `group_layers`; other containers
    # in the Keras style name them `layers`.
    for name in ("group_layers", "layers"):
        sublayers = getattr(layer, name, None)
        if isinstance(sublayers, (list, tuple)):
            return list(sublayers)
    return None


def _input_shape(layer: keras.layers.Layer) -> Shape | None:
    """The first input shape `layer` was called or built with, if recorded."""
    try:
        return tuple(keras.tree.flatten(layer.input)[0].shape)
    except AttributeError:
        pass  # never called symbolically: no functional history
    recorded = getattr(layer, "_build_shapes_dict", None)
    return tuple(next(iter(recorded.values()))) if recorded else None


def _flops_at(layer: keras.layers.Layer, output_shape: Shape) -> int:
    """Forward FLOPs per sample of `layer` when it outputs `output_shape`."""
    out = output_shape[1:]
    if any(dim is None for dim in out):
        raise ValueError(
            f"Layer {layer.name!r} has output shape {tuple(output_shape)}, with an "
            "unknown dimension, so its FLOPs are unknown; give keras.Input a fixed shape."
        )
    if isinstance(layer, keras.layers.Wrapper):
        return _flops_at(layer.layer, output_shape)
    if isinstance(layer, keras.layers.Dense):
        kernel = tuple(layer.kernel.shape)
        return 2 * math.prod(kernel) * math.prod(out[:-1])
    if isinstance(layer, keras.layers.EinsumDense):
        kernel = tuple(layer.kernel.shape)
        operands, output_spec = layer.equation.split("->")
        kernel_spec = operands.split(",")[1]
        # Kernel axes that reach the output are produced, not summed over:
        # each output position is one kernel's worth of outputs.
        produced = math.prod(
            size for axis, size in zip(kernel_spec, kernel) if axis in output_spec
        )
        return 2 * math.prod(kernel) * (math.prod(out) // produced)
    if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)):
        spatial = out[1:] if layer.data_format == "channels_first" else out[:-1]
        return 2 * math.prod(layer.kernel.shape) * math.prod(spatial)
    if isinstance(layer, keras.layers.MultiHeadAttention):
        positions = math.prod(out[:-1])
        projections = sum(math.prod(w.shape) for w in layer.weights if w.name == "kernel")
        # Scores (Q K^T) and their weighted sum (scores V), keys as long as queries.
        attention = 4 * positions**2 * layer.num_heads * layer.key_dim
        return 2 * projections * positions + attention
    # Embedding lookups and weightless or unknown layers: one op per output.
    return math.prod(out)


def _output_shape(layer: keras.layers.Layer, input_shape: Shape | None) -> Shape:
    """The first output shape of `layer`, found as the module docstring says."""
    try:
        # Multi-output layers (attention returning its scores too): the first.
        return tuple(keras.tree.flatten(layer.output)[0].shape)
    except AttributeError:
        pass  # never called symbolically: no functional history
    recorded = getattr(layer, "_build_shapes_dict", None)
    if recorded:
        inputs = list(recorded.values())
    elif input_shape is not None:
        inputs = [input_shape]
    else:
        raise ValueError(
            f"Layer {layer.name!r} has no known input or output shape, so its FLOPs "
            f"are unknown; {_BUILD_HINT}."
        )
    try:
        # Keras names build's and compute_output_shape's arguments alike and
        # in the same order (input_shape; query_shape, value_shape, ...).
        shape = layer.compute_output_shape(*inputs)
    except (NotImplementedError, TypeError, ValueError) as error:
        raise ValueError(
            f"Layer {layer.name!r} cannot compute its output shape from {inputs}, so "
            f"its FLOPs are unknown; call the model on keras.Input. ({error})"
        ) from error
    return tuple(shape[0] if shape and isinstance(shape[0], (tuple, list)) else shape)
