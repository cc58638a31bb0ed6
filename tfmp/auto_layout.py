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
| Dense out of merged heads              | row-parallel, split by heads                 |
| BatchNorm, DepthwiseConv in a pair     | split on channels with the pair              |
| last Dense, vocabulary wide            | column-parallel (split on the vocabulary)    |
| SeparableConv                          | depthwise on channels, pointwise row-parallel|
| mixture-of-experts bank                | split on experts                             |
| LSTM, GRU, SimpleRNN, ConvLSTM cells   | split on gate units                          |
| any other weight of rank 2 or more     | stored split on its largest dimension,       |
|                                        | gathered on use (`tfmp.gather_on_use`)       |
| anything else                          | replicated (norms, biases of row layers)     |

Layers are visited in call order in functional models (their ops too) and in
the order they were created inside other layers (KerasHub blocks, custom
layers), so a block's projections pair as written. A pair is two layers of
one block, or of two sibling blocks. Layers without weights between them
(activations, dropout) keep them a pair; a layer with weights in between
(other than a per-channel one), a pooling or a resize (visited, or called by
the block), breaks it, as DTensor pools and resizes only a batch split. A
dimension that does not divide by the axis size is left whole, with the
reason recorded. Every layout planned here is one tfmp runs (through
`tfmp.lowering` where DTensor needs help).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import warnings
from typing import Any, Callable, Iterable, Iterator

import keras

from tfmp.integrations.internals import (
    AveragePool,
    BaseConv,
    BaseConvTranspose,
    BasePooling,
    Functional,
    MaxPool,
    Resize,
)
from tfmp.layout import Axes, LayoutMap, gather_on_use
from tfmp.layout_decision import is_floating_point
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
    # Where mixture-of-experts banks split on their experts.
    expert_axis: str = ""
    expert_size: int = 0
    rules: dict[str, Axes] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    # The weights of layers that declare their own layouts (tfmp's layers).
    declared: set[str] = dataclasses.field(default_factory=set)
    vocabularies: set[int] = dataclasses.field(default_factory=set)
    columns: list[_Projection] = dataclasses.field(default_factory=list)  # awaiting a row partner
    channelwise: list[Any] = dataclasses.field(default_factory=list)  # between columns and row
    columns_in: tuple[Any, ...] = ()  # the blocks the columns are in, outermost first
    step: Any = None  # the _Visit being planned
    pooled: bool = False  # a pooling or resize since the last projection
    last_dense: Any = None  # the model's output Dense: maybe a vocabulary head
    # Projections into heads just split: their block, and (heads, heads x
    # head features) of each; `heads_before` as the layer visited found them.
    heads_in: tuple[Any, ...] = ()
    heads_widths: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    heads_before: tuple[tuple[Any, ...], set[tuple[int, int]]] = ((), set())

    def split(self, variable: Any, dim: int, why: str, experts: bool = False) -> bool:
        """Splits `variable` on `dim` over the plan's axis (its expert axis,
        `experts`) if that divides; records why not, and why the expert axis
        where it is not the plan's."""
        axis, size = (self.expert_axis, self.expert_size) if experts else (self.axis, self.size)
        dim = dim % len(variable.shape)
        if int(variable.shape[dim]) % size:
            self.reasons[variable.path] = (
                f"{why}: dimension {dim} of size {int(variable.shape[dim])} does not "
                f"divide by {axis!r} of size {size}; left replicated"
            )
            return False
        axes = [None] * len(variable.shape)
        axes[dim] = axis
        self.rules[variable.path] = tuple(axes)
        if axis != self.axis:
            self.reasons[variable.path] = f"{why} over {axis!r}, the mesh's expert axis"
        return True

    def keep(self, layer: Any, why: str, own_only: bool = False) -> None:
        """Records why the layer's weights that are not split stay whole."""
        weights = _own_weights(layer) if own_only else layer.weights
        for variable in weights:
            if variable.path not in self.rules:
                self.reasons.setdefault(variable.path, why)


def auto_layout(
    model: Any, mesh: Any, axis: str = "model", storage_split: bool = True, expert_axis: str | None = None
) -> LayoutMap:
    """Plans Megatron-style tensor-parallel layouts for a Keras model.

    Args:
        model: A built Keras model (or one with known input shapes).
        mesh: The `tfmp.DeviceMesh` the layouts are for.
        axis: The mesh axis to split weights over.
        storage_split: Also split, for memory only, every floating-point
            weight of rank 2 or more that no tensor-parallel layout splits
            (a patch embedding, a convolution between norms): stored split
            over `axis` on its largest dimension that divides, and gathered
            on use (`tfmp.gather_on_use`), one all-gather per forward pass.
        expert_axis: The mesh axis to split mixture-of-experts banks over,
            on their experts: by default the mesh's axis whose name holds
            "expert" (`"expert"`, `"experts"`), if it has one, else `axis`.
            Each device of it holds whole experts and computes them for the
            tokens it holds; their outputs are summed over the axis.

    Returns:
        A `tfmp.LayoutMap` with one rule per split variable, matching exactly
        its path (`^path$`).
        `layout_map.reasons` says, per variable not split for compute, why
        (and for a bank split over an expert axis other than `axis`, so).

    Examples:
        >>> layout_map = tfmp.auto_layout(model, mesh)
        >>> strategy = tfmp.ModelParallelStrategy(mesh, layout_map)
        >>> with strategy.scope():  # same layer names, so the rules match
        ...     model = keras.models.clone_model(model)
        >>> model.get_layer("dense").kernel.value.layout.sharding_specs
        ['unsharded', 'model']
    """
    mesh = as_device_mesh(mesh)
    mesh.check_axis(axis, what="auto_layout axis")
    if not has_weights(model):
        raise ValueError(
            f"auto_layout needs a built model; {model.name!r} has no weights yet. "
            "Give it a keras.Input or call model.build(input_shape) first."
        )
    expert_axis = expert_axis or next((name for name in mesh.axis_names if "expert" in name.lower()), axis)
    mesh.check_axis(expert_axis, what="auto_layout expert_axis")
    plan = plan_layers(visits(model), axis, mesh.axis_size(axis), expert_axis, mesh.axis_size(expert_axis))
    shapes = _shapes_by_path(model.weights)
    _drop_rules_of_shared_paths(plan, shapes)
    if storage_split:
        _split_storage(plan, model.weights, shapes)
    layout_map = LayoutMap(mesh)
    for path, axes in plan.rules.items():
        # Anchored: "proj/kernel" must not also match "out_proj/kernel".
        layout_map[f"^{re.escape(path)}$"] = axes
    layout_map.reasons = plan.reasons
    undivided = [
        path for path, why in plan.reasons.items()
        if "does not divide" in why and path not in plan.rules
    ]
    if undivided:
        warnings.warn(
            f"tfmp: auto_layout left {undivided} replicated: their split dimension "
            f"does not divide by {axis!r}. See layout_map.reasons.",
            stacklevel=2,
        )
    return layout_map


def has_weights(model: Any) -> bool:
    """Whether every weight of `model` exists: it is built, or it is a
    subclassed model that only wraps built models and layers (a VAE's encoder
    and decoder, a GAN's generator and discriminator, with their own
    `train_step` and often no `call`). Keras on JAX lays such a model out
    from its sub-models' variables; a `build` of its own would make more."""
    if model.built:
        return True
    layers = _sublayers(model)
    builds_own_weights = type(model).build is not keras.Model.build
    return bool(layers) and not builds_own_weights and all(layer.built for layer in layers)


def _drop_rules_of_shared_paths(plan: _Plan, shapes: dict[str, set[tuple[int, ...]]]) -> None:
    """A rule names a path, and it lays out every variable with that path.
    Two sub-models may give variables the same path (CLIP's vision and text
    towers both have `encoder_block_0/...`): their rule stays only if it
    fits every shape they have."""
    for path, axes in list(plan.rules.items()):
        misfits = sorted(shape for shape in shapes[path] if not _fits(axes, shape, plan.size))
        if misfits:
            del plan.rules[path]
            plan.reasons[path] = (
                f"path shared by variables of shapes {sorted(shapes[path])}: the rule "
                f"{axes} does not fit {misfits}; left replicated"
            )


def _split_storage(
    plan: _Plan, weights: Iterable[Any], shapes: dict[str, set[tuple[int, ...]]]
) -> None:
    """Gives each floating-point weight of rank 2 or more that has no rule a
    `gather_on_use` layout over the plan's axis, on its largest dimension
    that divides (in every variable sharing its path, `shapes`)."""
    for variable in weights:
        path, rank = variable.path, len(variable.shape)
        if path in plan.rules or path in plan.declared or rank < 2 or not is_floating_point(variable.dtype):
            continue
        if {len(shape) for shape in shapes[path]} != {rank}:
            continue
        dims = [dim for dim in range(rank) if all(shape[dim] % plan.size == 0 for shape in shapes[path])]
        if not dims:
            continue
        dim = max(dims, key=lambda dim: (int(variable.shape[dim]), -dim))
        axes = [None] * rank
        axes[dim] = plan.axis
        plan.rules[path] = gather_on_use(axes)
        why = plan.reasons.get(path, "not split for compute")
        plan.reasons[path] = f"{why}; stored split on dimension {dim}, gathered on use"


def _shapes_by_path(weights: Iterable[Any]) -> dict[str, set[tuple[int, ...]]]:
    shapes: dict[str, set[tuple[int, ...]]] = {}
    for variable in weights:
        shapes.setdefault(variable.path, set()).add(tuple(int(size) for size in variable.shape))
    return shapes


def _fits(axes: Axes, shape: tuple[int, ...], size: int) -> bool:
    return len(axes) == len(shape) and all(
        axis is None or dim % size == 0 for axis, dim in zip(axes, shape)
    )


@dataclasses.dataclass(frozen=True)
class _Visit:
    """A layer the plan visits (in a functional model, an op too), and the
    models and layers it was found in, outermost first."""

    layer: Any
    containers: tuple[Any, ...]


def visits(model: Any) -> list[_Visit]:
    """What the plan visits, in order: the layers it has a rule for, and the
    layers of others opened (functional models' layers and ops in call order,
    other layers' sublayers in the order they were made). A layer with
    weights of its own is visited too."""
    return list(_visits(model))


def _visits(layer: Any, outer: tuple[Any, ...] = ()) -> Iterator[_Visit]:
    containers = outer + (layer,)
    for child in _children(layer):
        opaque = not isinstance(child, keras.layers.Layer) or not _sublayers(child)
        if opaque or _planner(child) is not None:
            yield _Visit(child, containers)
            continue
        if _own_weights(child):
            yield _Visit(child, containers)
        yield from _visits(child, containers)


def _children(layer: Any) -> list[Any]:
    if isinstance(layer, Functional):
        return list(layer._operations)  # noqa: SLF001  (its ops too: a resize is one)
    if isinstance(layer, keras.Model):
        return list(layer.layers)
    return _sublayers(layer)


def _may_pair(columns_in: tuple[Any, ...], row_in: tuple[Any, ...], square: bool) -> bool:
    """A column and its row partner are two layers of one block, or of two
    sibling blocks (DeiT's `mlp` and `output_layer`). Made in order but
    further apart, they are often not one after the other in the data:
    DepthAnything's neck makes, in a row, convolutions of its fusion stages.
    Sibling blocks a block keeps in a list are parallel branches or a chain,
    and a square column's run (see `_end_pair`) stays in its block."""
    if columns_in == row_in:
        return True
    if square:
        return False
    siblings = len(columns_in) == len(row_in) and columns_in[:-1] == row_in[:-1]
    return (
        siblings
        and not _listed(columns_in[-1], columns_in[-2])
        and not _listed(row_in[-1], row_in[-2])
    )


def _listed(layer: Any, container: Any) -> bool:
    """Whether `container` keeps `layer` in a list or dict attribute (an FPN's
    per-level convolutions): such layers are parallel branches, or a chain,
    in an order the plan cannot see, so they pair with nothing."""
    for name, value in vars(container).items():
        if name.startswith("_") or not isinstance(value, (list, tuple, dict)):
            continue
        items = value.values() if isinstance(value, dict) else value
        if any(item is layer for item in items):
            return True
    return False


def _blocks_around(columns_in: tuple[Any, ...], row_in: tuple[Any, ...]) -> tuple[Any, ...]:
    """The blocks whose `call` runs what lies between a column and its row:
    their one block, or their two sibling blocks and the parent calling both."""
    if columns_in == row_in:
        return columns_in[-1:]
    return columns_in[-2:] + row_in[-1:]


def _hides_whole_channel_ops(containers: Iterable[Any]) -> bool:
    """Whether one of these blocks' `call` pools or resizes (itself or in a
    function it calls): the plan does not see those ops, and a pair around
    them would hand them split channels (DepthAnything's head resizes
    between two convolutions). A functional model's ops are visited instead."""
    return any(
        not _is_graph(container) and _calls_whole_channel_op(type(container).call)
        for container in containers
    )


_WHOLE_CHANNEL_CALL = re.compile(r"resize\w*|(max|avg|average)_pool\w*")


@functools.lru_cache(maxsize=None)
def _calls_whole_channel_op(function: Any, depth: int = 1) -> bool:
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    for name in code.co_names:
        if _WHOLE_CHANNEL_CALL.fullmatch(name):
            return True
        helper = function.__globals__.get(name)
        if depth and inspect.isfunction(helper) and _calls_whole_channel_op(helper, depth - 1):
            return True
    return False


def _is_graph(layer: Any) -> bool:
    """A functional or Sequential model: every op between two of its layers
    is one of its layers or ops, which the plan sees."""
    return isinstance(layer, (Functional, keras.Sequential))


def _sublayers(layer: Any) -> list[Any]:
    return list(layer._flatten_layers(include_self=False, recursive=False))  # noqa: SLF001


def _own_weights(layer: Any) -> list[Any]:
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)  # noqa: SLF001


def plan_layers(
    steps: Iterable[_Visit], axis: str, size: int, expert_axis: str | None = None, expert_size: int = 0
) -> _Plan:
    """Walks layers in order and plans the layout of their weights (the
    banks of a mixture of experts over `expert_axis`, else `axis`)."""
    steps = list(steps)
    plan = _Plan(axis, size, expert_axis or axis, expert_size or size)
    # The output head is the last layer with weights; a vocabulary-wide Dense
    # before other layers (PaliGemma's image projection is as wide as its
    # patch positions) feeds them, and would hand them split features.
    weighted = [step.layer for step in steps if getattr(step.layer, "weights", None)]
    if weighted and isinstance(weighted[-1], keras.layers.Dense):
        plan.last_dense = weighted[-1]
    for step in steps:
        layer, plan.step = step.layer, step
        if plan.columns and not _may_pair(plan.columns_in, step.containers, _square(plan.columns[0])):
            _end_pair(plan)  # past its block: what comes next is not its partner
        if _needs_whole_channels(layer):
            _end_pair(plan)  # DTensor pools and resizes a batch split only
            plan.pooled = True
        if not getattr(layer, "weights", None):
            continue  # activations, dropout, adds: a Dense pair stays a pair
        # Only projections into heads follow one another and keep a run of
        # them open; any other layer with weights ends it.
        plan.heads_before = (plan.heads_in, plan.heads_widths)
        plan.heads_in, plan.heads_widths = (), set()
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
    plan.pooled = False  # its output's layout is its own, whatever follows
    if _reads_merged_heads(plan, projection):
        _end_pair(plan)
        plan.split(projection.kernel, projection.in_dim, "projection out of attention heads, row-parallel")
        plan.keep(layer, "attention output bias: added once, replicated")
        return
    if len(plan.step.containers) > 1 and _listed(layer, plan.step.containers[-1]):
        _end_pair(plan)
        plan.keep(layer, "one of a list of layers (parallel branches or a chain): no partner")
        return
    if plan.columns and _reads_columns(plan, projection):
        columns, channelwise = plan.columns, plan.channelwise
        plan.columns, plan.channelwise = [], []
        _pair(plan, columns, channelwise, projection, plan.step.containers)
        return
    if plan.columns and (projection.inputs, projection.outputs) == (
        plan.columns[0].inputs,
        plan.columns[0].outputs,
    ):
        plan.columns.append(projection)  # a sibling: gate and up-projection
        return
    if plan.columns and _deferring(plan) and projection.inputs == plan.columns[0].inputs:
        plan.columns.append(projection)  # a grouped-query key or value
        return
    _end_pair(plan)
    if layer is plan.last_dense and projection.outputs in plan.vocabularies:
        _split_column(plan, projection, "vocabulary head split on the vocabulary")
        return
    plan.columns, plan.columns_in = [projection], plan.step.containers


def _reads_columns(plan: _Plan, projection: _Projection) -> bool:
    """Whether `projection` reads the pending columns' output: their row
    partner. In a functional model the graph says. In a block only sizes do,
    and a column as wide as its input leaves it open: the next projection of
    the same size may read the same input (plain-Dense attention's query,
    key, value, output); `_end_pair` settles such a run."""
    column = plan.columns[0]
    if projection.inputs != column.outputs:
        return False
    if plan.columns_in == plan.step.containers and _is_graph(plan.step.containers[-1]):
        return _feeds([c.layer for c in plan.columns], projection.layer, plan.channelwise)
    return column.inputs != column.outputs


def _pair(
    plan: _Plan,
    columns: list[_Projection],
    channelwise: list[Any],
    row: _Projection,
    row_in: tuple[Any, ...],
) -> None:
    """Columns split on outputs, the per-channel layers between on channels,
    the row on inputs: all of them, or none."""
    if _hides_whole_channel_ops(_blocks_around(plan.columns_in, row_in)):
        for pending in [column.layer for column in columns] + channelwise + [row.layer]:
            plan.keep(pending, "its block pools or resizes between column and row: replicated")
        return
    if not plan.split(row.kernel, row.in_dim, "row-parallel after column-parallel"):
        for pending in [column.layer for column in columns] + channelwise:
            plan.keep(pending, "its row-parallel partner could not be split")
        return
    for column in columns:
        _split_column(plan, column)
    for between in channelwise:
        for variable in between.weights:
            dim = _channel_dim(variable, columns[0].outputs)
            plan.split(variable, dim, "per-channel layer between column and row")
    plan.keep(row.layer, "bias of a row-parallel layer: added once, replicated")


def _feeds(sources: list[Any], layer: Any, through: list[Any]) -> bool:
    """Whether, in a functional model, `layer` reads the output of one of
    `sources` through ops without weights (or layers in `through`)."""
    seen: set[int] = set()
    pending = [node for node in layer._inbound_nodes]  # noqa: SLF001
    while pending:
        node = pending.pop()
        for tensor in node.arguments.keras_tensors:
            operation = tensor._keras_history.operation  # noqa: SLF001
            if any(operation is source for source in sources):
                return True
            if id(operation) in seen or (
                getattr(operation, "weights", None) and not any(operation is t for t in through)
            ):
                continue
            seen.add(id(operation))
            pending.extend(operation._inbound_nodes)  # noqa: SLF001
    return False


def _split_column(plan: _Plan, column: _Projection, why: str = "column-parallel") -> None:
    if plan.split(column.kernel, column.out_dim, why):
        bias = getattr(column.layer, "bias", None)
        if bias is not None and len(bias.shape) == 1:
            plan.split(bias, 0, why)


def _end_pair(plan: _Plan) -> None:
    columns, channelwise = plan.columns, plan.channelwise
    plan.columns, plan.channelwise = [], []
    if _square_run(plan, columns):
        # Query, key, value and output of a plain-Dense attention (or gate,
        # up and down of a gated MLP as wide as its input), made in that
        # order: all but the last read one input, the last reads them.
        _pair(plan, columns[:-1], channelwise, columns[-1], plan.columns_in)
        return
    for pending in [column.layer for column in columns] + channelwise:
        plan.keep(pending, "no Dense follows it to make a column/row pair")


def _square(projection: _Projection) -> bool:
    return projection.inputs == projection.outputs


def _deferring(plan: _Plan) -> bool:
    """Whether the pending columns are a run `_end_pair` settles: they started
    with a projection as wide as its input, in a block (not a functional
    model, whose graph tells siblings from rows), and the plan is still in
    that block."""
    first = plan.columns[0]
    return (
        first.inputs == first.outputs
        and not _is_graph(plan.columns_in[-1])
        and plan.columns_in == plan.step.containers
    )


def _square_run(plan: _Plan, columns: list[_Projection]) -> bool:
    """Projections of one block reading one input as wide as the first's
    output, the last of them back to that width: the last (an attention's
    output projection) reads the others, which read that input (its query,
    key and value)."""
    if len(columns) < 2 or _is_graph(plan.columns_in[-1]):
        return False
    first, last = columns[0], columns[-1]
    return first.inputs == first.outputs == last.inputs == last.outputs


def _plan_channelwise(plan: _Plan, layer: Any) -> None:
    """A layer that treats each channel on its own (BatchNormalization, a
    depthwise convolution) keeps a column/row pair a pair: its weights split
    like the channels it gets. Outside a pair it stays whole, as its split
    output would reach layers that need the channels whole (pooling)."""
    channels = plan.columns[0].outputs if plan.columns else None
    if channels is not None and all(_channel_dim(v, channels) is not None for v in layer.weights):
        plan.channelwise.append(layer)
        return
    _end_pair(plan)
    plan.keep(layer, f"{type(layer).__name__} not between a column/row pair: replicated")


def _channel_dim(variable: Any, channels: int) -> int | None:
    """The dimension of `channels` in a per-channel weight: a vector's only
    one, or a depthwise kernel's (..., channels, 1) input channels."""
    shape = tuple(variable.shape)
    if shape == (channels,):
        return 0
    if len(shape) >= 3 and shape[-2:] == (channels, 1):
        return len(shape) - 2
    return None


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


def _plan_separable(plan: _Plan, layer: Any) -> None:
    """A separable convolution splits its channels: each device convolves its
    own channels, and the pointwise part, row-parallel, sums them. Right
    after a pooling it stays whole: DTensor would split the pooling's output
    channels to feed it (Xception's first separable block)."""
    _end_pair(plan)
    pooled, plan.pooled = plan.pooled, False
    if pooled:
        plan.keep(layer, "reads a pooling's output, which DTensor cannot split: replicated")
        return
    if plan.split(layer.depthwise_kernel, -2, "depthwise convolution split on channels"):
        plan.split(layer.pointwise_kernel, -2, "pointwise convolution, row-parallel by channels")
    plan.keep(layer, "bias of a separable convolution: added once, replicated")


# EinsumDense by its equation ------------------------------------------------


def _plan_einsum(plan: _Plan, layer: Any) -> None:
    inputs, kernel, output = _einsum_letters(layer.equation)
    out_only = [i for i, letter in enumerate(kernel) if letter in output and letter not in inputs]
    contracted = [i for i, letter in enumerate(kernel) if letter in inputs and letter not in output]
    if len(kernel) == 2 and len(out_only) == 1 and len(contracted) == 1:
        _plan_projection(plan, _Projection(layer, layer.kernel, contracted[0], out_only[0]))
        return
    if len(out_only) >= 2:  # into heads: (hidden, heads, head_dim)
        _end_pair(plan)
        why = "projection into attention heads, split on heads"
        if plan.split(layer.kernel, out_only[0], why):
            _split_einsum_bias(plan, layer, kernel[out_only[0]], why)
            heads, head_dim = (kernel[i] for i in out_only[:2])
            if output.index(heads) < output.index(head_dim):  # merged heads-major
                _continue_heads(plan, *(int(layer.kernel.shape[i]) for i in out_only[:2]))
    elif len(contracted) >= 2:  # out of heads: (heads, head_dim, hidden)
        _plan_out_of_heads(plan, layer, contracted[0])
    else:
        _end_pair(plan)
    plan.keep(layer, f"EinsumDense {layer.equation!r}: no heads or feature split found")


def _continue_heads(plan: _Plan, heads: int, features: int) -> None:
    """Records a projection into `heads` heads of `features` each: the run
    of them (query, key, value) in this block goes on."""
    before_in, before_widths = plan.heads_before
    same_block = before_in == plan.step.containers
    plan.heads_in = plan.step.containers
    plan.heads_widths = (before_widths if same_block else set()) | {(heads, heads * features)}


def _reads_merged_heads(plan: _Plan, projection: _Projection) -> bool:
    """Whether `projection`, a Dense or 2-D EinsumDense, comes right after
    projections into heads of its block (nothing with weights between) and
    takes whole heads of one of them, merged: their output projection
    (Falcon's, Bloom's; GPT-NeoX's reads a third of its fused query, key and
    value heads), row-parallel by heads."""
    heads_in, widths = plan.heads_before
    return (
        not isinstance(projection.layer, _convolutions())
        and heads_in == plan.step.containers
        and any(
            projection.inputs % heads == 0 and projection.inputs <= width
            for heads, width in widths
        )
    )


def _plan_out_of_heads(plan: _Plan, layer: Any, heads_dim: int) -> None:
    """Row-parallel by heads. Dense projections into the heads pending in its
    block (SmolLM's query, key and value) are its columns."""
    in_block = plan.columns and plan.columns_in == plan.step.containers
    columns, plan.columns = (plan.columns, []) if in_block else ([], plan.columns)
    _end_pair(plan)
    if plan.split(layer.kernel, heads_dim, "projection out of attention heads, row-parallel"):
        for column in columns:
            _split_column(plan, column, "projection into attention heads, column-parallel")
    else:
        for column in columns:
            plan.keep(column.layer, "its row-parallel partner could not be split")


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


def _is_expert_bank(layer: Any) -> bool:
    """A mixture of experts' bank: a layer without sublayers whose weights
    all stack one matrix (or vector) per expert, (experts, ...), matrices
    among them. KerasHub's expert layers apply them with einsums over all
    experts."""
    weights = _own_weights(layer)
    leading = {int(v.shape[0]) if len(v.shape) >= 2 else None for v in weights}
    return (
        not _sublayers(layer)
        and len(leading) == 1
        and None not in leading
        and leading.pop() > 1
        and any(len(v.shape) == 3 for v in weights)
    )


def _plan_experts(plan: _Plan, layer: Any) -> None:
    """Expert parallelism: each device holds whole experts, so their
    projections (fused or interleaved gates included) run without
    communication; combining the experts' outputs sums over devices."""
    _end_pair(plan)
    for variable in layer.weights:
        plan.split(variable, 0, "mixture-of-experts bank split on experts", experts=True)


def _plan_declared(plan: _Plan, layer: Any) -> None:
    _end_pair(plan)
    plan.keep(layer, "a tfmp layer: declares its own layouts")
    # Not split for storage either: its declaration is its layout.
    plan.declared.update(variable.path for variable in layer.weights)


_TRANSPOSED_CONVS = (
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
)
_DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
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
        (keras.layers.BatchNormalization, _plan_channelwise),
        (_DEPTHWISE, _plan_channelwise),
        (_SEPARABLE, _plan_separable),
        (_RECURRENT, _plan_recurrent),
        (keras.layers.Bidirectional, _plan_recurrent),
        (keras.layers.RNN, _plan_recurrent),
        (_convolutions(), _plan_conv),
    )
    for kinds, planner in table:
        if isinstance(layer, kinds):
            return planner
    return _plan_experts if _is_expert_bank(layer) else None


def _needs_whole_channels(layer: Any) -> bool:
    """Layers and ops DTensor runs only on a batch split ("Only replicated or
    batch parallel layout is supported in expansion of tf.MaxPool", "All
    operands and outputs must be batch parallel" for ResizeBilinear): a pair
    around them would hand them split channels. Nearest upsampling repeats
    rows, which DTensor splits."""
    if isinstance(layer, keras.layers.UpSampling2D):
        return layer.interpolation != "nearest"
    return isinstance(layer, (BasePooling, keras.layers.Resizing, Resize, AveragePool, MaxPool))


def _convolutions() -> tuple[type, ...]:
    return (BaseConv, BaseConvTranspose)


def _replicated_reason(layer: Any) -> str:
    return f"{type(layer).__name__}: small or not splittable, replicated"
