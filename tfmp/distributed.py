"""`tfmp.initialize`: one tfmp run over several processes (DTensor clients).

Each process (a client, usually one per host) owns its local devices; a mesh
spans the devices of all clients, and DTensor's collectives run between them
over gRPC, TensorFlow's own multi-client runtime (the one TPU pods and
multi-host GPU jobs use). tfmp adds what the stock initialization lacks:
settings read from the cluster manager (`tfmp.cluster_sources`) and checked,
waits bounded by a timeout instead of hanging on a peer that never comes, and
a check that every client has as many devices.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp import cluster_sources
from tfmp import devices as devices_lib
from tfmp.integrations.internals import coordination_config_pb2
from tfmp.integrations.internals import eager_context as context

@dataclasses.dataclass(frozen=True)
class Cluster:
    """The clients of a run and which one this process is.

    Attributes:
        jobs: `host:port` of every client, in client-id order.
        client_id: This process's index into `jobs`.
        job_name: The gRPC job name all clients share.
        device_type: `"CPU"`, `"GPU"` or `"TPU"`.
        local_devices: Devices of that type each client has.
        timeout_s: How long a client waits for the others at a check all
            of them make (joining, tfmp's agreement checks).
        step_timeout_s: How long a step after the first of a `fit`,
            `evaluate` or `predict` may take before the run counts as stuck;
            None: 300 s, or 20 times the slowest step seen if that is longer.
        first_step_timeout_s: The same for the first step of each of those
            calls, which traces and compiles the step.
        source: Where the settings came from: "the arguments", a cluster
            resolver, "TF_CONFIG", "SLURM", ...
    """

    jobs: tuple[str, ...]
    client_id: int
    job_name: str
    device_type: str
    local_devices: int
    timeout_s: float = dataclasses.field(default=120.0, compare=False)
    step_timeout_s: float | None = None
    first_step_timeout_s: float = 900.0
    source: str = dataclasses.field(default="the arguments", compare=False)

    @property
    def num_clients(self) -> int:
        return len(self.jobs)

    @property
    def is_chief(self) -> bool:
        """Whether this client writes files that all clients save together."""
        return self.client_id == 0


_cluster: Cluster | None = None


def initialize(
    jobs: Sequence[str] | None = None,
    client_id: int | None = None,
    device_type: str | None = None,
    num_local_devices: int | None = None,
    timeout_s: float = 120.0,
    job_name: str = "worker",
    step_timeout_s: float | None = None,
    first_step_timeout_s: float | None = None,
    cluster_resolver: Any = None,
) -> Cluster:
    """Joins this process to a multi-client run; call it first in the program.

    Settings come from the arguments (`jobs`, or a `cluster_resolver` as
    `tf.distribute` strategies take), else from the cluster this process
    runs in, first found of: DTensor's variables (`DTENSOR_JOBS`,
    `DTENSOR_CLIENT_ID`, `DTENSOR_JOB_NAME`; `tfmp launch` sets them), a
    `TF_CONFIG` (Kubeflow's TFJob sets it), a SLURM job step (`srun`), a
    multi-host Cloud TPU slice (`TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`),
    read through TensorFlow's `TFConfigClusterResolver`,
    `SlurmClusterResolver` and `TPUClusterResolver`. Other sources in the
    environment that describe another run are an error. With none of them,
    the run has one client and nothing is set up. A run of several clients
    prints which source it used, the client id, the number of clients and
    local devices. Calling it again with the same settings returns the same
    cluster.

    Afterwards `tfmp.DeviceMesh` spans the devices of every client (client 0's
    first), each client feeds only its own devices' part of every batch, and
    `model.save` / `save_weights` write one file, from client 0, while every
    client takes part in gathering the values.

    Args:
        jobs: `host:port` of each client, in client-id order, the same list
            in every client.
        client_id: This client's index into `jobs`.
        device_type: The accelerator type: `"CPU"`, `"GPU"` or `"TPU"`; None
            reads `TFMP_DEVICE_TYPE` (set by `tfmp launch`), else the
            cluster's (`"TPU"` on a Cloud TPU), else `"CPU"`.
        num_local_devices: For `"CPU"`, how many logical CPU devices to split
            this host into (as `tfmp.simulate_devices`); the same in every
            client. None reads `TFMP_NUM_LOCAL_DEVICES` (set by `tfmp launch`),
            else keeps the host's current split.
        timeout_s: How long to wait for every client to join, and how long a
            client may stay silent before the others count it as dead.
        job_name: The gRPC job name, the same in every client.
        step_timeout_s: How long a training, evaluation or prediction step
            may take before the run counts as stuck: then every client stops
            with a message naming the clients that did not reach the step
            (docs/multi-host.md). None reads `TFMP_STEP_TIMEOUT` (set by
            `tfmp launch --step-timeout`), else takes 300 s, or 20 times the
            slowest step seen if that is longer.
        first_step_timeout_s: The same for the first step of each `fit`,
            `evaluate` and `predict`, which traces and compiles the step.
            None reads `TFMP_FIRST_STEP_TIMEOUT`, else takes 900 s.
        cluster_resolver: A `tf.distribute.cluster_resolver.ClusterResolver`
            (`TFConfigClusterResolver`, `SlurmClusterResolver`,
            `SimpleClusterResolver`, ...) whose chief and worker tasks are
            the clients, chief first; this client is its task. A
            `TPUClusterResolver` means TPU devices, and the hosts of the
            slice (`TPU_WORKER_HOSTNAMES`) as clients. Not with `jobs`.

    Returns:
        The `Cluster`.

    Raises:
        ValueError: For inconsistent settings: a client id out of range, a
            repeated address, clients with different numbers of devices, two
            sources in the environment that describe different runs.
        TypeError: If `cluster_resolver` is not a cluster resolver.
        TimeoutError: If some client did not join within `timeout_s`. The
            process cannot use TensorFlow afterwards and should exit.
        RuntimeError: If called again with other settings, or after
            TensorFlow has started.

    Examples:
        >>> import tfmp
        >>> # Skipped when run: it waits for a second host at 10.0.0.2.
        >>> cluster = tfmp.initialize(  # doctest: +SKIP
        ...     jobs=["10.0.0.1:9876", "10.0.0.2:9876"], client_id=0, num_local_devices=4)
        >>> # In each task of `srun --nodes 2 --ntasks-per-node 1 python train.py`:
        >>> cluster = tfmp.initialize()  # doctest: +SKIP
        >>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
    """
    global _cluster
    if num_local_devices is None and os.environ.get("TFMP_NUM_LOCAL_DEVICES"):
        num_local_devices = int(os.environ["TFMP_NUM_LOCAL_DEVICES"])  # set by `tfmp launch`
    device_type = device_type or os.environ.get("TFMP_DEVICE_TYPE")
    cluster = dataclasses.replace(
        _resolve(jobs, client_id, cluster_resolver, device_type, num_local_devices, job_name),
        timeout_s=timeout_s,
        **_step_timeouts(step_timeout_s, first_step_timeout_s),
    )
    if _cluster is not None:
        if dataclasses.replace(cluster, local_devices=_cluster.local_devices) != _cluster:
            raise RuntimeError(
                f"tfmp.initialize was already called with {_cluster}; it cannot "
                f"change to {cluster} in the same process."
            )
        return _cluster
    if cluster.num_clients == 1:
        if num_local_devices and cluster.device_type == "CPU":
            devices_lib.simulate_devices(num_local_devices)
        if cluster.device_type == "TPU":
            dtensor.initialize_accelerator_system("TPU")  # connects the TPU cores
        _cluster = dataclasses.replace(
            cluster, local_devices=len(devices_lib.list_devices(cluster.device_type))
        )
        return _cluster
    if context.context()._initialized:  # noqa: SLF001
        raise RuntimeError(
            "tfmp.initialize must run before TensorFlow starts: call it first in "
            "the program, before creating any tensor, model or mesh."
        )
    os.environ.update(
        DTENSOR_JOBS=",".join(cluster.jobs),
        DTENSOR_CLIENT_ID=str(cluster.client_id),
        DTENSOR_JOB_NAME=cluster.job_name,
        DTENSOR_NUM_CLIENTS=str(cluster.num_clients),
    )
    _configure_coordination(cluster, timeout_s)
    try:
        dtensor.initialize_accelerator_system(
            cluster.device_type,
            enable_coordination_service=False,  # configured above, with timeouts
            num_logical_cpu_devices=num_local_devices if cluster.device_type == "CPU" else None,
        )
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as error:
        raise TimeoutError(
            f"tfmp.initialize: not every client of {list(cluster.jobs)} joined within "
            f"{timeout_s:g} s (this is client {cluster.client_id}). Start all "
            f"{cluster.num_clients} clients with the same jobs list, each with its own "
            "client id, and check that their addresses are reachable. This process "
            "cannot use TensorFlow any more: exit and start again."
        ) from error
    local = sum(
        tf.DeviceSpec.from_string(device.name).task == cluster.client_id
        for device in tf.config.list_logical_devices(cluster.device_type)
    )
    _cluster = dataclasses.replace(cluster, local_devices=local)
    try:
        _check_device_counts(_cluster)
    except ValueError:
        _cluster = None
        raise
    print(
        f"tfmp.initialize: client {_cluster.client_id} of {_cluster.num_clients} from "
        f"{_cluster.source}, {_cluster.local_devices} local {_cluster.device_type} devices",
        file=sys.stderr,
        flush=True,
    )
    return _cluster


def cluster() -> Cluster | None:
    """The cluster `tfmp.initialize` set up, or None before it."""
    return _cluster


def _resolve(
    jobs: Sequence[str] | None,
    client_id: int | None,
    cluster_resolver: Any,
    device_type: str | None,
    num_local_devices: int | None,
    job_name: str,
) -> Cluster:
    found = cluster_sources.find_cluster(jobs, client_id, cluster_resolver, (device_type or "CPU").upper())
    jobs, client_id, source = found.jobs, found.client_id, found.source
    if found.source.startswith("DTENSOR_JOBS"):
        job_name = os.environ.get("DTENSOR_JOB_NAME", job_name)
    if not isinstance(client_id, int) or not 0 <= client_id < len(jobs):
        raise ValueError(
            f"client_id={client_id!r} (from {source}) is out of range for {len(jobs)} "
            f"clients {list(jobs)}: use 0 to {len(jobs) - 1}, a different one in each "
            "client."
        )
    if len(set(jobs)) != len(jobs):
        raise ValueError(f"jobs {list(jobs)} (from {source}) repeat an address: give each client its own host:port.")
    for job in jobs:
        host, _, port = job.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"jobs entry {job!r} (from {source}) is not host:port, such as '10.0.0.1:9876'.")
    device_type = (device_type or found.device_type or "CPU").upper()
    if device_type not in ("CPU", "GPU", "TPU"):
        raise ValueError(f"device_type={device_type!r}: use 'CPU', 'GPU' or 'TPU'.")
    if num_local_devices is not None and (not isinstance(num_local_devices, int) or num_local_devices < 1):
        raise ValueError(f"num_local_devices={num_local_devices!r}: use a positive integer or None.")
    return Cluster(jobs, client_id, job_name, device_type, num_local_devices or 0, source=source)


def _step_timeouts(step_timeout_s: float | None, first_step_timeout_s: float | None) -> dict[str, float | None]:
    """The watchdog's bounds, from the arguments else the environment."""
    settings = {}
    for name, value, variable in (
        ("step_timeout_s", step_timeout_s, "TFMP_STEP_TIMEOUT"),
        ("first_step_timeout_s", first_step_timeout_s, "TFMP_FIRST_STEP_TIMEOUT"),
    ):
        source = name
        if value is None and os.environ.get(variable):
            source, value = variable, os.environ[variable]
            try:
                value = float(value)
            except ValueError:
                pass
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{source}={value!r}: use a number of seconds above 0 (or leave it unset).")
        settings[name] = float(value)
    return settings


def _configure_coordination(cluster: Cluster, timeout_s: float) -> None:
    """The coordination service of DTensor's init, with bounded waits: the
    stock one waits forever for a client that never starts."""
    timeout_ms = int(timeout_s * 1000)
    config = coordination_config_pb2.CoordinationServiceConfig(
        service_type="standalone",
        service_leader=f"/job:{cluster.job_name}/replica:0/task:0",
        enable_health_check=True,
        cluster_register_timeout_in_ms=timeout_ms,
        cluster_register_with_barrier=True,
        heartbeat_timeout_in_ms=timeout_ms,
        shutdown_barrier_timeout_in_ms=timeout_ms,
    )
    context.context()._coordination_service_config = config  # noqa: SLF001


def _check_device_counts(cluster: Cluster) -> None:
    counts = dict(enumerate(int(c) for c in exchange("local_devices", str(cluster.local_devices))))
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"Clients have different numbers of {cluster.device_type} devices: "
            f"{counts} (client: devices). Every client needs the same number: give "
            "each the same num_local_devices, or hosts with as many accelerators."
        )


# How many rounds of each topic this client has exchanged.
_rounds: dict[str, int] = {}


def exchange(topic: str, value: str) -> list[str]:
    """Every client's `value` for `topic`, in client-id order.

    Each client publishes its value in the key-value store of TensorFlow's
    coordination service and reads every other's, waiting for each up to
    the cluster's `timeout_s`. No collective runs, so clients whose models
    or layouts differ (whose collectives would wait for each other forever)
    still meet here. Each call on a topic is a new round: every client must
    exchange the same topics in the same order, as the same program does.

    Args:
        topic: What is exchanged, part of the store's keys.
        value: This client's value.

    Returns:
        The values of clients 0, 1, ...; `[value]` with one client.

    Raises:
        TimeoutError: If a client did not publish its value in time: it runs
            another program, is stuck, or died.
    """
    clients, me, timeout_s = _participants()
    if clients == 1:
        return [value]
    round_ = _rounds.get(topic, 0)
    _rounds[topic] = round_ + 1
    key = f"tfmp/{topic}/{{}}/{{}}"
    ctx = context.context()
    ctx.set_config_key_value(key.format(round_, me), value)
    deadline = time.monotonic() + timeout_s
    values = []
    for client in range(clients):
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            values.append(ctx.get_config_key_value(key.format(round_, client), wait_ms))
        except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as error:
            raise TimeoutError(
                f"tfmp: client {client} did not reach the check {topic!r} (round "
                f"{round_}) within {timeout_s:g} s, which client {me} reached: every "
                "client must run the same program (it runs another, is stuck, or "
                "died). timeout_s of tfmp.initialize sets the wait."
            ) from error
    if round_:
        # Every client published this round after reading the last one, so
        # this client's value of the last round is read everywhere: the store
        # keeps two rounds of a topic, however many there are.
        ctx.delete_config_key_value(key.format(round_ - 1, me))
    return values


def _participants() -> tuple[int, int, float]:
    """How many clients the run has, which one this is, and how long to wait
    for the others: from `initialize`, else (DTensor set up directly) from
    DTensor, with `initialize`'s default wait."""
    if _cluster is not None:
        return _cluster.num_clients, _cluster.client_id, _cluster.timeout_s
    return dtensor.num_clients(), dtensor.client_id(), 120.0


def wait_for_every_client(topic: str) -> None:
    """Waits until every client calls this with `topic` (a new round each
    call), up to the cluster's `timeout_s`: before clients that found the
    same fault raise, so that the first to exit does not take the
    coordination service down before the others have read what they need."""
    clients, _, timeout_s = _participants()
    if clients == 1:
        return
    round_ = _rounds.get(topic, 0)
    _rounds[topic] = round_ + 1
    context.context().wait_at_barrier(f"tfmp/{topic}/{round_}", int(timeout_s * 1000))
