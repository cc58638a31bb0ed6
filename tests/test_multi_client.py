"""Several DTensor clients on loopback, against one process; bad settings."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import tfmp
from tfmp.launch import client_environments
from helpers import assert_trained_like_one_process, build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map, train

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")


def run_tfmp(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "tfmp", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("input_mode", ["global", "per_client"])
def test_two_clients_train_like_one_process(tmp_path, input_mode):
    finished = run_tfmp(
        "launch", "--num-processes", "2", "--devices-per-process", "4", "--timeout", "280",
        "--", sys.executable, os.path.join(PROGRAMS, "train_mlp.py"), str(tmp_path), input_mode,
    )
    assert finished.returncode == 0, finished.stdout[-3000:]
    assert "[client 1] client 1 of 2: local devices" in finished.stdout
    assert "task:1/device:CPU:3" in finished.stdout
    if input_mode == "per_client":
        assert "[client 1] client 1 read 32 rows" in finished.stdout
    assert_trained_like_one_process(tmp_path, input_mode)


def start_client(env_extra, timeout_s):
    return subprocess.Popen(
        [sys.executable, os.path.join(PROGRAMS, "join.py"), str(timeout_s)],
        env={**os.environ, **env_extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_a_peer_that_never_starts_is_an_error_within_the_timeout():
    env = client_environments(2, 2)[0]  # client 0 of 2; client 1 is never started
    started = time.monotonic()
    client = start_client(env, 5)
    output, _ = client.communicate(timeout=120)
    assert client.returncode != 0
    assert "TimeoutError: tfmp.initialize: not every client" in output, output[-3000:]
    assert time.monotonic() - started < 90


def test_clients_with_different_device_counts_are_an_error():
    envs = client_environments(2, 2)
    envs[1]["TFMP_NUM_LOCAL_DEVICES"] = "3"
    clients = [start_client(env, 30) for env in envs]
    outputs = [client.communicate(timeout=120)[0] for client in clients]
    assert all(client.returncode != 0 for client in clients)
    assert any("different numbers of CPU devices: {0: 2, 1: 3}" in o for o in outputs), outputs[0][-2000:]


def test_bad_settings_are_errors_before_anything_starts(monkeypatch):
    with pytest.raises(ValueError, match=r"client_id=2 \(from the arguments\) is out of range for 2 clients"):
        tfmp.initialize(jobs=["127.0.0.1:2222", "127.0.0.1:2223"], client_id=2)
    with pytest.raises(ValueError, match="repeat an address"):
        tfmp.initialize(jobs=["127.0.0.1:2222", "127.0.0.1:2222"], client_id=0)
    with pytest.raises(ValueError, match="'localhost' .* is not host:port"):
        tfmp.initialize(jobs=["localhost", "127.0.0.1:2223"], client_id=0)
    monkeypatch.setenv("DTENSOR_JOBS", "127.0.0.1:2222,127.0.0.1:2223")
    monkeypatch.setenv("DTENSOR_CLIENT_ID", "-1")
    with pytest.raises(ValueError, match=r"client_id=-1 \(from DTENSOR_JOBS / DTENSOR_CLIENT_ID\)"):
        tfmp.initialize()
    monkeypatch.delenv("DTENSOR_JOBS")
    monkeypatch.delenv("DTENSOR_CLIENT_ID")  # a leftover one would contradict TF_CONFIG (tests/test_clusters.py)
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief"}}')
    with pytest.raises(ValueError, match="TF_CONFIG=.* is not a cluster"):
        tfmp.initialize()
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 5}}')
    with pytest.raises(ValueError, match=r"client_id=5 \(from TF_CONFIG\)"):
        tfmp.initialize()


def test_launch_stops_every_client_when_one_fails(tmp_path):
    program = tmp_path / "fail_one.py"
    program.write_text(
        "import os, sys, time\n"
        "if os.environ['DTENSOR_CLIENT_ID'] == '1':\n"
        "    print('checkpoint directory is read-only', flush=True)\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    started = time.monotonic()
    finished = run_tfmp("launch", "--num-processes", "2", "--devices-per-process", "1", "--", sys.executable, str(program))
    assert finished.returncode == 3
    # The failed client's last lines come again after the others' output.
    assert finished.stdout.endswith(
        "client 1 exited with status 3; stopped the others. Its last lines:\n"
        "[tfmp launch]   checkpoint directory is read-only\n"
    ), finished.stdout[-1000:]
    assert time.monotonic() - started < 60


def run_resume(work, shape):
    return subprocess.Popen(
        [sys.executable, os.path.join(PROGRAMS, "resume.py"), str(work), shape, "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def kill_in_the_middle_of_epoch(work, epoch):
    """SIGKILLs a resume.py run once it is inside `epoch`, past its first batch."""
    process = run_resume(work, "2x4")
    progress = work / "progress"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if progress.exists() and progress.read_text().split() == [str(epoch), "1"]:
            process.kill()
            break
        time.sleep(0.02)
    process.wait()
    assert process.returncode == -9, process.stdout.read()[-2000:]


def arrays(path):
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


@pytest.mark.parametrize("resume_on", ["2x4", "4x2"])
def test_training_killed_mid_epoch_resumes_from_the_last_backup(tmp_path, resume_on):
    uninterrupted = tmp_path / "uninterrupted"
    killed = tmp_path / "killed"
    uninterrupted.mkdir()
    killed.mkdir()
    first = run_resume(uninterrupted, "2x4")
    kill_in_the_middle_of_epoch(killed, epoch=2)
    assert first.wait(timeout=240) == 0, first.stdout.read()[-2000:]
    resumed = run_resume(killed, resume_on)
    assert resumed.wait(timeout=240) == 0, resumed.stdout.read()[-2000:]
    # Restored: the weights and optimizer state of the end of epoch 1 (0-based),
    # the last backup before the kill.
    for want, got in zip(arrays(killed / "epoch_1.npz"), arrays(killed / "start.npz")):
        np.testing.assert_array_equal(got, want)
    for want, got in zip(arrays(uninterrupted / "final.npz"), arrays(killed / "final.npz")):
        if resume_on == "2x4":
            np.testing.assert_array_equal(got, want)  # deterministic data: bit-exact
        else:  # another mesh sums its shards in another order
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_input_function_in_one_process_reads_whole_batches():
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    x, y = mlp_data(64)
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

    from helpers import BatchLosses

    model = build_on(strategy, "mlp", initial_weights(build_mlp))
    recorder = BatchLosses()
    model.fit(strategy.distribute_datasets_from_function(dataset_fn), verbose=0, callbacks=[recorder])
    assert (contexts[0].num_input_pipelines, contexts[0].input_pipeline_id) == (1, 0)
    reference = build_on(strategy, "mlp", initial_weights(build_mlp))
    losses, _ = train(reference, x, y)
    np.testing.assert_allclose(recorder.losses, losses, rtol=1e-6)


def test_input_pipelines_follow_the_clients_positions_along_the_batch_axis():
    from tfmp.strategy.placement import input_pipelines

    def positions(devices, shape):
        return tfmp.DeviceMesh(shape, ("batch", "model"), devices).client_positions("batch")

    def task(client, index):
        return f"/job:worker/replica:0/task:{client}/device:CPU:{index}"

    by_rows = [task(c, i) for c in (0, 1) for i in range(4)]
    assert positions(by_rows, (2, 4)) == {0: (0,), 1: (1,)}
    interleaved = [task(c, 2 * half + i) for half in (0, 1) for c in (0, 1) for i in range(2)]
    assert positions(interleaved, (4, 2)) == {0: (0, 2), 1: (1, 3)}
    assert [input_pipelines({0: (0, 2), 1: (1, 3)}, c, "batch") for c in (0, 1)] == [(2, 0), (2, 1)]
    # Clients split along "model" hold the same batch positions: they read the same rows.
    assert input_pipelines({0: (0, 1), 1: (0, 1)}, 1, "batch") == (1, 0)
    with pytest.raises(ValueError, match=r"positions \[0, 1\] and another's \[1, 2\]"):
        input_pipelines({0: (0, 1), 1: (1, 2)}, 0, "batch")


def test_two_clients_run_a_model_garden_experiment_and_resume_it(tmp_path):
    """Orbit's loops and checkpoints on two clients: the second run trains only
    steps 9-12, so it restored the checkpoint both clients wrote."""
    finished = run_tfmp(
        "launch", "--num-processes", "2", "--devices-per-process", "4", "--timeout", "400",
        "--", sys.executable, os.path.join(PROGRAMS, "garden.py"), str(tmp_path),
        timeout=420,
    )
    assert finished.returncode == 0, finished.stdout[-3000:]
    import tensorflow as tf
    from garden_helpers import initial_weights as garden_weights
    from garden_helpers import run_experiment

    steps, evaluation, weights = run_experiment(
        tf.distribute.get_strategy(), garden_weights(), tmp_path / "single", 12
    )
    with open(tmp_path / "result.json") as result:
        got = json.load(result)
    for key, values in steps.items():
        assert len(got["first"][key]) == 8 and len(got["resumed"][key]) == 4
        np.testing.assert_allclose(got["first"][key] + got["resumed"][key], values, rtol=1e-5)
    for key, value in evaluation.items():
        np.testing.assert_allclose(got["evaluation"][key], value, rtol=1e-5)
    saved = np.load(tmp_path / "weights.npz")
    assert len(saved.files) == len(weights) == 41
    for i, weight in enumerate(weights):
        np.testing.assert_allclose(saved[f"arr_{i}"], weight, rtol=1e-5, atol=1e-5)
