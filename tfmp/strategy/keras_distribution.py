"""`keras.distribution` on TensorFlow: a Keras distribution runs as a tfmp strategy.

Keras' TensorFlow backend leaves `keras.distribution` a stub: a program
written for Keras on JAX sets a `DataParallel` or `ModelParallel`
distribution and then trains on one device with every variable whole. With
tfmp imported, `keras.distribution.set_distribution(distribution)` (and so
`with distribution.scope():`) makes the distribution's
`ModelParallelStrategy.from_keras` strategy the current
`tf.distribute` strategy, as `tf.distribute.experimental_set_strategy` does:
variables created afterwards are laid out by the distribution's layout map,
and Keras' `fit`, `evaluate` and `predict` of a model made then run on its
mesh. `set_distribution(None)` returns to plain Keras. The functions the
TensorFlow backend lacks (`distribute_tensor`, which Keras calls for a
layer's output layout, `get_device_count`, `initialize`) are tfmp's here.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp import distributed
from tfmp.forward import forward_mesh
from tfmp.integrations.internals import keras_tf_distribution_lib as tf_distribution_lib
from tfmp.strategy.placement import to_layout
from tfmp.strategy.strategy import ModelParallelStrategy

# One strategy per distribution: models made each time `with distribution.scope():`
# is entered share one strategy, as they share one mesh on JAX.
_strategies: "weakref.WeakKeyDictionary[Any, ModelParallelStrategy]" = weakref.WeakKeyDictionary()


def strategy_for(distribution: Any) -> ModelParallelStrategy:
    """The `ModelParallelStrategy` that runs `distribution`, made once."""
    if not isinstance(distribution, (keras.distribution.DataParallel, keras.distribution.ModelParallel)):
        return ModelParallelStrategy.from_keras(distribution)  # its TypeError says what it takes
    strategy = _strategies.get(distribution)
    if strategy is None:
        strategy = ModelParallelStrategy.from_keras(distribution)
        _strategies[distribution] = strategy
        if isinstance(distribution, keras.distribution.ModelParallel):
            record_tensor_layout_lookups(distribution, strategy)
    return strategy


def current_strategy() -> ModelParallelStrategy | None:
    """The strategy of the distribution `keras.distribution` holds, if any."""
    distribution = keras.distribution.distribution()
    return None if distribution is None else _strategies.get(distribution)


def record_tensor_layout_lookups(distribution: Any, strategy: ModelParallelStrategy) -> None:
    """Keys that lay out a layer's output (`"dense/output"`, looked up by
    Keras' `Layer.__call__`) count as matched, like those of variables."""
    lookup = distribution.get_tensor_layout

    @functools.wraps(lookup)
    def get_tensor_layout(path):
        strategy.layout_map.note_tensor_path(path)
        return lookup(path)

    distribution.get_tensor_layout = get_tensor_layout


def set_distribution_on_mesh(set_distribution: Callable) -> Callable:
    """Wraps `keras.distribution.set_distribution`: the distribution's strategy
    becomes the current one (None: the one it set before leaves)."""
    if keras.backend.backend() != "tensorflow":
        return set_distribution

    @functools.wraps(set_distribution)
    def wrapper(value):
        strategy = None if value is None else strategy_for(value)
        current = current_strategy()
        if strategy is not None or (
            current is not None and tf.distribute.get_strategy() is current
        ):
            tf.distribute.experimental_set_strategy(strategy)
        return set_distribution(value)

    return wrapper


def follow_distribution_set_before_import() -> None:
    """A distribution set before tfmp was imported runs on the mesh too."""
    distribution = keras.distribution.distribution()
    if distribution is not None and keras.backend.backend() == "tensorflow":
        keras.distribution.set_distribution(distribution)


def distribute_tensor(tensor: Any, layout: Any) -> Any:
    """`keras.distribution.distribute_tensor` on TensorFlow: `tensor` with
    `layout` (a `keras.distribution.TensorLayout`, axes, or a
    `dtensor.Layout`) on the mesh.

    In a step traced on a mesh it is a relayout, as `jax.lax.with_sharding_constraint`
    is on JAX; traced on no mesh (Keras' shape inference) the tensor is
    returned as is; eagerly a host tensor is placed on the current
    distribution's mesh. A dimension laid out over the batch axis keeps the
    layout tfmp gives the batch: split, or whole for a last batch that does
    not divide by the axis (as one device computes it).
    """
    strategy = tf.distribute.get_strategy()  # a model's own, in its fit
    if not isinstance(strategy, ModelParallelStrategy):
        strategy = None
    batch_axis = None if strategy is None else strategy.batch_axis
    if tf.executing_eagerly():
        if dtensor.is_dtensor(tensor):
            mesh = dtensor.fetch_layout(tensor).mesh
        elif strategy is None:
            raise ValueError(
                "keras.distribution.distribute_tensor on TensorFlow places the "
                "tensor on tfmp's mesh, and no distribution is set (nor a tfmp "
                "strategy's scope entered): call keras.distribution.set_distribution(...) "
                "first (with tfmp imported)."
            )
        else:
            mesh = strategy.extended.home_mesh.dtensor_mesh
        specs = _specs(layout, mesh, tensor.shape.rank)
        specs = [
            dtensor.UNSHARDED
            if spec != dtensor.UNSHARDED and tensor.shape[dim] % mesh.dim_size(spec)
            else spec
            for dim, spec in enumerate(specs)
        ]
        return to_layout(tensor, dtensor.Layout(specs, mesh))
    mesh = forward_mesh()
    if mesh is None:
        return tensor
    return dtensor.relayout(tensor, traced_layout(tensor, layout, mesh, batch_axis))


def traced_layout(tensor: Any, layout: Any, mesh: dtensor.Mesh, batch_axis: str | None) -> dtensor.Layout:
    """The DTensor layout `distribute_tensor` gives `tensor` in a traced
    step: the batch axis's dimension as tfmp laid the batch out (`MATCH`)."""
    specs = _specs(layout, mesh, tensor.shape.rank)
    return dtensor.Layout([dtensor.MATCH if spec == batch_axis else spec for spec in specs], mesh)


def _specs(layout: Any, mesh: dtensor.Mesh, rank: int) -> list[str]:
    """The DTensor sharding specs of a Keras layout, checked against the tensor."""
    if isinstance(layout, dtensor.Layout):
        return list(layout.sharding_specs)
    axes = tuple(getattr(layout, "axes", layout))
    if len(axes) != rank:
        raise ValueError(
            f"keras.distribution.distribute_tensor: layout {axes} has {len(axes)} "
            f"entries for a tensor of rank {rank}; give one mesh axis or None per "
            "dimension."
        )
    for axis in axes:
        if axis is not None and axis not in mesh.dim_names:
            raise ValueError(
                f"keras.distribution.distribute_tensor: layout {axes} names mesh axis "
                f"{axis!r}, and the mesh has axes {list(mesh.dim_names)}."
            )
    return [axis or dtensor.UNSHARDED for axis in axes]


def get_device_count(device_type: str | None = None) -> int:
    """`keras.distribution.get_device_count` on TensorFlow."""
    return len(tf_distribution_lib.list_devices(device_type))


def initialize(
    job_addresses: str | Sequence[str] | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """`keras.distribution.initialize` on TensorFlow: `tfmp.initialize`.

    TensorFlow's multi-client runtime needs the address of every process (on
    JAX one coordinator address is enough), in process-id order.
    """
    if isinstance(job_addresses, str):
        job_addresses = [address.strip() for address in job_addresses.split(",")]
    if job_addresses is not None and num_processes not in (None, len(job_addresses)):
        raise ValueError(
            f"keras.distribution.initialize(job_addresses={job_addresses}, "
            f"num_processes={num_processes}): on TensorFlow (through tfmp.initialize) "
            "job_addresses lists every process's host:port, in process-id order, "
            f"so it needs {num_processes} addresses (a single coordinator address "
            "is JAX's convention)."
        )
    distributed.initialize(jobs=job_addresses, client_id=process_id)
