"""`tfmp.auto_layout`: a Megatron-style LayoutMap planned from a Keras model.

The plan, as a reader would write it by hand:

| layer                                  | layout                                       |
|----------------------------------------|----------------------------------------------|
| Embedding (and KerasHub's reversible)  | table split on the vocabulary                |
| MultiHeadAttention                     | query/key/value split on heads, output too   |
| EinsumDense into heads (q, k, v)       | split on the heads letter of its equation    |
| EinsumDense out of heads               | split on the contracted heads letter         |
| Dense / 2-D EinsumDense / Conv, paired | first column-parallel (outputs), next row-   |
|                                        | parallel (inputs); siblings with the same    |
|                                        | shape (a gate and its up-projection) all     |
|                                        | column-parallel before their row partner     |
| last Dense, vocabulary wide            | column-parallel (split on the vocabulary)    |
| DepthwiseConv, SeparableConv           | split on channels (no communication)          |
| LSTM, GRU, SimpleRNN, ConvLSTM cells   | split on gate units                          |
| anything else                          | replicated (norms, biases of row layers)     |

Layers are visited in call order in models and in the order they were
created inside other layers (KerasHub blocks, custom layers), so a block's
projections pair as written. Layers without weights between two Dense layers
(activations, dropout) keep them a pair; a layer with weights in between
breaks the pair. A dimension that does not divide by the axis size is left
whole, with the reason recorded. Every layout planned here is one tfmp runs
(through `tfmp.lowering` where DTensor needs help).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, Iterable, Iterator

import keras

from tfmp.layout import Axes, LayoutMap
from tfmp.mesh import as_device_mesh


@dataclasses.dataclass
class _Projection:
    """A layer that maps `inputs` features to `outputs` features through a
    kernel whose input and output dimensions are `in_dim` and `out_dim`."""

    layer: Any
    kernel: Any
    in_dim: int
    out_dim: int

    @property
    def inputs(self) -> int:
        return int(self.kernel.shape[self.in_dim])

    @property
    def outputs(self) -> int:
        return int(self.kernel.shape[self.out_dim])


@dataclasses.dataclass
class _Plan:
    """Rules and reasons collected while walking the layers in order."""

    axis: str
    size: int
    rules: dict[str, Axes] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    vocabularies: set[int] = dataclasses.field(default_factory=set)
    columns: list[_Projection] = dataclasses.field(default_factory=list)  # awaiting a row partner
    last_dense: Any = None  # the model's output Dense: maybe a vocabulary head

    def divides(self, variable: Any, dim: int) -> bool:
        return int(variable.shape[dim]) % self.size == 0

    def split(self, variable: Any, dim: int, why: str) -> bool:
        """Splits `variable` on `dim` if that divides; records why not."""
        dim = dim % len(variable.shape)
        if not self.divides(variable, dim):
            self.reasons[variable.path] = (
                f"{why}: dimension {dim} of size {int(variable.shape[dim])} does not "
                f"divide by {self.axis!r} of size {self.size}; left replicated"
            )
            return False
        axes = [None] * len(variable.shape)
        axes[dim] = self.axis
        self.rules[variable.path] = tuple(axes)
        return True

    def keep(self, layer: Any, why: str, own_only: bool = False) -> None:
        """Records why the layer's weights that are not split stay whole."""
        weights = _own_weights(layer) if own_only else layer.weights
        for variable in weights:
            if variable.path not in self.rules:
                self.reasons.setdefault(variable.path, why)


def auto_layout(model: Any, mesh: Any, axis: str = "model") -> LayoutMap:
    """Plans Megatron-style tensor-parallel layouts for a Keras model.

    Args:
        model: A built Keras model (or one with known input shapes).
        mesh: The `tfmp.DeviceMesh` the layouts are for.
        axis: The mesh axis to split weights over.

    Returns:
        A `tfmp.LayoutMap` with one rule per split variable, matching exactly
        its path (`^path$`).
        `layout_map.reasons` says, per variable left whole, why.

    Examples:
        >>> layout_map = tfmp.auto_layout(model, mesh)  # doctest: +SKIP
        >>> strategy = tfmp.ModelParallelStrategy(mesh, layout_map)  # doctest: +SKIP
        >>> with strategy.scope():  # same layer names, so the rules match
        ...     model = keras.Model.from_config(model.get_config())  # doctest: +SKIP
    """
    mesh = as_device_mesh(mesh)
    mesh.check_axis(axis, what="auto_layout axis")
    if not model.built:
        raise ValueError(
            f"auto_layout needs a built model; {model.name!r} has no weights yet. "
            "Give it a keras.Input or call model.build(input_shape) first."
        )
    plan = plan_layers(leaf_layers(model), axis, mesh.axis_size(axis))
    layout_map = LayoutMap(mesh)
    for path, axes in plan.rules.items():
        # Anchored: "proj/kernel" must not also match "out_proj/kernel".
        layout_map[f"^{re.escape(path)}$"] = axes
    layout_map.reasons = plan.reasons
    undivided = [path for path, why in plan.reasons.items() if "does not divide" in why]
    if undivided:
        warnings.warn(
            f"tfmp: auto_layout left {undivided} replicated: their split dimension "
            f"does not divide by {axis!r}. See layout_map.reasons.",
            stacklevel=2,
        )
    return layout_map


def leaf_layers(layer: Any) -> list[Any]:
    """The layers the plan visits: those it has a rule for, and the layers
    of others opened (models in call order, other layers in the order they
    made their sublayers). A layer with weights of its own is visited too."""
    return list(_leaves(layer))


def _leaves(layer: Any) -> Iterator[Any]:
    children = layer.layers if isinstance(layer, keras.Model) else _sublayers(layer)
    for child in children:
        if _planner(child) is not None or not _sublayers(child):
            yield child
            continue
        if _own_weights(child):
            yield child
        yield from _leaves(child)


def _sublayers(layer: Any) -> list[Any]:
    return list(layer._flatten_layers(include_self=False, recursive=False))  # noqa: SLF001


def _own_weights(layer: Any) -> list[Any]:
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)  # noqa: SLF001


def plan_layers(layers: Iterable[Any], axis: str, size: int) -> _Plan:
    """Walks layers in order and plans the layout of their weights."""
    layers = list(layers)
    plan = _Plan(axis, size)
    denses = [layer for layer in layers if isinstance(layer, keras.layers.Dense)]
    plan.last_dense = denses[-1] if denses else None
    for layer in layers:
        if not layer.weights:
            continue  # activations, dropout, adds: a Dense pair stays a pair
        planner = _planner(layer)
        if planner is None:
            _end_pair(plan)
            plan.keep(layer, _replicated_reason(layer), own_only=bool(_sublayers(layer)))
        else:
            planner(plan, layer)
    _end_pair(plan)
    return plan


# Projections: Dense, 2-D EinsumDense, convolutions -------------------------


def _plan_projection(plan: _Plan, projection: _Projection) -> None:
    layer = projection.layer
    if plan.columns and projection.inputs == plan.columns[0].outputs:
        columns, plan.columns = plan.columns, []
        if plan.split(projection.kernel, projection.in_dim, "row-parallel after column-parallel"):
            for column in columns:
                _split_column(plan, column)
            plan.keep(layer, "bias of a row-parallel layer: added once, replicated")
        else:
            for column in columns:
                plan.keep(column.layer, "its row-parallel partner could not be split")
        return
    if plan.columns and (projection.inputs, projection.outputs) == (
        plan.columns[0].inputs,
        plan.columns[0].outputs,
    ):
        plan.columns.append(projection)  # a sibling: gate and up-projection
        return
    _end_pair(plan)
    if layer is plan.last_dense and projection.outputs in plan.vocabularies:
        _split_column(plan, projection, "vocabulary head split on the vocabulary")
        return
    plan.columns = [projection]


def _split_column(plan: _Plan, column: _Projection, why: str = "column-parallel") -> None:
    if plan.split(column.kernel, column.out_dim, why):
        bias = getattr(column.layer, "bias", None)
        if bias is not None and len(bias.shape) == 1:
            plan.split(bias, 0, why)


def _end_pair(plan: _Plan) -> None:
    for column in plan.columns:
        plan.keep(column.layer, "no Dense follows it to make a column/row pair")
    plan.columns = []


def _plan_dense(plan: _Plan, layer: Any) -> None:
    _plan_projection(plan, _Projection(layer, layer.kernel, 0, 1))


def _plan_conv(plan: _Plan, layer: Any) -> None:
    if getattr(layer, "groups", 1) != 1:
        _end_pair(plan)
        plan.keep(layer, "grouped convolution: replicated")
        return
    transpose = isinstance(layer, _TRANSPOSED_CONVS)
    # Keras kernels: (..., in, out); transposed convolutions: (..., out, in).
    _plan_projection(plan, _Projection(layer, layer.kernel, -1 if transpose else -2, -2 if transpose else -1))


def _plan_depthwise(plan: _Plan, layer: Any) -> None:
    """Depthwise and separable convolutions split their channels: each device
    convolves its own channels, no communication."""
    _end_pair(plan)
    kernel = layer.kernel if isinstance(layer, _DEPTHWISE_ONLY) else layer.depthwise_kernel
    why = "depthwise convolution split on channels"
    if plan.split(kernel, -2, why):
        pointwise = getattr(layer, "pointwise_kernel", None)
        if pointwise is not None:
            plan.split(pointwise, -2, "pointwise convolution, row-parallel by channels")
        elif getattr(layer, "bias", None) is not None:
            plan.split(layer.bias, 0, why)
    plan.keep(layer, "bias of a separable convolution: added once, replicated")


# EinsumDense by its equation ------------------------------------------------


def _plan_einsum(plan: _Plan, layer: Any) -> None:
    inputs, kernel, output = _einsum_letters(layer.equation)
    out_only = [i for i, letter in enumerate(kernel) if letter in output and letter not in inputs]
    contracted = [i for i, letter in enumerate(kernel) if letter in inputs and letter not in output]
    if len(kernel) == 2 and len(out_only) == 1 and len(contracted) == 1:
        _plan_projection(plan, _Projection(layer, layer.kernel, contracted[0], out_only[0]))
        return
    _end_pair(plan)
    if len(out_only) >= 2:  # into heads: (hidden, heads, head_dim)
        why = "projection into attention heads, split on heads"
        if plan.split(layer.kernel, out_only[0], why):
            _split_einsum_bias(plan, layer, kernel[out_only[0]], why)
    elif len(contracted) >= 2:  # out of heads: (heads, head_dim, hidden)
        plan.split(layer.kernel, contracted[0], "projection out of attention heads, row-parallel")
    plan.keep(layer, f"EinsumDense {layer.equation!r}: no heads or feature split found")


def _split_einsum_bias(plan: _Plan, layer: Any, letter: str, why: str) -> None:
    """Splits the bias on the same letter as the kernel, if it has it."""
    bias = getattr(layer, "bias", None)
    bias_axes = getattr(layer, "bias_axes", None) or ""
    if bias is not None and letter in bias_axes:
        plan.split(bias, bias_axes.index(letter), why)


def _einsum_letters(equation: str) -> tuple[str, str, str]:
    operands, output = equation.replace("...", "").split("->")
    inputs, kernel = operands.split(",")
    return inputs, kernel, output


# Attention, embeddings, recurrent cells -------------------------------------


def _plan_embedding(plan: _Plan, layer: Any) -> None:
    _end_pair(plan)
    plan.vocabularies.add(layer.input_dim)
    why = "embedding split on the vocabulary"
    plan.split(layer.embeddings, 0, why)
    for variable in layer.weights:
        # KerasHub's untied output projection, (hidden, vocabulary).
        if variable is not layer.embeddings and layer.input_dim in variable.shape:
            plan.split(variable, list(variable.shape).index(layer.input_dim), why)
    plan.keep(layer, "an embedding's other weights stay whole")


def _plan_attention(plan: _Plan, layer: Any) -> None:
    _end_pair(plan)
    if layer.num_heads % plan.size:
        plan.keep(
            layer,
            f"num_heads {layer.num_heads} does not divide by {plan.axis!r} of size "
            f"{plan.size}; left replicated",
        )
        return
    for dense in (layer._query_dense, layer._key_dense, layer._value_dense):  # noqa: SLF001
        plan.split(dense.kernel, 1, "attention heads")
        if dense.bias is not None:
            plan.split(dense.bias, 0, "attention heads")
    output = layer._output_dense  # noqa: SLF001
    plan.split(output.kernel, 0, "attention output projection, row-parallel by heads")
    plan.keep(layer, "attention output bias: added once, replicated")


def _plan_recurrent(plan: _Plan, layer: Any) -> None:
    """A recurrent layer's cell(s): kernels and biases split on gate units."""
    _end_pair(plan)
    why = "recurrent cell split on gate units"
    for variable in layer.weights:
        name = variable.path.rsplit("/", 1)[-1]
        if name in ("kernel", "recurrent_kernel", "bias"):
            plan.split(variable, -1, why)
    plan.keep(layer, "recurrent layer weight outside its cell's kernels")


def _plan_declared(plan: _Plan, layer: Any) -> None:
    _end_pair(plan)
    plan.keep(layer, "a tfmp layer: declares its own layouts")


_TRANSPOSED_CONVS = (
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
)
_DEPTHWISE_ONLY = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_DEPTHWISE = _DEPTHWISE_ONLY + (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
_RECURRENT = (
    keras.layers.LSTM,
    keras.layers.GRU,
    keras.layers.SimpleRNN,
    keras.layers.ConvLSTM1D,
    keras.layers.ConvLSTM2D,
    keras.layers.ConvLSTM3D,
)


def _planner(layer: Any) -> Callable[[_Plan, Any], None] | None:
    """The rule for a layer's weights, or None (open it, or replicate it).
    Order matters: the most specific classes first."""
    # tfmp's layers (which build on this module) declare their layouts
    # through `weight_layouts()`.
    if callable(getattr(layer, "weight_layouts", None)):
        return _plan_declared
    table: tuple[tuple[Any, Callable[[_Plan, Any], None]], ...] = (
        (keras.layers.Embedding, _plan_embedding),
        (keras.layers.MultiHeadAttention, _plan_attention),
        (keras.layers.EinsumDense, _plan_einsum),
        (keras.layers.Dense, _plan_dense),
        (_DEPTHWISE, _plan_depthwise),
        (_RECURRENT, _plan_recurrent),
        (keras.layers.Bidirectional, _plan_recurrent),
        (keras.layers.RNN, _plan_recurrent),
        (_convolutions(), _plan_conv),
    )
    for kinds, planner in table:
        if isinstance(layer, kinds):
            return planner
    return None


def _convolutions() -> tuple[type, ...]:
    from keras.src.layers.convolutional.base_conv import BaseConv
    from keras.src.layers.convolutional.base_conv_transpose import BaseConvTranspose

    return (BaseConv, BaseConvTranspose)


def _replicated_reason(layer: Any) -> str:
    return f"{type(layer).__name__}: small or not splittable, replicated"
