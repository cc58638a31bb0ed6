"""`tfmp.auto_layout`: a Megatron-style LayoutMap planned from a Keras model.

The plan, as a reader would write it by hand:

| layer                         | layout                                          |
|-------------------------------|-------------------------------------------------|
| Embedding                     | table split on the vocabulary                   |
| MultiHeadAttention            | query/key/value split on heads, output on heads |
| Dense, then Dense             | first column-parallel, second row-parallel      |
| last Dense, vocabulary wide   | column-parallel (split on the vocabulary)       |
| anything else                 | replicated (norms, biases of row layers, convs) |

Layers without weights between two Dense layers (activations, dropout) keep
them a pair; a layer with weights in between breaks the pair. A dimension that
does not divide by the axis size is left whole, with the reason recorded.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Iterable

import keras

from tfmp.layout import Axes, LayoutMap
from tfmp.mesh import as_device_mesh


@dataclasses.dataclass
class _Plan:
    """Rules and reasons collected while walking the layers in order."""

    axis: str
    size: int
    rules: dict[str, Axes] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    vocabularies: set[int] = dataclasses.field(default_factory=set)
    column: Any = None  # a Dense waiting for its row-parallel partner
    last_dense: Any = None  # the model's output Dense: maybe a vocabulary head

    def split(self, variable: Any, dim: int, why: str) -> bool:
        """Splits `variable` on `dim` if that divides; records why not."""
        size = int(variable.shape[dim])
        if size % self.size:
            self.reasons[variable.path] = (
                f"{why}: dimension {dim} of size {size} does not divide by "
                f"{self.axis!r} of size {self.size}; left replicated"
            )
            return False
        axes = [None] * len(variable.shape)
        axes[dim] = self.axis
        self.rules[variable.path] = tuple(axes)
        return True

    def keep(self, layer: Any, why: str) -> None:
        """Records why the layer's weights that are not split stay whole."""
        for variable in layer.weights:
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


def leaf_layers(model: Any) -> list[Any]:
    """The model's layers in call order, nested models opened."""
    layers = []
    for layer in model.layers:
        layers += leaf_layers(layer) if isinstance(layer, keras.Model) else [layer]
    return layers


def plan_layers(layers: Iterable[Any], axis: str, size: int) -> _Plan:
    """Walks layers in call order and plans the layout of their weights."""
    from tfmp.layers.declaring import DeclaresLayouts

    layers = list(layers)
    plan = _Plan(axis, size)
    denses = [layer for layer in layers if isinstance(layer, keras.layers.Dense)]
    plan.last_dense = denses[-1] if denses else None
    for layer in layers:
        if not layer.weights:
            continue  # activations, dropout, adds: a Dense pair stays a pair
        if isinstance(layer, DeclaresLayouts):
            _end_pair(plan)
            plan.keep(layer, "a tfmp layer: declares its own layouts")
        elif isinstance(layer, keras.layers.Embedding):
            _end_pair(plan)
            plan.vocabularies.add(layer.input_dim)
            plan.split(layer.embeddings, 0, "embedding split on the vocabulary")
        elif isinstance(layer, keras.layers.MultiHeadAttention):
            _end_pair(plan)
            _plan_attention(plan, layer)
        elif isinstance(layer, keras.layers.Dense):
            _plan_dense(plan, layer)
        else:
            _end_pair(plan)
            plan.keep(layer, _replicated_reason(layer))
    _end_pair(plan)
    return plan


def _plan_dense(plan: _Plan, layer: Any) -> None:
    if plan.column is not None:
        column, plan.column = plan.column, None
        if plan.split(layer.kernel, 0, "row-parallel Dense after a column-parallel one"):
            _split_column(plan, column)
            plan.keep(layer, "bias of a row-parallel Dense: added once, replicated")
        else:
            plan.keep(column, "its row-parallel partner could not be split")
        return
    if layer is plan.last_dense and layer.units in plan.vocabularies:
        _split_column(plan, layer, "vocabulary head split on the vocabulary")
        return
    plan.column = layer


def _split_column(plan: _Plan, layer: Any, why: str = "column-parallel Dense") -> None:
    if plan.split(layer.kernel, 1, why) and layer.use_bias:
        plan.split(layer.bias, 0, why)


def _end_pair(plan: _Plan) -> None:
    if plan.column is not None:
        plan.keep(plan.column, "no Dense follows it to make a column/row pair")
        plan.column = None


def _plan_attention(plan: _Plan, layer: Any) -> None:
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


def _replicated_reason(layer: Any) -> str:
    if isinstance(layer, keras.layers.Conv2D):
        return (
            "DTensor's Conv2D needs whole kernels; use tfmp.layers.ParallelConv2D "
            "to split a convolution"
        )
    return f"{type(layer).__name__}: small or not splittable, replicated"
