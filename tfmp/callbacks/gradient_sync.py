"""`GradientSyncMonitor`: what a step communicates, and whether replicas agree."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp import distributed
from tfmp.callbacks.collective_time import CollectiveTimer
from tfmp.callbacks.gradient_norms import GradientNormRecorder
from tfmp.inspect.comm_report import comm_report
from tfmp.strategy import agreement

ON_MISMATCH = ("warn", "stop")


class GradientSyncMonitor(keras.callbacks.Callback):
    """Reports gradient synchronization and checks that replicas stay equal.

    - After the first epoch: the collectives of one training step per device,
      from `tfmp.comm_report` (no cost to later steps): `sync/gradient_bytes`
      (gradient synchronization), `sync/activation_bytes` (forward and
      backward activations), `sync/weight_gather_bytes`,
      `sync/replicated_op_bytes` (inputs gathered for ops DTensor has no
      layout rule for), `sync/collectives` and `sync/<axis>/bytes`. Under
      `tf.distribute.MirroredStrategy`, `sync/gradient_bytes` is the bytes of
      the trainable variables it all-reduces each step.
    - Every `check_every_n_epochs` epochs: every copy of every replicated
      variable, and of every replicated shard, is compared bit for bit across
      devices (model and optimizer variables). In a multi-client run, each
      client compares its own devices' copies, and every client's copies with
      the other clients' through CRC-32 fingerprints exchanged in the
      coordination service's key-value store (every client must use the
      monitor). `sync/mismatched_variables` counts the variables whose copies
      differ; each is warned about with its path and largest difference (NaN
      for a difference between clients), and with `on_mismatch="stop"`
      training stops.
    - With `grad_norms=True`, at each epoch end: `grad_norm/global` and
      `grad_norm/<variable path>`, the norms of the synchronized gradients of
      the epoch's last step (the gradients the optimizer applies).
    - With `profile_steps=(first, last)`, from the epoch in which step `last`
      ends: the TF profiler's view of those steps (1-based, counted across
      epochs): `sync/collective_seconds` (wall time per step during which
      some device ran a collective), `sync/op_seconds` (during which some
      device ran any op), `sync/profiled_step_seconds` and
      `sync/collective_fraction` (collective time over step time). A
      collective's time includes waiting for its slowest peer, so on
      simulated CPU devices sharing cores it is mostly waiting.

    Args:
        check_every_n_epochs: Epochs between replica checks (0: never).
        on_mismatch: `"warn"` or `"stop"`.
        grad_norms: Whether to log gradient norms. Costs one norm per
            variable per step, and under tfmp one scalar reduction per split
            variable.
        profile_steps: `(first, last)` steps to profile, or None.
        profile_dir: Where the profile is written (for TensorBoard's profile
            plugin); a temporary directory if None.

    Examples:
        >>> monitor = tfmp.callbacks.GradientSyncMonitor(on_mismatch="stop")
        >>> history = model.fit(x, y, epochs=3, callbacks=[monitor], verbose=0)
    """

    def __init__(
        self,
        check_every_n_epochs: int = 1,
        on_mismatch: str = "warn",
        grad_norms: bool = False,
        profile_steps: tuple[int, int] | None = None,
        profile_dir: str | None = None,
    ):
        super().__init__()
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(
                f"GradientSyncMonitor(on_mismatch={on_mismatch!r}): use one of {ON_MISMATCH}."
            )
        self.check_every_n_epochs = check_every_n_epochs
        self.on_mismatch = on_mismatch
        self.traffic: dict[str, float] | None = None
        self.mismatches: list[tuple[str, float]] = []
        self.grad_norms = grad_norms
        self._norm_recorder: GradientNormRecorder | None = None
        self._timer = CollectiveTimer(profile_steps, profile_dir) if profile_steps else None

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        if self.grad_norms and getattr(self._norm_recorder, "model", None) is not model:
            self._norm_recorder = GradientNormRecorder(model)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._timer is not None:
            self._timer.batch_begin()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._timer is not None:
            self._timer.batch_end(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._timer is not None:
            self._timer.train_end()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        if self._timer is not None and self._timer.result is not None:
            logs.update(self._timer.result)
        if self.traffic is None:
            self.traffic = step_traffic(self.model)
        logs.update(self.traffic)
        if self._norm_recorder is not None:
            logs.update(self._norm_recorder.logs())
        if self.check_every_n_epochs and (epoch + 1) % self.check_every_n_epochs == 0:
            self.mismatches = replica_mismatches(self.model)
            logs["sync/mismatched_variables"] = float(len(self.mismatches))
            for path, difference in self.mismatches:
                where = (
                    "across clients (their fingerprints differ)"
                    if math.isnan(difference)
                    else f"across devices (largest difference {difference:g})"
                )
                warnings.warn(
                    f"tfmp: the copies of {path!r} differ {where}: replicas have drifted apart.",
                    stacklevel=2,
                )
            if self.mismatches and self.on_mismatch == "stop":
                self.model.stop_training = True


# comm_report's category -> the kind of traffic the monitor logs.
_TRAFFIC_KINDS = {
    "activations": "activation",
    "gradients": "gradient",
    "optimizer": "gradient",
    "weight-gathers": "weight_gather",
    "replicated-ops": "replicated_op",
}


def step_traffic(model: Any) -> dict[str, float]:
    """Bytes per device one training step communicates, by kind and mesh axis."""
    strategy = model.distribute_strategy
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        size = sum(
            int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in model.trainable_variables
        )
        return {"sync/gradient_bytes": float(size), "sync/activation_bytes": 0.0}
    report = comm_report(model, print_fn=lambda _: None)
    traffic = {
        "sync/gradient_bytes": 0.0,
        "sync/activation_bytes": 0.0,
        "sync/weight_gather_bytes": 0.0,
        "sync/replicated_op_bytes": 0.0,
        "sync/collectives": float(len(report.collectives)),
        # Collectives whose size or group tfmp could not read: their bytes
        # are missing from the figures above (tfmp.comm_report names them).
        "sync/unread_collectives": float(len(report.unread())),
    }
    for collective in report.collectives:
        traffic[f"sync/{_TRAFFIC_KINDS[collective.category]}_bytes"] += collective.bytes
        key = f"sync/{','.join(collective.axes)}/bytes"
        traffic[key] = traffic.get(key, 0.0) + collective.bytes
    return traffic


def replica_mismatches(model: Any) -> list[tuple[str, float]]:
    """(path, largest difference) of each variable whose copies differ.

    In a multi-client run, copies on other clients are compared by their
    fingerprints (each client's first copy of each shard; its own copies are
    compared bit for bit first): such a difference is NaN, unknown here.
    """
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    multi_client = dtensor.num_clients() > 1
    mismatches = []
    shard_fingerprints = []
    for variable in variables:
        groups = _copy_groups(getattr(variable, "value", variable))
        difference = _largest_difference(groups.values())
        if difference is not None:
            mismatches.append((variable.path, difference))
        if multi_client:
            fingerprints = {shard: agreement.fingerprint(copies[0]) for shard, copies in groups.items()}
            shard_fingerprints.append((variable.path, fingerprints))
    if multi_client:
        mismatches += _across_clients(shard_fingerprints, {path for path, _ in mismatches})
    return mismatches


def _across_clients(
    shard_fingerprints: list[tuple[str, dict[str, int]]], known: set[str]
) -> list[tuple[str, float]]:
    """The variables (other than `known`) some shard of which two clients
    hold with different bytes, with NaN differences."""
    records = [
        json.loads(record)
        for record in distributed.exchange("replica_copies", json.dumps(shard_fingerprints))
    ]
    mismatches = []
    for index, (path, _) in enumerate(records[0]):
        differs = agreement.shard_conflict([record[index][1] for record in records])
        if differs is not None and path not in known:
            mismatches.append((path, float("nan")))
    return mismatches


def _largest_difference(groups: Any) -> float | None:
    """The largest difference between copies that must be equal (each group
    holds copies of one shard), or None."""
    largest = None
    for copies in groups:
        reference = copies[0]
        for copy in copies[1:]:
            if not np.array_equal(copy, reference, equal_nan=True):
                difference = float(np.nanmax(np.abs(copy.astype("float64") - reference)))
                largest = difference if largest is None else max(largest, difference)
    return largest


def _copy_groups(variable: Any) -> dict[str, list[np.ndarray]]:
    """This client's host copies of each distinct shard (or of the whole
    variable), by shard (`tfmp.strategy.agreement.local_copies`)."""
    if getattr(variable, "layout", None) is not None:
        groups: dict[str, list[np.ndarray]] = {}
        for shard, copy in agreement.local_copies(variable):
            groups.setdefault(shard, []).append(copy)
        return groups
    values = getattr(variable, "values", None)  # a MirroredVariable's copies
    if values is not None:
        return {"": [v.numpy() for v in values]}
    return {}
