"""The replica context: one global replica whose collectives DTensor inserts."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class GlobalReplicaContext(tf.distribute.ReplicaContext):
    """Replica context in which the step runs once, on the global batch.

    Under DTensor the loss is already the mean over the global batch and the
    gradients are already global: DTensor's SPMD expansion inserts the
    all-reduces over the mesh. Replica-level collectives are therefore the
    identity; reporting several replicas to Keras would rescale the loss wrongly.
    """

    def __init__(self, strategy: tf.distribute.Strategy):
        super().__init__(strategy, replica_id_in_sync_group=0)

    def all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any:
        del reduce_op, options
        return value

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        del axis, options
        return value
