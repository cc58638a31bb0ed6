"""`tfmp.initialize()` on the clusters users run on: SLURM, Kubernetes
(TF_CONFIG), Cloud TPU, through TensorFlow's cluster resolvers.

Where the sources are found, in what order, and their contradictions are
checked in this process (nothing starts); two loopback runs start real
clients: 2 SLURM tasks that train like one process, and 2 Kubeflow TFJob
workers that join.
"""

import json
import os
import socket
import stat
import subprocess
import sys

import pytest
import tensorflow as tf

import tfmp
from tfmp import cluster_sources
from helpers import assert_trained_like_one_process

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "cluster_train.py")
CLUSTER_VARIABLES = ("DTENSOR_", "TF_CONFIG", "SLURM_", "TPU_", "KUBE_GOOGLE_CLOUD_TPU", "CUDA_VISIBLE_DEVICES")


def outside_any_cluster() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARIABLES)}


@pytest.fixture
def environment(monkeypatch):
    """This process' environment without any cluster's variables; returns a
    function that sets some."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # so that a resolver's own setting is undone too
    for name in set(os.environ) - set(outside_any_cluster()):
        monkeypatch.delenv(name)

    def set_variables(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_variables


def tf_config(workers, index, task_type="worker", chief=()):
    """TF_CONFIG as Kubeflow's TFJob operator sets it in each pod."""
    cluster = {"worker": list(workers)}
    if chief:
        cluster["chief"] = list(chief)
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, "environment": "cloud"})


def slurm_step(procid, tasks, nodelist, tasks_per_node, **more):
    """The variables `srun` sets in each task of a job step."""
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_JOB_ID": "4242",
        **more,
    }


def found(device_type="CPU"):
    return cluster_sources.find_cluster(None, None, None, device_type)


def test_sources_are_read_in_order_dtensor_tf_config_slurm_tpu(environment):
    assert found() == cluster_sources.Found(("localhost:0",), 0, "no cluster (one client)")
    environment(TPU_WORKER_HOSTNAMES="t0,t1", TPU_WORKER_ID="1")
    assert found() == cluster_sources.Found(("t0:8888", "t1:8888"), 1, "Cloud TPU", device_type="TPU")
    environment(**slurm_step(1, 2, "node[07-08]", "1(x2)"))
    assert found() == cluster_sources.Found(("node07:8888", "node08:8888"), 1, "SLURM")
    environment(TF_CONFIG=tf_config(["w0:2222", "w1:2222"], 1))
    assert found() == cluster_sources.Found(("w0:2222", "w1:2222"), 1, "TF_CONFIG")
    environment(DTENSOR_JOBS="d0:1,d1:1", DTENSOR_CLIENT_ID="1")
    assert found() == cluster_sources.Found(("d0:1", "d1:1"), 1, "DTENSOR_JOBS / DTENSOR_CLIENT_ID")


def test_slurm_tasks_get_ports_per_host_and_reserved_ports(environment):
    environment(**slurm_step(3, 4, "gpu[1-2]", "2(x2)"))
    assert found() == cluster_sources.Found(("gpu1:8888", "gpu1:8889", "gpu2:8888", "gpu2:8889"), 3, "SLURM")
    environment(SLURM_STEP_RESV_PORTS="12000-12001")
    assert found().jobs == ("gpu1:12000", "gpu1:12001", "gpu2:12000", "gpu2:12001")
    environment(SLURM_STEP_RESV_PORTS="any")
    with pytest.raises(ValueError, match="SLURM_STEP_RESV_PORTS='any' is not a port range"):
        found()


def test_slurm_shares_a_hosts_gpus_among_its_tasks_unless_slurm_bound_them(environment, tmp_path):
    # A host with 4 GPUs (as nvidia-smi lists them) and 2 tasks on it.
    nvidia_smi = tmp_path / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: H100 (UUID: GPU-{i})'\n" for i in range(4)))
    nvidia_smi.chmod(nvidia_smi.stat().st_mode | stat.S_IEXEC)
    environment(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", **slurm_step(1, 2, "gpu1", "2"))
    environment(DTENSOR_JOBS="a:1,b:1", DTENSOR_CLIENT_ID="1")
    assert found("GPU").source.startswith("DTENSOR_JOBS")
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # a step only checked against another source sets nothing
    os.environ.pop("DTENSOR_JOBS")
    os.environ.pop("DTENSOR_CLIENT_ID")
    assert found("GPU").jobs == ("gpu1:8888", "gpu1:8889")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # task 1's half, as TensorFlow splits them
    environment(CUDA_VISIBLE_DEVICES="0")  # srun --gpus-per-task 1: SLURM bound the task's GPU
    assert found("GPU").client_id == 1
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_slurm_without_a_step_is_no_cluster_and_a_broken_step_is_named(environment):
    environment(SLURM_JOB_ID="4242", SLURM_PROCID="0", SLURM_NTASKS="2")  # an sbatch script, no srun
    assert found().source == "no cluster (one client)"
    environment(SLURM_STEP_NUM_TASKS="2")
    with pytest.raises(ValueError, match="SLURM: the job step's variables do not make a cluster: SLURM_STEP_NODELIST not found"):
        found()


def test_contradictory_sources_are_errors_naming_both(environment):
    environment(DTENSOR_NUM_CLIENTS="2", TF_CONFIG=tf_config(["w0:1", "w1:1", "w2:1"], 0))
    with pytest.raises(ValueError, match=r"DTENSOR_NUM_CLIENTS=2 contradicts TF_CONFIG \(3 clients, this one 0\)"):
        tfmp.initialize()
    environment(DTENSOR_NUM_CLIENTS="3", **slurm_step(1, 2, "n[1-2]", "1(x2)"))
    with pytest.raises(ValueError, match=r"two different runs: TF_CONFIG \(3 clients, this one 0\) and SLURM \(2 clients, this one 1\)"):
        tfmp.initialize()
    # A one-task step does not contradict the clients it starts (`srun -n 1 tfmp launch ...`).
    environment(DTENSOR_NUM_CLIENTS="2", DTENSOR_JOBS="127.0.0.1:1,127.0.0.1:2", **slurm_step(0, 1, "n1", "1"))
    os.environ.pop("TF_CONFIG")
    assert found().source == "DTENSOR_JOBS / DTENSOR_CLIENT_ID"


def test_tf_config_with_a_chief_puts_it_first_and_refuses_other_task_types(environment):
    environment(TF_CONFIG=tf_config(["w0:1", "w1:1"], 1, chief=["c:1"]))
    assert found() == cluster_sources.Found(("c:1", "w0:1", "w1:1"), 2, "TF_CONFIG")
    environment(TF_CONFIG=tf_config(["w0:1"], 0, task_type="chief", chief=["c:1"]))
    assert found().client_id == 0
    environment(TF_CONFIG=json.dumps({"cluster": {"worker": ["w0:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match=r"TF_CONFIG lists tasks of type \['ps'\] besides chief and worker"):
        found()
    environment(TF_CONFIG="{not json")
    with pytest.raises(ValueError, match="TF_CONFIG='{not json' is not a cluster such as"):
        found()


def test_cluster_resolver_argument(environment):
    spec = tf.train.ClusterSpec({"chief": ["c:1"], "worker": ["w0:1", "w1:1"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
    environment(TF_CONFIG=tf_config(["x:1", "y:1"], 1))  # an argument overrides the environment
    assert cluster_sources.find_cluster(None, None, resolver, "CPU") == cluster_sources.Found(
        ("c:1", "w0:1", "w1:1"), 1, "cluster_resolver=SimpleClusterResolver"
    )
    local_tpu = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local")
    assert cluster_sources.find_cluster(None, None, local_tpu, "CPU") == cluster_sources.Found(
        ("localhost:0",), 0, "cluster_resolver=TPUClusterResolver, one host", device_type="TPU"
    )
    environment(TPU_WORKER_HOSTNAMES="t0,t1,t2")
    with pytest.raises(ValueError, match="TPU_WORKER_HOSTNAMES lists 3 hosts but TPU_WORKER_ID='' does not say"):
        cluster_sources.find_cluster(None, None, local_tpu, "CPU")
    unnamed = tf.distribute.cluster_resolver.SimpleClusterResolver(spec)
    with pytest.raises(ValueError, match=r"describes 3 clients .* but not which one this process is"):
        tfmp.initialize(cluster_resolver=unnamed)
    with pytest.raises(TypeError, match="cluster_resolver='10.0.0.1:2222' is not a tf.distribute.cluster_resolver"):
        tfmp.initialize(cluster_resolver="10.0.0.1:2222")
    with pytest.raises(ValueError, match="both jobs= and cluster_resolver="):
        tfmp.initialize(jobs=["a:1", "b:1"], cluster_resolver=resolver)


def two_free_ports() -> int:
    """A port p such that p and p + 1 are free (`srun --resv-ports 2`)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def run_clients(environments, program_args, timeout):
    clients = [
        subprocess.Popen(
            [sys.executable, *program_args], env={**outside_any_cluster(), **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for env in environments
    ]
    try:
        outputs = [client.communicate(timeout=timeout)[0] for client in clients]
    finally:
        for client in clients:
            client.kill()
    for client, output in zip(clients, outputs):
        assert client.returncode == 0, output[-3000:]
    return outputs


def test_two_slurm_tasks_on_one_host_train_like_one_process(tmp_path):
    """`srun --nodes 1 --ntasks 2 --resv-ports 2 python train_mlp.py` on this machine."""
    port = two_free_ports()
    tasks = [
        {**slurm_step(task, 2, "localhost", "2", SLURM_STEP_RESV_PORTS=f"{port}-{port + 1}"), "TFMP_NUM_LOCAL_DEVICES": "4"}
        for task in range(2)
    ]
    outputs = run_clients(tasks, [os.path.join(PROGRAMS, "train_mlp.py"), str(tmp_path)], timeout=280)
    for task, output in enumerate(outputs):
        assert f"tfmp.initialize: client {task} of 2 from SLURM, 4 local CPU devices" in output, output[-3000:]
    assert "task:1/device:CPU:3" in outputs[1]
    assert_trained_like_one_process(tmp_path)


def test_two_tfjob_workers_train_from_the_tf_config_the_operator_sets(tmp_path):
    """Each pod of examples/kubernetes/tfjob.yaml runs examples/cluster_train.py
    with this TF_CONFIG (here loopback addresses for the pods' service names)."""
    port = two_free_ports()
    workers = [f"localhost:{port}", f"localhost:{port + 1}"]
    pods = [{"TF_CONFIG": tf_config(workers, index), "TFMP_NUM_LOCAL_DEVICES": "2"} for index in range(2)]
    program = [EXAMPLE, "--epochs", "1", "--hidden", "32", "--backup-dir", str(tmp_path)]
    outputs = run_clients(pods, program, timeout=200)
    for index, output in enumerate(outputs):
        assert f"tfmp.initialize: client {index} of 2 from TF_CONFIG, 2 local CPU devices" in output, output[-3000:]
        assert f"client {index} of 2 on mesh DeviceMesh(batch=2, model=2; 4 x CPU): final loss" in output
    # Client 0 wrote the model, and removed the backups of the finished run.
    assert sorted(os.listdir(tmp_path)) == ["model.keras", "model.keras.sha256"]
