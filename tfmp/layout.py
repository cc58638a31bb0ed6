"""Sharding as data: regex rules mapping variable paths to mesh axes."""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import re
import warnings
from typing import Any, Iterator, Mapping, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.mesh import DeviceMesh, as_device_mesh
from tfmp.state import VariableState, known_state, state_of
from tfmp.tracing import context

Axes = tuple  # one entry per tensor dimension: a mesh axis name or None

# A key ending so lays out a layer's output, not a variable (Keras' convention:
# `"decoder/ffn/output"` for the layer at path `"decoder/ffn"`).
OUTPUT_SUFFIX = "/output"


class GatheredOnUse(tuple):
    """Axes a variable is stored split over, read whole by its layer.

    Made by `gather_on_use`; a `LayoutMap` value or a layer's declared layout.
    """

    def __repr__(self) -> str:
        return f"gather_on_use({tuple(self)!r})"


class SplitOnUse(tuple):
    """Axes a variable is stored split over and its layer computes with it
    split over, the batch axis included.

    Made by `split_on_use`; a `LayoutMap` value or a layer's declared layout.
    """

    def __repr__(self) -> str:
        return f"split_on_use({tuple(self)!r})"


def split_on_use(axes: Sequence[str | None]) -> SplitOnUse:
    """A layout its layer computes with as stored, even split over the batch axis.

    tfmp reads a weight split over the axis that splits the batch gathered
    over that axis (fully sharded data parallelism: the activations it
    meets are split over the batch already). A weight laid out
    `split_on_use` stays split as its layer reads it, and DTensor brings the
    activations to it instead. For a mixture of experts' banks `(experts,
    ...)` split over the batch axis this is expert parallelism: each device
    holds and updates only its experts, and the dispatched tokens reach
    them, by an all-to-all or by a gather, as DTensor's layout propagation
    chooses (`tfmp.layers.MixtureOfExperts` declares its banks so and moves
    its tokens itself, by all-to-all). On axes other than the batch's it is
    an ordinary layout.

    Args:
        axes: One mesh axis name or None per dimension of the variable.

    Returns:
        The axes, marked as split on use.

    Examples:
        >>> import tfmp
        >>> mesh = tfmp.DeviceMesh((8, 1), ("batch", "model"))
        >>> layout_map = tfmp.LayoutMap(mesh)
        >>> layout_map["moe/expert_kernel"] = tfmp.split_on_use(("batch", None, None))
        >>> layout_map["moe/expert_kernel"]
        split_on_use(('batch', None, None))
    """
    return SplitOnUse(_as_axes(axes))


def gather_on_use(axes: Sequence[str | None]) -> GatheredOnUse:
    """A layout that splits a variable for memory only: its layer reads it whole.

    The variable's shards live on the devices of the mesh axes in `axes`, as
    with any layout, and so do its optimizer slots; in its layer's forward
    pass it is gathered over those axes (one all-gather per axis), and its
    gradient comes back split. This is fully sharded data parallelism over
    any mesh axis: for weights whose layer has no tensor-parallel partner (a
    patch embedding, a convolution between two norms) or that an op cannot
    compute with split. `tfmp.auto_layout` gives it to the weights it cannot
    split for compute.

    Args:
        axes: One mesh axis name or None per dimension of the variable.

    Returns:
        The axes, marked as gathered on use.

    Examples:
        >>> import tfmp
        >>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
        >>> layout_map = tfmp.LayoutMap(mesh)
        >>> layout_map["patch_embedding/kernel"] = tfmp.gather_on_use((None, None, None, "model"))
        >>> layout_map["patch_embedding/kernel"]
        gather_on_use((None, None, None, 'model'))
    """
    return GatheredOnUse(_as_axes(axes))


class LayoutMap(collections.abc.MutableMapping):
    """Maps variable paths to the mesh axes their dimensions are split over.

    Keys are regular expressions matched with `re.search` against a Keras
    variable's path (e.g. `"dense_1/kernel"` matches `"mlp/dense_1/kernel"`);
    values give, per dimension of the variable, the mesh axis that dimension
    is split over, or `None` to keep it whole. Variables no rule matches are
    replicated. Each key holds one rule: setting a key again is an error, as
    in Keras (delete it first to change it). A `keras.distribution.LayoutMap`
    is accepted wherever a `LayoutMap` is, and keeps the matching of the
    installed Keras, by asking Keras' own lookup (Keras 3.15 matches the whole
    path, `re.fullmatch`, as on the JAX backend).

    A key ending in `"/output"` lays out the output of the layers whose path
    it matches (plus `"/output"`), as `keras.distribution.LayoutMap` does on
    JAX: in each traced step the output is relaid out there, exactly, as
    `jax.lax.with_sharding_constraint` does. A batch axis in it keeps the
    layout tfmp gives the batch (whole for a last batch it does not divide).

    A map that has rules but matches none of the model's variables is an
    error at the first step (the model would train 100% replicated), unless
    `require_match=False`. Rules that match nothing while others match warn;
    under whole-path matching both name the key that would match
    (`".*up/kernel"` for `"up/kernel"`).

    Args:
        mesh: The `tfmp.DeviceMesh` (or Keras `DeviceMesh`) the axes refer to.
        whole_path: Match keys against the whole path (`re.fullmatch`), as
            `keras.distribution.LayoutMap` does, rather than anywhere in it.
        require_match: Whether rules that match no variable at all are an
            error (the default) rather than a warning.

    Examples:
        >>> import tfmp
        >>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
        >>> layout_map = tfmp.LayoutMap(mesh)
        >>> layout_map["dense_1/kernel"] = (None, "model")  # column-parallel
        >>> layout_map["dense_2/kernel"] = ("model", None)  # row-parallel
        >>> layout_map["dense_1/output"] = ("batch", "model")  # its activations
    """

    def __init__(self, mesh: Any, whole_path: bool = False, require_match: bool = True):
        self._mesh = as_device_mesh(mesh)
        self._matches: Any = re.fullmatch if whole_path else re.search
        self.whole_path = whole_path
        self.require_match = require_match
        self._rules: dict[str, Axes] = {}
        self._matched: set[str] = set()
        self._looked_up: dict[str, None] = {}  # variable paths match() was asked about, in order
        self._outputs_looked_up = False  # a traced forward pass asked for layer outputs
        self._laid_out_outputs: dict[str, tuple[str, Axes]] = {}  # layer path -> (key, axes)
        self._warned: set[str] = set()
        # A Keras LayoutMap this map follows: rules the user adds to it later
        # (before the model is built) apply, as Keras on JAX reads its map
        # whenever a variable is created.
        self._followed: Any = None
        self._followed_keys: set[str] = set()
        self.reasons: dict[str, str] = {}  # why a planner left a variable whole

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh

    mesh = device_mesh

    def __setitem__(self, key: str, axes: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(f"LayoutMap keys are regex strings, got {key!r}.")
        try:
            re.compile(key)
        except re.error as error:
            raise ValueError(
                f"LayoutMap key {key!r} is not a valid regular expression ({error}). "
                f"Fix the pattern, or match the text literally with re.escape({key!r})."
            ) from None
        if key in self._rules:
            raise ValueError(
                f"LayoutMap already has a rule for {key!r}: {self._rules[key]}. Each "
                f"key holds one rule; to change it, `del layout_map[{key!r}]` first."
            )
        axes = _as_axes(axes)
        for axis in axes:
            if axis is not None:
                self._mesh.check_axis(axis, what=f"LayoutMap[{key!r}] axis")
        repeated = {a for a in axes if a is not None and axes.count(a) > 1}
        if repeated:
            raise ValueError(
                f"LayoutMap[{key!r}] = {axes} splits two dimensions over the same "
                f"mesh axis {sorted(repeated)}; use each mesh axis at most once."
            )
        self._rules[key] = axes

    def _follow(self) -> None:
        """Takes over the rules of the followed Keras map as they are now."""
        if self._followed is None:
            return
        wanted = {key: _as_axes(axes) for key, axes in self._followed.items()}
        for key in self._followed_keys - wanted.keys():
            self._rules.pop(key, None)
            self._matched.discard(key)
        for key, axes in wanted.items():
            if self._rules.get(key) != axes:
                self._rules.pop(key, None)
                self[key] = axes
        self._followed_keys = set(wanted)

    def __getitem__(self, path: str) -> Axes | None:
        """Returns the axes for a variable path, or None when no rule matches."""
        key = self._find_key(path)
        return None if key is None else self._rules[key]

    def match(self, path: str) -> tuple[str, Axes] | None:
        """Returns `(key, axes)` of the rule for a variable, recording the use.

        An exact key wins; otherwise exactly one regex may match.
        """
        self._looked_up.setdefault(path)
        key = self._find_key(path)
        if key is None:
            return None
        self._matched.add(key)
        return key, self._rules[key]

    def _find_key(self, path: str, outputs: bool = False) -> str | None:
        """The key of the rule for a variable's path, or with `outputs` for
        a layer output's (among the keys ending in `"/output"` only)."""
        self._follow()
        rules = [key for key in self._rules if key.endswith(OUTPUT_SUFFIX) == outputs]
        if path in rules:
            return path
        keys = [key for key in rules if self._matches(key, path)]
        if len(keys) > 1:
            what = "Layer output path" if outputs else "Variable path"
            raise ValueError(
                f"{what} {path!r} matches several LayoutMap keys {keys}; "
                "make the keys specific enough that one matches."
            )
        return keys[0] if keys else None

    def output_axes(self, layer_path: str) -> Axes | None:
        """The axes the output of the layer at `layer_path` is laid out with
        (the rule whose key matches `layer_path + "/output"`), recording the
        use; None without one."""
        self._outputs_looked_up = True
        key = self._find_key(layer_path + OUTPUT_SUFFIX, outputs=True)
        if key is None:
            return None
        self._matched.add(key)
        self.note_output(layer_path, key, self._rules[key])
        return self._rules[key]

    def note_output(self, layer_path: str, source: str, axes: Axes) -> None:
        """Records that a traced step laid out the output of the layer at
        `layer_path` with `axes`, by `source` (a key, or what else decided)."""
        self._laid_out_outputs[layer_path] = (source, tuple(axes))

    def axes_named(self) -> set[str]:
        """Every mesh axis some rule splits over."""
        self._follow()
        return {axis for axes in self._rules.values() for axis in axes if axis}

    def laid_out_outputs(self) -> dict[str, tuple[str, Axes]]:
        """The layers whose output a traced step has laid out so far:
        layer path -> (the key or what else decided, axes)."""
        return dict(self._laid_out_outputs)

    def output_keys(self) -> list[str]:
        """The keys that lay out layer outputs (ending in `"/output"`)."""
        self._follow()
        return [key for key in self._rules if key.endswith(OUTPUT_SUFFIX)]

    def note_tensor_path(self, path: str) -> None:
        """Records a lookup of `path`, a layer output's (`".../output"`), by
        Keras' own `Layer.__call__`: its rule is no unmatched rule."""
        self.output_axes(path.removesuffix(OUTPUT_SUFFIX))

    def unmatched_keys(self) -> list[str]:
        """Keys that have matched nothing so far: no variable path, or (once a
        forward pass has been traced) no layer's output."""
        self._follow()
        return [
            key
            for key in self._rules
            if key not in self._matched
            and (self._outputs_looked_up or not key.endswith(OUTPUT_SUFFIX))
        ]

    def check_matched(self) -> bool:
        """Checks the rules against the variables looked up so far.

        Returns False (checking nothing) while no variable has been looked
        up: the model does not exist yet; and False while output keys wait
        for a traced forward pass. Warns about keys that matched no variable
        (or layer output), once each, with the key that would match under
        this map's rule.

        Raises:
            ValueError: If no rule matched any variable and `require_match`.
        """
        if not self._looked_up:
            return False
        checked = self._outputs_looked_up or not self.output_keys()
        unmatched = [key for key in self.unmatched_keys() if key not in self._warned]
        if not unmatched:
            return checked
        hints = "".join(self._hint(key) for key in unmatched)
        variable_keys = [key for key in self._rules if not key.endswith(OUTPUT_SUFFIX)]
        if variable_keys and all(key in unmatched for key in variable_keys) and self.require_match:
            raise ValueError(
                f"tfmp: no LayoutMap key matched any of the model's "
                f"{len(self._looked_up)} variables (keys {unmatched}, variables such "
                f"as {list(self._looked_up)[:3]}), so the model would train 100% "
                f"replicated.{hints} Fix the keys against the paths "
                "tfmp.summary(model) lists; to replicate every variable on purpose, "
                "use an empty LayoutMap (or keras.distribution.DataParallel), or "
                "pass require_match=False."
            )
        self._warned.update(unmatched)
        warnings.warn(
            f"tfmp: LayoutMap keys {unmatched} matched no variable (nor layer output), "
            f"so nothing they describe is sharded.{hints} Check them against the "
            "variable paths that tfmp.summary(model) lists (a renamed layer changes "
            "its path; a layer's output is its path plus '/output').",
            stacklevel=4,
        )
        return checked

    def _hint(self, key: str) -> str:
        """Why `key` matches no variable under whole-path matching, and the
        key that would match, when it matches part of a path."""
        if not self.whole_path:
            return ""
        try:
            partly = [path for path in self._looked_up if re.search(key, path)]
        except re.error:
            return ""
        if not partly:
            return ""
        suggestion = ".*" + key
        if not re.fullmatch(suggestion, partly[0]):
            suggestion += ".*"
        return (
            f" This map matches a key against the whole variable path, as "
            f"keras.distribution.LayoutMap does (the exact path, else re.fullmatch): "
            f"{key!r} matches only part of "
            f"{partly[0]!r}; the key {suggestion!r} would match it."
        )

    def __delitem__(self, key: str) -> None:
        del self._rules[key]
        self._matched.discard(key)

    def __iter__(self) -> Iterator[str]:
        self._follow()
        return iter(list(self._rules))

    def __len__(self) -> int:
        self._follow()
        return len(self._rules)

    def __repr__(self) -> str:
        self._follow()
        rules = "".join(f"\n  {key!r}: {axes}," for key, axes in self._rules.items())
        return f"LayoutMap({self._mesh!r}, {{{rules}\n}})"


def as_layout_map(layout_map: Any, mesh: DeviceMesh) -> LayoutMap:
    """Returns a tfmp `LayoutMap` over `mesh` for a tfmp/Keras map, dict or None.

    A tfmp `LayoutMap` is used as is, so rules added to it later still apply.
    """
    if isinstance(layout_map, LayoutMap):
        if layout_map.mesh != mesh:
            raise ValueError(
                f"The LayoutMap was built on {layout_map.mesh!r}, but the strategy's "
                f"mesh is {mesh!r}: its rules would lay variables out over another "
                "mesh than the one they were written for. Build the LayoutMap on the "
                "strategy's mesh, tfmp.LayoutMap(mesh), and copy the rules over "
                "(`for key, axes in old.items(): new[key] = axes`)."
            )
        return layout_map
    keras_mesh = getattr(layout_map, "device_mesh", None)
    if keras_mesh is not None and (
        tuple(keras_mesh.shape), tuple(keras_mesh.axis_names)
    ) != (mesh.shape, mesh.axis_names):
        raise ValueError(
            f"The keras.distribution.LayoutMap was built on a mesh of shape "
            f"{tuple(keras_mesh.shape)} and axes {tuple(keras_mesh.axis_names)}, but the "
            f"strategy's mesh is {mesh!r}. Build the LayoutMap on the strategy's mesh."
        )
    converted = LayoutMap(mesh)
    if layout_map is None:
        return converted
    if _is_keras_layout_map(layout_map):
        converted._matches = functools.partial(_keras_matches, type(layout_map))  # noqa: SLF001
        converted.whole_path = True
    if not hasattr(layout_map, "items"):
        raise TypeError(
            f"layout_map must be a tfmp.LayoutMap, keras.distribution.LayoutMap or "
            f"dict, got {type(layout_map).__name__}."
        )
    if _is_keras_layout_map(layout_map):
        converted._followed = layout_map  # noqa: SLF001
        converted._follow()  # noqa: SLF001 (its rules checked now, at the strategy)
        return converted
    for key, axes in layout_map.items():
        converted[key] = axes
    return converted


def _is_keras_layout_map(layout_map: Any) -> bool:
    import keras

    return isinstance(layout_map, keras.distribution.LayoutMap)


@functools.lru_cache(maxsize=None)
def _keras_probe(keras_map_type: type, key: str) -> Any:
    """A Keras LayoutMap (of the user's map's type) holding `key` alone."""
    probe = keras_map_type(None)
    probe[key] = (None,)
    return probe


def _keras_matches(keras_map_type: type, key: str, path: str) -> bool:
    """Whether Keras' own `LayoutMap` lookup matches `path` with `key`."""
    return _keras_probe(keras_map_type, key)[path] is not None


def _as_axes(axes: Any) -> Axes:
    axes = getattr(axes, "axes", axes)  # keras.distribution.TensorLayout
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise TypeError(
            f"A layout is a tuple with one mesh axis name or None per dimension, "
            f"such as (None, 'model'); got {axes!r}."
        )
    for axis in axes:
        if axis is not None and not isinstance(axis, str):
            raise TypeError(
                f"Layout {tuple(axes)} holds {axis!r}: each entry must be a mesh "
                "axis name or None."
            )
    return type(axes)(axes) if isinstance(axes, (GatheredOnUse, SplitOnUse)) else tuple(axes)


@contextlib.contextmanager
def declared_layouts(owner: str, layouts: Mapping[str, Axes]) -> Iterator[None]:
    """Declares the layouts of the weights a layer creates within the block.

    Keys are weight paths relative to the layer (`"kernel"`, `"query/kernel"`);
    a declaration made by an inner layer wins over an outer one. Outside a
    `ModelParallelStrategy` scope declarations have no effect.

    Args:
        owner: Name of the declaring layer, for error messages.
        layouts: Relative weight path -> axes.
    """
    stack = context.layout_declarations
    stack.append((owner, {key: _as_axes(axes) for key, axes in layouts.items()}))
    try:
        yield
    finally:
        stack.pop()


def declare_deferred(owner: str, layouts: Mapping[str, Axes], variables: Any) -> None:
    """Records declared layouts on a layer's Keras variables.

    Keras creates the backing variables of a lazily built model after the
    layer's `build` has returned; the record carries the layer's declaration
    to that moment.
    """
    for variable in variables:
        found = _find_declared(variable.path, [(owner, layouts)])
        if found is not None:
            state_of(variable, VariableState).declared_layout = found


def declared_layout(path: str, keras_variable: Any = None) -> tuple[str, Axes] | None:
    """`(owner, axes)` declared for the variable at `path`, or None."""
    recorded = None if keras_variable is None else known_state(keras_variable, VariableState)
    if recorded is not None and recorded.declared_layout is not None:
        return recorded.declared_layout
    return _find_declared(path, reversed(context.layout_declarations))


def explicit_layout(keras_variable: Any) -> tuple[str, Axes] | None:
    """`(owner, axes)` of a `keras.Variable(..., layout=...)`, or None.

    Keras lets a variable carry its own layout (a
    `keras.distribution.TensorLayout`, or a backend layout: here a
    `dtensor.Layout`), which wins over the distribution's layout map, as on
    JAX."""
    layout = getattr(keras_variable, "_layout", None)
    if layout is None:
        return None
    if isinstance(layout, dtensor.Layout):
        layout = layout_axes(layout)
    return f"keras.Variable({keras_variable.path!r}, layout=...)", _as_axes(layout)


def _find_declared(path: str, declarations: Any) -> tuple[str, Axes] | None:
    for owner, layouts in declarations:
        for key, axes in layouts.items():
            if path == key or path.endswith("/" + key):
                return owner, _as_axes(axes)
    return None


@dataclasses.dataclass(frozen=True)
class UndividedDimension:
    """A variable's dimension kept whole: its size does not divide by the
    mesh axis its layout splits it over."""

    path: str
    dim: int
    size: int
    axis: str
    parts: int
    source: str


def layout_axes(layout: dtensor.Layout) -> Axes:
    """The mesh axis (or None) of each dimension of a DTensor layout."""
    return tuple(None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs)


def replicated(value: Any, mesh: dtensor.Mesh, sequence_axis: str | None = None) -> Any:
    """`value`, a DTensor on `mesh`, whole on every device of it.

    Gathered so that each relayout gathers one mesh axis where possible. With
    real gathers (`LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2`) DTensor
    lowers a relayout that gathers two mesh axes at once wrongly when the
    dimensions are split in another order than the mesh's axes (a `("model",
    "batch")` tensor comes back with its shards misplaced) and fails to
    compile one of rank 3 or more. One axis per relayout is exact with either
    lowering and moves the same bytes.

    Eagerly the layout is known: one relayout per split dimension. Inside a
    function it is not, and DTensor allows one `MATCH` (keep as it is) per
    layout: first every dimension but the first is gathered, then the first;
    exact for a tensor split on its first dimension and at most one other
    (an activation split over the batch and one feature axis). Under context
    parallelism (`sequence_axis`) an activation can be split on its second
    dimension over that axis and on a later one over another: then the later
    ones are gathered first, while the second is split over `sequence_axis`
    (which moves nothing where it is split so already), then the second.
    """
    rank = value.shape.rank
    if not rank:
        return value
    if tf.executing_eagerly():
        specs = list(dtensor.fetch_layout(value).sharding_specs)
        for dim, spec in enumerate(specs):
            if spec != dtensor.UNSHARDED:
                specs[dim] = dtensor.UNSHARDED
                value = dtensor.relayout(value, dtensor.Layout(specs, mesh))
        return value
    keep_first = [dtensor.MATCH] + [dtensor.UNSHARDED] * (rank - 1)
    if (
        sequence_axis in mesh.dim_names
        and rank >= 3
        and value.shape[1] is not None
        and value.shape[1] % mesh.dim_size(sequence_axis) == 0
    ):
        keep_sequence = [dtensor.MATCH, sequence_axis] + [dtensor.UNSHARDED] * (rank - 2)
        value = dtensor.relayout(value, dtensor.Layout(keep_sequence, mesh))
    value = dtensor.relayout(value, dtensor.Layout(keep_first, mesh))
    return dtensor.relayout(value, dtensor.Layout.replicated(mesh, rank))
