"""Where `tfmp.initialize` finds the cluster: arguments, a cluster resolver,
or the environment a cluster manager sets.

The environment is read in this order: DTensor's own `DTENSOR_*` variables
(`tfmp launch` sets them), `TF_CONFIG` (Kubeflow's TFJob, hand-made
Kubernetes jobs), a SLURM job step (`srun`), a multi-host Cloud TPU slice. All
but the first go through TensorFlow's cluster resolvers, the ones
`MultiWorkerMirroredStrategy` and `TPUStrategy` take, so a job script written
for those strategies runs unchanged. Every source that describes several
clients must describe the same run: two that disagree are a `ValueError`
naming both, never a silent pick.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Sequence

import tensorflow as tf

# The first port of a SLURM step's or TPU slice's clients on each host, as
# TensorFlow's SlurmClusterResolver counts (tasks on one host take the next
# ones); `srun --resv-ports` picks them instead.
DEFAULT_PORT_BASE = 8888

# The task types of a TF_CONFIG cluster that are DTensor clients, in client-id
# order: MultiWorkerMirroredStrategy's chief is a worker that also writes.
_CLIENT_TASK_TYPES = ("chief", "worker")

_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"worker": ["host0:port", "host1:port"]}, "task": {"type": "worker", "index": 0}}'
)


@dataclasses.dataclass(frozen=True)
class Found:
    """A cluster as one source describes it."""

    jobs: tuple[str, ...]
    client_id: int
    source: str
    device_type: str | None = None  # a source that knows it (Cloud TPU)

    @property
    def num_clients(self) -> int:
        return len(self.jobs)

    def describe(self) -> str:
        return f"{self.source} ({self.num_clients} clients, this one {self.client_id})"


def find_cluster(
    jobs: Sequence[str] | None,
    client_id: int | None,
    cluster_resolver: Any,
    device_type: str,
) -> Found:
    """The cluster from the arguments, else the resolver, else the
    environment (checked against every other source it holds)."""
    if jobs is not None and cluster_resolver is not None:
        raise ValueError(
            "tfmp.initialize got both jobs= and cluster_resolver=: pass one of them "
            "(the resolver already lists every client)."
        )
    if jobs is not None:
        return Found(tuple(jobs), 0 if client_id is None else client_id, "the arguments")
    if cluster_resolver is not None:
        found = from_resolver(cluster_resolver, f"cluster_resolver={type(cluster_resolver).__name__}")
        return dataclasses.replace(found, client_id=found.client_id if client_id is None else client_id)
    found = [source() for source in _environment_sources(device_type)]
    found = [f for f in found if f is not None]
    if not found:
        return Found(("localhost:0",), 0 if client_id is None else client_id, "no cluster (one client)")
    chosen = found[0]
    for other in found[1:]:
        if other.num_clients > 1 and (other.num_clients, other.client_id) != (chosen.num_clients, chosen.client_id):
            raise ValueError(
                f"tfmp.initialize: the environment describes two different runs: "
                f"{chosen.describe()} and {other.describe()}. Unset the variables of the "
                "one that does not describe this job (a cluster manager sets its own; "
                "`tfmp launch` sets DTENSOR_*), or pass cluster_resolver= to choose."
            )
    _check_dtensor_counts(chosen)
    if chosen.source == "SLURM":  # only the chosen source may set this task's GPUs
        chosen = _from_slurm(device_type, assign_gpus=True)
    if client_id is not None:
        chosen = dataclasses.replace(chosen, client_id=client_id)
    return chosen


def from_resolver(resolver: Any, source: str) -> Found:
    """The clients a `tf.distribute.cluster_resolver.ClusterResolver` lists:
    its chief, then its workers; this client is the resolver's own task."""
    if not isinstance(resolver, tf.distribute.cluster_resolver.ClusterResolver):
        raise TypeError(
            f"cluster_resolver={resolver!r} is not a tf.distribute.cluster_resolver."
            "ClusterResolver: pass one such as TFConfigClusterResolver(), "
            "SlurmClusterResolver() or TPUClusterResolver(tpu='local')."
        )
    if isinstance(resolver, tf.distribute.cluster_resolver.TPUClusterResolver):
        return _tpu_slice(resolver, source)
    spec = resolver.cluster_spec().as_dict()
    others = sorted(set(spec) - set(_CLIENT_TASK_TYPES))
    if others:
        raise ValueError(
            f"{source} lists tasks of type {others} besides chief and worker: tfmp's clients "
            "are all peers (no parameter servers or evaluators); give the job only "
            "chief and worker tasks."
        )
    task_jobs = {task_type: _addresses(spec.get(task_type, [])) for task_type in _CLIENT_TASK_TYPES}
    jobs = tuple(task_jobs["chief"] + task_jobs["worker"])
    if not jobs:
        return Found(("localhost:0",), 0, f"{source}, one client")
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type not in _CLIENT_TASK_TYPES or task_id is None:
        raise ValueError(
            f"{source} describes {len(jobs)} clients {list(jobs)} but not which one this "
            f"process is (task type {task_type!r}, index {task_id!r}): set this task's "
            "type (chief or worker, one the cluster lists) and index."
        )
    offset = len(task_jobs["chief"]) if task_type == "worker" else 0
    return Found(jobs, offset + int(task_id), source)


def _addresses(tasks: Any) -> list[str]:
    return list(tasks.values()) if isinstance(tasks, dict) else list(tasks)


def _environment_sources(device_type: str) -> tuple[Callable[[], Found | None], ...]:
    return (_from_dtensor_variables, _from_tf_config, lambda: _from_slurm(device_type, False), _from_tpu_slice)


def _from_dtensor_variables() -> Found | None:
    if not os.environ.get("DTENSOR_JOBS"):
        return None
    return Found(
        tuple(os.environ["DTENSOR_JOBS"].split(",")),
        int(os.environ.get("DTENSOR_CLIENT_ID", "0")),
        "DTENSOR_JOBS / DTENSOR_CLIENT_ID",
    )


def _from_tf_config() -> Found | None:
    text = os.environ.get("TF_CONFIG")
    if not text:
        return None
    try:
        config = json.loads(text)
        task_type = config.get("task", {}).get("type")
        if config.get("cluster") and task_type not in config["cluster"]:
            raise KeyError(task_type)
    except (ValueError, KeyError, AttributeError) as error:
        raise ValueError(f"TF_CONFIG={text!r} is not a cluster such as {_TF_CONFIG_EXAMPLE}.") from error
    return from_resolver(tf.distribute.cluster_resolver.TFConfigClusterResolver(), "TF_CONFIG")


def _from_slurm(device_type: str, assign_gpus: bool) -> Found | None:
    """A SLURM job step: `srun` sets SLURM_STEP_* in each of its tasks (the
    batch script of `sbatch` alone is no step, and one client). With
    `assign_gpus`, tasks sharing a host's GPUs get their part of them."""
    if "SLURM_STEP_NUM_TASKS" not in os.environ:
        return None
    try:
        resolver = _slurm_resolver(device_type == "GPU" and assign_gpus)
    except (RuntimeError, ValueError, OSError) as error:
        raise ValueError(
            f"SLURM: the job step's variables do not make a cluster: {error}. Start "
            "each client with srun (it sets SLURM_PROCID, SLURM_STEP_NUM_TASKS, "
            "SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE), or pass "
            "cluster_resolver=tf.distribute.cluster_resolver.SlurmClusterResolver(...)."
        ) from error
    return from_resolver(resolver, "SLURM")


def _slurm_resolver(assign_gpus: bool) -> Any:
    port_base = _reserved_port() or DEFAULT_PORT_BASE
    resolver_class = tf.distribute.cluster_resolver.SlurmClusterResolver
    if assign_gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
        # Each task sees every GPU of its host: TensorFlow's resolver shares
        # them out among the host's tasks (CUDA_VISIBLE_DEVICES per task).
        return resolver_class(port_base=port_base)
    # SLURM bound this task's GPUs (`--gpus-per-task` sets
    # CUDA_VISIBLE_DEVICES), the devices are CPUs, or the step is only
    # checked against another source: keep the devices as they are.
    # The resolver lays tasks out only in steps of GPUs: one "GPU" per task.
    tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
    return resolver_class(port_base=port_base, gpus_per_node=tasks, gpus_per_task=1, auto_set_gpu=False)


def _reserved_port() -> int | None:
    """The first port `srun --resv-ports` reserved for the step, e.g. of
    SLURM_STEP_RESV_PORTS=12000-12003."""
    ports = os.environ.get("SLURM_STEP_RESV_PORTS")
    if not ports:
        return None
    match = re.match(r"(\d+)", ports)
    if not match:
        raise ValueError(f"SLURM_STEP_RESV_PORTS={ports!r} is not a port range such as '12000-12003'.")
    return int(match.group(1))


def _from_tpu_slice() -> Found | None:
    """A multi-host Cloud TPU slice: GKE sets TPU_WORKER_HOSTNAMES and
    TPU_WORKER_ID in each host's pod (on TPU VMs, export them from the
    metadata server, docs/multi-host.md)."""
    if not os.environ.get("TPU_WORKER_HOSTNAMES"):
        return None
    return from_resolver(tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local"), "Cloud TPU")


def _tpu_slice(resolver: Any, source: str) -> Found:
    """A TPU's clients are the hosts of its slice (TPU_WORKER_HOSTNAMES, this
    one TPU_WORKER_ID), else this host alone: a TPUClusterResolver names the
    TPU's own workers, which are not DTensor clients."""
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(hosts) <= 1:
        return Found(("localhost:0",), 0, f"{source}, one host", device_type="TPU")
    worker = os.environ.get("TPU_WORKER_ID", "")
    if not worker.isdigit():
        raise ValueError(
            f"{source}: TPU_WORKER_HOSTNAMES lists {len(hosts)} hosts but TPU_WORKER_ID="
            f"{worker!r} does not say which one this is: set it to this host's index (0 to {len(hosts) - 1})."
        )
    return Found(tuple(f"{host}:{DEFAULT_PORT_BASE}" for host in hosts), int(worker), source, device_type="TPU")


def _check_dtensor_counts(chosen: Found) -> None:
    """DTENSOR_NUM_CLIENTS and DTENSOR_CLIENT_ID, where set, must be the run's:
    `initialize` sets them for DTensor from the cluster it found."""
    for variable, value in (("DTENSOR_NUM_CLIENTS", chosen.num_clients), ("DTENSOR_CLIENT_ID", chosen.client_id)):
        given = os.environ.get(variable)
        if given and given != str(value):
            raise ValueError(
                f"tfmp.initialize: {variable}={given} contradicts {chosen.describe()}. "
                f"Unset {variable} (tfmp sets it from the cluster), or the variables of "
                f"{chosen.source} if they are not this job's."
            )
