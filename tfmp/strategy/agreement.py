"""The clients of a multi-client run train the same model on the same batches.

Each client builds its model, plan and input pipeline itself. Clients that
differ do not fail: a client seeded otherwise trains its own copies of the
replicated weights (both report the same losses, their weights drift apart);
a client with other layout rules runs other collectives, and both wait for
each other forever. So before a model's first step on the mesh every client
publishes what it holds, and all compare (`check_model`): the plan (mesh,
layout rules, batch axis and strategy settings) and every variable's path,
shape, dtype and layout, and a fingerprint of its values. Fingerprints are
CRC-32s of this client's copy of each shard it holds (read from one of its
devices, no collective); clients that hold the same shard must hold the same
bytes. A shard only one client holds has no copy to disagree with.
`check_batch_order` compares the fingerprints of the batches each client
read in an epoch (opt in: `tfmp.callbacks.InputOrderCheck`).

The records travel through the coordination service's key-value store
(`tfmp.distributed.exchange`), never through a collective, so a check meets
even clients whose collectives would not.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp import distributed

_SAME_WEIGHTS = (
    "Build the model from the same weights on every client: call "
    "keras.utils.set_random_seed(seed) with the same seed in every client before "
    "building it (or load the same weights into it)."
)
_SAME_PLAN = (
    "Run the same program with the same settings on every client: the same mesh "
    "(shape, axis names, device order), the same LayoutMap rules and the same "
    "ModelParallelStrategy arguments."
)
_SAME_MODEL = "Build the same model, with the same layer names, on every client."
_SAME_BATCHES = (
    "Feed every client the same data in the same order: the same files, and a "
    "shuffle with the same seed (shuffle(..., seed=S), or "
    "keras.utils.set_random_seed(S) in every client before making the dataset)."
)


class ClientsDisagreeError(ValueError):
    """The clients of a multi-client run hold different models, plans or batches.

    Raised on every client at once, before the model's first step on the mesh
    (or, for batches, at the end of the epoch that `InputOrderCheck` checks);
    the message names the client that differs from client 0, the first
    difference and the fix.

    Examples:
        >>> error = tfmp.ClientsDisagreeError("client 1 differs from client 0")
        >>> isinstance(error, ValueError)
        True
    """

    # Exception's own: autograph re-raises an error of such a class as
    # itself (else as a StagingError) from a custom loop's traced step.
    __init__ = Exception.__init__


def check_model(variables: list[Any], plan: dict[str, Any]) -> None:
    """Compares `variables` (mesh variables no check has seen yet) and the
    plan across clients; marks the variables checked.

    Raises:
        ClientsDisagreeError: On every client, if some client differs.
    """
    if dtensor.num_clients() == 1 or not variables:
        return
    record = {"plan": plan, "variables": [_variable_record(v) for v in variables]}
    records = [json.loads(r) for r in distributed.exchange("model", json.dumps(record))]
    for client, other in enumerate(records[1:], start=1):
        difference = _plan_difference(records[0]["plan"], other["plan"], client)
        difference = difference or _structure_difference(
            records[0]["variables"], other["variables"], client
        )
        if difference is not None:
            _refuse_model(client, 0, *difference)
    for index, (path, *_) in enumerate(records[0]["variables"]):
        conflict = shard_conflict([r["variables"][index][4] for r in records])
        if conflict is not None:
            shard, first, client = conflict
            where = f" (shard {shard} along its split axes)" if shard else ""
            what = (
                f"in the values of {path!r}{where}: both hold a copy, and the copies' "
                "fingerprints differ"
            )
            _refuse_model(client, first, what, _SAME_WEIGHTS)
    for variable in variables:
        variable.agreed = True


def shard_conflict(fingerprints: list[dict[str, int]]) -> tuple[str, int, int] | None:
    """The first shard two clients hold with different fingerprints, as
    (shard, first client holding it, a client that differs), or None.

    Args:
        fingerprints: Each client's fingerprint of each shard it holds.
    """
    first: dict[str, int] = {}
    for client, held in enumerate(fingerprints):
        for shard, value in held.items():
            holder = first.setdefault(shard, client)
            if fingerprints[holder][shard] != value:
                return shard, holder, client
    return None


def _refuse_model(client: int, reference: int, what: str, fix: str) -> None:
    _refuse(
        "model",
        f"tfmp: the clients of this run do not hold the same model: client {client} "
        f"differs from client {reference} {what}. {fix} (tfmp compares every "
        "client's model before its first step on the mesh.)",
    )


class BatchOrder:
    """The fingerprints of the training batches this client read since the
    last check, and which part of each batch it reads (0: whole batches)."""

    def __init__(self):
        self.part = 0
        self.batches: list[int] = []

    def record(self, batch: Any, part: int) -> None:
        self.part = part
        self.batches.append(batch_fingerprint(batch))

    def check(self, epoch: int) -> None:
        """`check_batch_order` of the batches read since the last check."""
        batches, self.batches = self.batches, []
        check_batch_order(epoch, self.part, batches)


def check_batch_order(epoch: int, part: int, batches: list[int]) -> None:
    """Compares the fingerprints of the batches this client read in `epoch`
    with those of the clients that read the same part of each batch (`part`:
    its input pipeline; all clients read whole batches unless they read their
    own rows through `distribute_datasets_from_function`).

    Raises:
        ClientsDisagreeError: On every client, if some client read other
            batches than the first client of its part.
    """
    record = json.dumps({"part": part, "batches": batches})
    records = [json.loads(r) for r in distributed.exchange("batch_order", record)]
    first_of_part: dict[int, int] = {}
    for client, other in enumerate(records):
        reference = first_of_part.setdefault(other["part"], client)
        theirs, ours = records[reference]["batches"], other["batches"]
        if theirs == ours:
            continue
        index = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
        where = (
            f"read another batch at batch index {index}"
            if index is not None
            else f"read {len(ours)} batches where client {reference} read {len(theirs)}"
        )
        _refuse(
            "batch_order",
            f"tfmp: client {client} and client {reference} of this run train on "
            f"different data: in epoch index {epoch} (both counted from 0) client "
            f"{client} {where} (its batches' fingerprints differ from client "
            f"{reference}'s). {_SAME_BATCHES}",
        )


def batch_fingerprint(batch: Any) -> int:
    """A CRC-32 of every host array of a batch (shapes, dtypes and bytes)."""
    crc = 0
    for value in tf.nest.flatten(batch, expand_composites=True):  # ragged: its parts
        if value is None:
            continue
        array = np.asarray(value)
        crc = zlib.crc32(f"{array.shape}{array.dtype}".encode(), crc)
        if array.dtype.kind in "OUS":  # text: a string tensor's bytes objects
            crc = zlib.crc32(repr(array.tolist()).encode(), crc)
        else:
            crc = zlib.crc32(_bytes_of(array), crc)
    return crc


def local_copies(variable: Any, one_per_shard: bool = False) -> list[tuple[str, np.ndarray]]:
    """(shard, host value) of each of this client's devices' copies of a mesh
    variable, in the mesh's local device order; with `one_per_shard`, only
    the first copy of each shard. A shard is named by the device's positions
    along the mesh axes the layout splits (`"0,2"`; `""` when replicated).

    Each copy is read from its own device's resource: a DTensor read of a
    replicated variable would hand back one device's value for all.
    """
    layout = variable.layout
    split_axes = [spec for spec in layout.sharding_specs if spec != dtensor.UNSHARDED]
    copies, seen = [], set()
    for location, handle in zip(layout.mesh.local_device_locations(), dtensor.unpack(variable.handle)):
        shard = ",".join(str(location[axis]) for axis in split_axes)
        if one_per_shard and shard in seen:
            continue
        seen.add(shard)
        with tf.device(handle.device):
            copies.append((shard, tf.raw_ops.ReadVariableOp(resource=handle, dtype=variable.dtype).numpy()))
    return copies


def fingerprint(array: np.ndarray) -> int:
    """A CRC-32 of an array's bytes."""
    return zlib.crc32(_bytes_of(array))


def layout_text(layout: dtensor.Layout) -> str:
    """A layout as every client names it (a mesh's `to_string` names this
    client's local devices)."""
    mesh = layout.mesh
    axes = ", ".join(f"{name}={mesh.dim_size(name)}" for name in mesh.dim_names)
    return f"{list(layout.sharding_specs)} on mesh ({axes})"


def _bytes_of(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _refuse(topic: str, message: str) -> None:
    # Every client found the same difference: all raise, none exits first.
    distributed.wait_for_every_client(f"{topic}_refused")
    raise ClientsDisagreeError(message)


def _variable_record(variable: Any) -> list[Any]:
    shards = {shard: fingerprint(copy) for shard, copy in local_copies(variable, one_per_shard=True)}
    return [variable.path, list(variable.shape), variable.dtype.name, layout_text(variable.layout), shards]


def _plan_difference(reference: dict, other: dict, client: int) -> tuple[str, str] | None:
    for key, value in reference.items():
        if other.get(key) != value:
            return f"in its {key}: client 0 has {value}, client {client} {other.get(key)}", _SAME_PLAN
    return None


def _structure_difference(reference: list, other: list, client: int) -> tuple[str, str] | None:
    for index, (ours, theirs) in enumerate(zip(reference, other)):
        path, shape, dtype, layout, _ = ours
        if theirs[0] != path:
            return (
                f"at variable {index}: client 0 has {path!r}, client {client} {theirs[0]!r}",
                _SAME_MODEL,
            )
        for name, mine, its, fix in (
            ("shape", shape, theirs[1], _SAME_MODEL),
            ("dtype", dtype, theirs[2], _SAME_MODEL),
            ("layout", layout, theirs[3], _SAME_PLAN),
        ):
            if mine != its:
                return f"in the {name} of {path!r}: client 0 has {mine}, client {client} {its}", fix
    if len(reference) != len(other):
        longer = reference if len(reference) > len(other) else other
        return (
            f"in its number of variables: client 0 has {len(reference)}, client {client} "
            f"{len(other)} (the first extra: {longer[min(len(reference), len(other))][0]!r})",
            _SAME_MODEL,
        )
    return None
