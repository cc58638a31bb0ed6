"""Where tfmp meets Keras' entry points: `model(x)`, `*_on_batch`, `fit`.

Keras hands `model(x)` and the `*_on_batch` methods numpy arrays or host
tensors, which DTensor refuses to mix with mesh variables. tfmp wraps
`Layer.__call__` and those methods once so that, for a model whose variables
live on a tfmp mesh, host inputs are packed onto the mesh (split over the batch
axis), the call runs as a function on the mesh, and outputs come back whole.
`fit`, `evaluate`, `predict` and the `*_on_batch` methods first tell the
model's strategy which model runs (to lay it out with `layout_map="auto"`, and
to keep its first step's graphs for `tfmp.comm_report`), and whether the
batches they feed train it (a pipeline checks that a training batch splits
into its micro-batches); `fit` and `evaluate` also that the pass Keras makes
over their data to build the model is to read nothing
(`tfmp.strategy.epoch_iterator`); `fit` showing progress says when it lays
out its first step (`tfmp.strategy.first_step_note`). Anything else passes through untouched. A pipeline
model's `train_step` and `test_step` are the pipeline's
(`tfmp.pipeline.keras_hooks`). A model with no `call()` of its own (a GAN
with its own `train_step`) skips Keras' symbolic build, as it does without a
strategy (`built_without_call`). Which Keras attribute each wrapper replaces
is declared in `tfmp.strategy.patches`. One more meets TensorFlow: a host tensor
a step captures (a constant the model holds) reaches the mesh
(`mesh_captures`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp import distributed
from tfmp.forward import forward_mesh, forward_on
from tfmp.integrations.internals import data_adapter_utils
from tfmp.integrations.internals import tf_dtypes as dtypes
from tfmp.integrations.internals import tf_ops as ops
from tfmp.state import ModelState, state_of
from tfmp.strategy import errors, peer_errors
from tfmp.strategy.activation_layouts import laid_out_call
from tfmp.strategy.epoch_iterator import build_pass_expected
from tfmp.strategy.extended import extended_of
from tfmp.strategy.first_step_note import with_first_step_note
from tfmp.strategy.placement import BatchPlacer, replicate
from tfmp.strategy.step_errors import with_step_errors
from tfmp.strategy.variable import MeshVariable
from tfmp.strategy.variable_layout import creating
from tfmp.strategy.watchdog import watch_custom_loop_steps, watched_call, with_step_watch
from tfmp.tracing import context, scoped

_VALUE_DTYPES = dtypes.TF_VALUE_DTYPES

# Host tensors of up to this many elements that a step captures become
# constants of its graph; larger ones are copied onto the mesh once.
_CONSTANT_ELEMENTS = 1 << 20

# The Keras methods whose batches train the model.
_TRAINING_METHODS = ("fit", "train_on_batch")


def announced(initialize: Callable) -> Callable:
    """Keras creates a variable's `tf.Variable` here: the strategy's creator
    is told which Keras variable it is creating."""

    @functools.wraps(initialize)
    def wrapper(self, value):
        with creating(self):
            return initialize(self, value)

    return wrapper


def _is_dtensor(value: Any) -> bool:
    """Whether `value` is an eager DTensor (asked eagerly: DTensor answers
    only outside graphs)."""
    if not isinstance(value, ops.EagerTensor):
        return False
    with tf.init_scope():
        return dtensor.is_dtensor(value)


def placer_for(layer: Any) -> BatchPlacer | None:
    """The batch placer of the tfmp mesh `layer` runs on, or None."""
    extended = extended_of(getattr(layer, "_distribute_strategy", None))
    if extended is None:
        extended = extended_of(tf.distribute.get_strategy())
    if extended is not None:
        return extended.placer
    # Its own first weight, else (a model, a layer of layers) its first one:
    # `layer.weights` collects every sublayer's.
    own = layer._trainable_variables or layer._non_trainable_variables  # noqa: SLF001
    for weight in (own or layer.weights)[:1]:
        variable = getattr(weight, "value", weight)
        if isinstance(variable, MeshVariable):
            return variable.placer
    return None


def _mesh_of(model: Any) -> dtensor.Mesh:
    """The whole mesh `model` runs on: its strategy's (every pipeline stage's
    devices), else that of its batches."""
    extended = extended_of(getattr(model, "_distribute_strategy", None)) or extended_of(
        tf.distribute.get_strategy()
    )
    return extended.mesh.dtensor_mesh if extended is not None else placer_for(model).mesh


@contextlib.contextmanager
def _running(model: Any, method: str) -> Iterator[None]:
    """Tells the model's tfmp strategy, if any, that `model` runs Keras'
    `method` in the block."""
    extended = extended_of(getattr(model, "_distribute_strategy", None))
    if extended is None:
        yield
        return
    extended.prepare(model)
    try:
        with extended.feeding(trains=method in _TRAINING_METHODS):
            yield
    finally:
        # Keras asks for no batch past an epoch of known length, where the
        # graphs collected for the first steps would be kept: keep them now.
        extended.first_step_graphs.finish()


def prepared(method: Callable) -> Callable:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        made_in_the_current_scope(self, method.__name__)
        build_pass = watched = contextlib.nullcontext()
        if method.__name__ in ("fit", "evaluate", "predict") and placer_for(self) is not None:
            bound = signature.bind(self, *args, **kwargs)
            callbacks = bound.arguments.get("callbacks")
            if method.__name__ != "predict":
                callbacks = with_step_errors(callbacks)
                build_pass = build_pass_expected()
            if method.__name__ == "fit":
                callbacks = with_first_step_note(
                    callbacks, self, _mesh_of(self), bound.arguments.get("verbose", "auto")
                )
            bound.arguments["callbacks"] = with_step_watch(callbacks)
            watched = watched_call()
            args, kwargs = bound.args[1:], bound.kwargs
        with _running(self, method.__name__), explained_errors(self), build_pass, watched:
            return method(self, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def explained_errors(model: Any) -> Iterator[None]:
    """DTensor's internal errors in the block become ValueErrors that name
    the layer and op, failures of other clients errors that name the
    client, and a step cancelled because another device failed an error
    that says so (for a model on a tfmp mesh)."""
    try:
        yield
    except tf.errors.OpError as error:
        if placer_for(model) is None:
            raise
        cluster = distributed.cluster()
        several_clients = cluster is not None and cluster.num_clients > 1
        if several_clients and peer_errors.is_peer_failure(error):  # never a layout problem
            raise peer_errors.explain_peer_failure(error) from error
        if errors.is_cancellation(error):
            raise errors.explain_cancellation(error, model) from error
        if peer_errors.is_peer_failure(error):
            raise
        if not errors.is_dtensor_error(error):
            raise
        raise errors.explain(error, model) from None


def _has_host_array(structure: Any) -> bool:
    """Whether an eager call gets host values to place on the mesh: never
    when a symbolic Keras tensor is among them (a functional model being
    built, with a host constant beside it)."""
    values = tf.nest.flatten(structure)
    if any(isinstance(value, keras.KerasTensor) for value in values):
        return False
    return any(
        (isinstance(value, tf.Tensor) and not dtensor.is_dtensor(value))
        or (hasattr(value, "__array__") and not isinstance(value, tf.Tensor))
        for value in values
    )


def eager_call(layer_call: Callable) -> Callable:
    @functools.wraps(layer_call)
    def __call__(self, *args, **kwargs):
        if not tf.executing_eagerly():
            with forward_on(_forward_mesh_of(self)):
                return laid_out_call(self, layer_call, args, kwargs)
        if context.eager_mesh_call:
            return layer_call(self, *args, **kwargs)
        # Asked first: a layer outside any tfmp mesh answers fastest.
        placer = placer_for(self)
        # A layer without weights has nothing on the mesh: it runs as in
        # Keras, eagerly (Python control flow on its inputs' values works).
        if placer is None or not _has_host_array((args, kwargs)) or not self.weights:
            return layer_call(self, *args, **kwargs)
        with scoped(eager_mesh_call=True):
            args, kwargs = placer.place((args, kwargs))
            with forward_on(placer.mesh):
                outputs = _mesh_function(self, layer_call)(*args, **kwargs)
        return tf.nest.map_structure(
            lambda t: replicate(t) if isinstance(t, tf.Tensor) else t, outputs
        )

    return __call__


def _own_mesh(layer: Any) -> dtensor.Mesh | None:
    """The mesh of a layer's own variables, if they live on one."""
    for variable in layer._trainable_variables + layer._non_trainable_variables:  # noqa: SLF001
        value = getattr(variable, "_value", None)
        if isinstance(value, MeshVariable):
            return value.layout.mesh
    return None


def _forward_mesh_of(layer: Any) -> dtensor.Mesh | None:
    """The mesh `layer`'s forward pass is traced on: its own variables' mesh
    (a pipeline stage's), else the enclosing forward pass's, else the home
    mesh of a tfmp step being traced. None anywhere else, e.g. in a tf.data
    function traced in the strategy's scope."""
    enclosing = forward_mesh()
    if enclosing is None:
        context = tf.distribute.get_replica_context()
        extended = extended_of(getattr(context, "strategy", None))
        if extended is None:
            return None
        enclosing = extended.home_mesh.dtensor_mesh
    return _own_mesh(layer) or enclosing


def _mesh_function(layer: Any, layer_call: Callable) -> Callable:
    """The layer's call as a function, traced once per input signature.

    Layers make tensors of their own from host values (causal masks, position
    ranges); eager DTensor refuses those next to mesh tensors, while inside a
    function DTensor lays them out like any other value.
    """
    state = state_of(layer, ModelState)
    if state.eager_mesh_call is None:
        # Through a weak reference: the state must not keep its layer alive.
        layer_ref = weakref.ref(layer)
        state.eager_mesh_call = tf.function(
            lambda *args, **kwargs: layer_call(layer_ref(), *args, **kwargs), reduce_retracing=True
        )
    return state.eager_mesh_call


def on_batch(method: Callable) -> Callable:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        made_in_the_current_scope(self, method.__name__)
        with _running(self, method.__name__):
            placer = placer_for(self)
            if placer is None:
                return method(self, *args, **kwargs)
            watch_custom_loop_steps()
            bound = signature.bind(self, *args, **kwargs)
            data = bound.arguments
            if data.get("class_weight") is not None and data.get("sample_weight") is None:
                data["sample_weight"] = data_adapter_utils.class_weight_to_sample_weights(
                    data["y"], data.pop("class_weight")
                )
            placer.check_batch(data["x"])
            for name in ("x", "y", "sample_weight"):
                if name in data:
                    data[name] = placer.place(data[name], targets=name != "x")
            with explained_errors(self):
                return method(*bound.args, **bound.kwargs)

    return wrapper


def laid_out_before_slots(build: Callable) -> Callable:
    """Keras' `BaseOptimizer.build`: under a tfmp strategy with
    `layout_map="auto"`, the models holding the variables are laid out before
    the optimizer indexes them and makes their slots."""

    @functools.wraps(build)
    def wrapper(self, variables):
        extended = extended_of(getattr(self, "_distribution_strategy", None))
        if extended is not None and not self.built:
            extended.apply_auto_layouts_before_slots(list(variables))
        return build(self, variables)

    return wrapper


def made_in_the_current_scope(model: Any, call: str) -> None:
    """Refuses `call` (compile, fit, ...) in a tfmp strategy's scope for a
    model made outside it.

    Keras ties a model to the strategy current when the model is made, and
    its optimizer to the one current at `compile`. A model made outside
    `strategy.scope()` and compiled or fit inside it has host variables;
    `fit` then stops deep in the step ("Need to be inside `with
    strategy.scope()`", "Mixing different tf.distribute.Strategy objects"),
    which points at the call, not at where the model was made.
    """
    current = tf.distribute.get_strategy()
    made_under = getattr(model, "_distribute_strategy", None)
    if extended_of(current) is None or made_under is current:
        return
    where = "outside strategy.scope()" if made_under is None else f"under another strategy, {made_under!r}"
    raise ValueError(
        f"tfmp: the model {model.name!r} was built {where}, and `{call}` runs in the "
        f"scope of {current!r}: its variables are not on that mesh. Build the model "
        f"inside the scope: `with strategy.scope(): model = ...; model.compile(...)` "
        f"(a saved model: `load_model` in the scope)."
    )


def compiled_in_its_scope(compile_method: Callable) -> Callable:
    """`Model.compile`: a model made outside the current tfmp strategy's
    scope is refused here, by its name (`made_in_the_current_scope`)."""

    @functools.wraps(compile_method)
    def wrapper(self, *args, **kwargs):
        made_in_the_current_scope(self, "compile")
        return compile_method(self, *args, **kwargs)

    return wrapper


def built_without_call(symbolic_build: Callable) -> Callable:
    """Keras' symbolic build at the start of `fit`, `evaluate` and `predict`
    under a strategy, for a model with no `call()` of its own.

    Keras calls the model on symbolic inputs there, to make its variables and
    those of its compiled metrics outside the step. A model that only runs
    its own `train_step` over built sub-models (a GAN of a generator and a
    discriminator, a VAE of an encoder and a decoder, as Keras' examples
    write them) has no `call()`, and Keras' build stops under any
    tf.distribute strategy ("Model GAN does not have a `call()` method
    implemented"). Without a strategy Keras builds nothing there; on a tfmp
    mesh such a model skips the build as well, and its `train_step` makes
    what it needs as it first runs (an optimizer's slots), as on one device.
    """

    @functools.wraps(symbolic_build)
    def wrapper(self, iterator=None, data_batch=None):
        if type(self).call is keras.Model.call and placer_for(self) is not None:
            return None
        return symbolic_build(self, iterator=iterator, data_batch=data_batch)

    return wrapper


def mesh_captures(capture: Callable) -> Callable:
    """`FuncGraph.capture` for a step traced on a tfmp mesh.

    A tensor made outside the step and used in it (a constant a functional
    model holds, such as ViTDet's `x - ops.array(mean)`, or one a layer
    made in `build`) is captured: TensorFlow passes the host tensor to the
    function as an input, and DTensor refuses host inputs other than small
    integers ("got a regular tensor for input 2 (shape [3]) but was
    expecting a DTensor"). While a forward pass is traced on a mesh, or a
    function in a tfmp strategy's replica context, such a tensor becomes a
    constant of the graph (DTensor replicates it), or, if it is large, a
    replicated copy on the mesh. Its value is the same, so the step computes
    what one device computes.
    """

    @functools.wraps(capture)
    def wrapper(self, tensor, name=None, shape=None):
        if not _is_host_value(tensor):
            return capture(self, tensor, name, shape)
        mesh = forward_mesh()
        if mesh is None:
            extended = _replica_extended()
            if extended is None:
                return capture(self, tensor, name, shape)
            mesh = extended.home_mesh.dtensor_mesh
        # Held by the graph: the values are its tensors, which a table keyed
        # weakly by the graph would keep alive, and the graph with them.
        cache = getattr(self, "_tfmp_host_captures", None)
        if cache is None:
            cache = {}
            setattr(self, "_tfmp_host_captures", cache)
        key = (id(tensor), mesh.to_string())
        if key not in cache:
            if tensor.shape.num_elements() <= _CONSTANT_ELEMENTS:
                with self.as_default(), tf.control_dependencies(None):
                    value = tf.constant(tensor.numpy(), dtype=tensor.dtype, name="host_constant")
            else:
                with tf.init_scope():
                    moved = dtensor.copy_to_mesh(
                        tensor, dtensor.Layout.replicated(mesh, tensor.shape.rank)
                    )
                value = capture(self, moved, name, shape)
            # The host tensor is kept so that its id is not reused.
            cache[key] = (tensor, value)
        return cache[key][1]

    return wrapper


def _is_host_value(tensor: Any) -> bool:
    """An eager tensor of values (not a resource, not a DTensor)."""
    return (
        isinstance(tensor, ops.EagerTensor)
        and tensor.dtype in _VALUE_DTYPES
        and not _is_dtensor(tensor)
    )


def _replica_extended() -> Any:
    """The tfmp strategy's extended whose replica context a function is
    traced in, or None."""
    if not tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
        return extended_of(tf.distribute.get_strategy())
    return None
