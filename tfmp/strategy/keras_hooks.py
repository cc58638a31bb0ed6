"""Where tfmp meets Keras' entry points: `model(x)`, `*_on_batch`, `fit`.

Keras hands `model(x)` and the `*_on_batch` methods numpy arrays or host
tensors, which DTensor refuses to mix with mesh variables. tfmp wraps
`Layer.__call__` and those methods once so that, for a model whose variables
live on a tfmp mesh, host inputs are packed onto the mesh (split over the batch
axis), the call runs as a function on the mesh, and outputs come back whole.
A pipeline model's `train_step` and `test_step` run stage by stage
(`tfmp.pipeline.steps`). `fit`, `evaluate`, `predict` and the `*_on_batch`
methods first tell the
model's strategy which model runs (to lay it out with `layout_map="auto"`, and
to keep its first step's graphs for `tfmp.comm_report`). Anything else passes
through untouched.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import tempfile
import threading
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.core import Variable as TensorFlowVariable
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.trainers.data_adapters import data_adapter_utils
from tensorflow.experimental import dtensor

from tfmp import distributed
from tfmp.forward import forward_mesh, forward_on
from tfmp.strategy import errors
from tfmp.strategy.extended import extended_of
from tfmp.strategy.placement import BatchPlacer, replicate
from tfmp.strategy.variable import MeshVariable
from tfmp.strategy.variable_layout import creating

_installed = False
_state = threading.local()


def install() -> None:
    """Wraps the Keras entry points once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    keras.layers.Layer.__call__ = _eager_call(keras.layers.Layer.__call__)
    for name in ("train_on_batch", "test_on_batch", "predict_on_batch"):
        setattr(TensorFlowTrainer, name, _on_batch(getattr(TensorFlowTrainer, name)))
    for name in ("fit", "evaluate", "predict"):
        setattr(TensorFlowTrainer, name, _prepared(getattr(TensorFlowTrainer, name)))
    for name in ("train_step", "test_step"):
        setattr(TensorFlowTrainer, name, _pipelined(getattr(TensorFlowTrainer, name)))
    for name in ("save", "save_weights"):
        setattr(keras.Model, name, _chief_writes(getattr(keras.Model, name)))
    TensorFlowVariable._initialize = _announced(TensorFlowVariable._initialize)


def _announced(initialize: Callable) -> Callable:
    """Keras creates a variable's `tf.Variable` here: the strategy's creator
    is told which Keras variable it is creating."""

    @functools.wraps(initialize)
    def wrapper(self, value):
        with creating(self):
            return initialize(self, value)

    return wrapper


def placer_for(layer: Any) -> BatchPlacer | None:
    """The batch placer of the tfmp mesh `layer` runs on, or None."""
    extended = extended_of(getattr(layer, "_distribute_strategy", None))
    if extended is None:
        extended = extended_of(tf.distribute.get_strategy())
    if extended is not None:
        return extended.placer
    for weight in layer.weights[:1]:
        variable = getattr(weight, "value", weight)
        if isinstance(variable, MeshVariable):
            return variable.placer
    return None


def _prepare(model: Any) -> None:
    extended = extended_of(getattr(model, "_distribute_strategy", None))
    if extended is not None:
        extended.prepare(model)


def _prepared(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        _prepare(self)
        with explained_errors(self):
            return method(self, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def explained_errors(model: Any) -> Iterator[None]:
    """DTensor's internal errors in the block become ValueErrors that name
    the layer and op (for a model on a tfmp mesh)."""
    try:
        yield
    except tf.errors.OpError as error:
        if placer_for(model) is None or not errors.is_dtensor_error(error):
            raise
        raise errors.explain(error, model) from None


def _pipelined(step: Callable) -> Callable:
    """Runs a pipeline model's training and test steps stage by stage."""

    @functools.wraps(step)
    def wrapper(self, data):
        extended = extended_of(getattr(self, "_distribute_strategy", None))
        if extended is None or extended.stage_meshes is None:
            return step(self, data)
        if tf.executing_eagerly():
            raise ValueError(
                f"Model {self.name!r} is a pipeline, whose stages meet inside one "
                "compiled function: compile it without run_eagerly=True."
            )
        from tfmp.pipeline import steps  # the pipeline builds on the strategy

        return getattr(steps, step.__name__)(self, data)

    return wrapper


def _chief_writes(save: Callable) -> Callable:
    """In a multi-client run every client gathers the values to save (the
    gathers are collectives), but only client 0 writes the file."""

    @functools.wraps(save)
    def wrapper(self, filepath, *args, **kwargs):
        cluster = distributed.cluster()
        if cluster is None or cluster.is_chief:
            return save(self, filepath, *args, **kwargs)
        with tempfile.TemporaryDirectory() as scratch:
            return save(self, os.path.join(scratch, os.path.basename(str(filepath))), *args, **kwargs)

    return wrapper


def _has_host_array(structure: Any) -> bool:
    for value in tf.nest.flatten(structure):
        if isinstance(value, keras.KerasTensor):
            return False
        if isinstance(value, tf.Tensor) and not dtensor.is_dtensor(value):
            return True
        if hasattr(value, "__array__") and not isinstance(value, tf.Tensor):
            return True
    return False


def _eager_call(layer_call: Callable) -> Callable:
    @functools.wraps(layer_call)
    def __call__(self, *args, **kwargs):
        if not tf.executing_eagerly():
            with forward_on(_forward_mesh_of(self)):
                return layer_call(self, *args, **kwargs)
        if getattr(_state, "inside", False) or not _has_host_array((args, kwargs)):
            return layer_call(self, *args, **kwargs)
        placer = placer_for(self)
        if placer is None:
            return layer_call(self, *args, **kwargs)
        _state.inside = True
        try:
            args, kwargs = placer.place((args, kwargs))
            with forward_on(placer.mesh):
                outputs = _mesh_function(self, layer_call)(*args, **kwargs)
        finally:
            _state.inside = False
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
    function = layer.__dict__.get("_tfmp_mesh_call")
    if function is None:
        function = tf.function(
            functools.partial(layer_call, layer), reduce_retracing=True
        )
        # Set past Keras' attribute tracking: this is no part of the model.
        object.__setattr__(layer, "_tfmp_mesh_call", function)
    return function


def _on_batch(method: Callable) -> Callable:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        _prepare(self)
        placer = placer_for(self)
        if placer is None:
            return method(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        data = bound.arguments
        if data.get("class_weight") is not None and data.get("sample_weight") is None:
            data["sample_weight"] = data_adapter_utils.class_weight_to_sample_weights(
                data["y"], data.pop("class_weight")
            )
        for name in ("x", "y", "sample_weight"):
            if name in data:
                data[name] = placer.place(data[name], targets=name != "x")
        with explained_errors(self):
            return method(*bound.args, **bound.kwargs)

    return wrapper
