"""A client that stops taking part in a multi-client run: named, and every client stopped.

Two clients of the test MLP on loopback (tests/programs/stuck_client.py);
client 1 sleeps in a callback (it keeps heartbeating, so TensorFlow alone
waits forever) or kills itself. Also the classification of TensorFlow's
errors about other clients, in-process.
"""

import os
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import tfmp
from tfmp import distributed
from tfmp.launch import client_environments
from tfmp.strategy import keras_hooks, peer_errors
from tfmp.strategy.watchdog import _Watchdog, clients_behind, step_bound_s, stuck_verdict
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_layout_map

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "stuck_client.py")
STEP_TIMEOUT_S = 8
HEARTBEAT_TIMEOUT_S = 10

HEARTBEATS_LOST = (
    "{{function_node __inference_one_step_on_data_559}} Collective ops is aborted by: Error "
    "reported from /job:worker/task:1: The following tasks are unhealthy (stopped sending "
    "heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed. Check the task logs "
    "for an earlier error.\n\t [[{{node compile_loss/mse/Sum/DTensorAllReduceOp}}]]"
)


def test_a_client_sleeping_in_a_callback_stops_every_client_naming_it():
    started = time.monotonic()
    finished = subprocess.run(
        [sys.executable, "-m", "tfmp", "launch", "--num-processes", "2", "--devices-per-process", "4",
         "--step-timeout", str(STEP_TIMEOUT_S), "--timeout", "240", "--", sys.executable, PROGRAM, "sleep", "3"],
        capture_output=True, text=True, timeout=300,
    )
    took = time.monotonic() - started
    out = finished.stdout
    assert finished.returncode == 1, out[-4000:]
    assert "still running after" not in out
    # The first step (tracing, longer than 8 s on a loaded machine) had its own bound.
    verdict = "tfmp watchdog: client 1 has not reached fit step 4 of epoch 0, which client 0 entered"
    assert f"[client 0] {verdict}" in out and f"[client 1] {verdict}" in out, out[-4000:]
    # The stuck client shows where it is; the waiting one the op it waited in.
    assert "[client 1] Client 1 is here (its main thread's Python stack):" in out
    assert "[client 1]     time.sleep(600)" in out
    assert (
        "[client 0] client 0 fit raised DeadlineExceededError: tfmp: the run is stuck: this "
        "client's op 'compile_loss/mse/Sum/DTensorAllReduceOp' waited for the others." in out
    )
    assert "[client 0] chained: DeadlineExceededError:" in out
    # Start-up and training take up to a minute here; the sleep would take ten.
    assert took < 150


def test_a_client_stuck_between_the_steps_of_a_custom_loop_is_named():
    """No callbacks see a custom loop's steps: each call of its tf.function is one."""
    finished = subprocess.run(
        [sys.executable, "-m", "tfmp", "launch", "--num-processes", "2", "--devices-per-process", "4",
         "--step-timeout", str(STEP_TIMEOUT_S), "--timeout", "240", "--", sys.executable, PROGRAM, "loop", "3"],
        capture_output=True, text=True, timeout=300,
    )
    out = finished.stdout
    assert finished.returncode == 1, out[-4000:]
    verdict = "tfmp watchdog: client 1 has not reached the call of train_step at stuck_client.py:"
    assert f"[client 0] {verdict}" in out and f"[client 1] {verdict}" in out, out[-4000:]
    assert "[client 1]     time.sleep(600)" in out
    raised = [line for line in out.splitlines() if line.startswith("[client 0] client 0 the loop raised")]
    assert raised == [
        "[client 0] client 0 the loop raised DeadlineExceededError: tfmp: the run is stuck: this "
        "client's op 'Mean/DTensorAllReduceOp' waited for the others."
    ], out[-4000:]


def test_a_killed_peer_is_named_in_the_survivors_error():
    clients = [
        subprocess.Popen(
            [sys.executable, PROGRAM, "kill", "3"],
            env={**os.environ, **env, "JOIN_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for env in client_environments(2, 4)
    ]
    outputs = [client.communicate(timeout=240)[0] for client in clients]
    assert clients[1].returncode == -9, outputs[1][-3000:]
    assert clients[0].returncode == 1, outputs[0][-3000:]
    survivor = outputs[0]
    assert (
        "client 0 fit raised UnavailableError: tfmp: client 1 of the run stopped sending heartbeats: "
        "it crashed, was killed or cannot reach the others. This client's op "
        "'compile_loss/mse/Sum/DTensorAllReduceOp' waited for it" in survivor
    ), survivor[-3000:]
    assert "chained: UnavailableError:" in survivor
    assert "LayoutMap" not in survivor


@pytest.mark.parametrize(
    "error, client, happened",
    [
        (tf.errors.UnavailableError(None, None, HEARTBEATS_LOST), "client 1", "stopped sending heartbeats"),
        (tf.errors.UnavailableError(None, None, "Connection reset by peer from /job:worker/replica:0/task:2"),
         "client 2", "closed its connection"),
        (tf.errors.InternalError(None, None, "Socket closed"), "another client", "closed its connection"),
        (tf.errors.AbortedError(None, None, "The coordination service has stopped: /job:worker/task:1"),
         "client 1", "lost its connection to the coordination service"),
        (tf.errors.UnknownError(None, None, "failed to connect to all addresses /job:worker/replica:0/task:3"),
         "client 3", "cannot be reached"),
    ],
)
def test_errors_about_other_clients_name_the_client_not_the_layout(error, client, happened):
    assert peer_errors.is_peer_failure(error)
    told = peer_errors.explain_peer_failure(error)
    assert type(told) is type(error)  # `except tf.errors.UnavailableError` still catches it
    assert told.message.startswith(f"tfmp: {client} of the run {happened}")
    assert "Fix: look at that client's output" in told.message
    assert "LayoutMap" not in told.message


def test_layout_errors_are_not_taken_for_other_clients():
    layout = tf.errors.InvalidArgumentError(
        None, None, "error: 'tf.DTensorLayout' op requires dimension 0 to be divisible by sharding"
    )
    assert not peer_errors.is_peer_failure(layout)
    assert not peer_errors.is_peer_failure(ValueError("Connection reset"))


def test_a_watchdog_abort_keeps_the_verdict_and_names_the_op():
    aborted = tf.errors.DeadlineExceededError(
        None, None,
        "{{function_node f}} Collective ops is aborted by: tfmp watchdog: client 1 has not reached "
        "fit step 4 of epoch 0, which client 0 entered 8.1 s ago (bound 8 s): ...\nThe error could be "
        "from a previous operation. Restart your program to reset.\n\t [[{{node loss/DTensorAllReduceOp}}]]",
    )
    assert peer_errors.is_peer_failure(aborted)
    told = peer_errors.explain_peer_failure(aborted).message
    assert told.startswith("tfmp: the run is stuck: this client's op 'loss/DTensorAllReduceOp' waited")
    assert "tfmp watchdog: client 1 has not reached fit step 4 of epoch 0" in told
    assert "Restart your program" not in told and "[[" not in told


def test_fit_tells_a_lost_client_with_tensorflows_error_chained(monkeypatch):
    device_mesh = mesh((2, 4))
    model = build_on(tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh)), "mlp", initial_weights(build_mlp))
    lost = tf.errors.UnavailableError(None, None, HEARTBEATS_LOST)
    with pytest.raises(tf.errors.UnavailableError) as raised, keras_hooks.explained_errors(model):
        # As in a run of two clients: only there are such errors another client's.
        monkeypatch.setattr(distributed, "_cluster", distributed.Cluster(("a:1", "b:2"), 0, "worker", "CPU", 4))
        raise lost
    assert "client 1 of the run stopped sending heartbeats" in raised.value.message
    assert raised.value.__cause__ is lost
    monkeypatch.setattr(distributed, "_cluster", None)
    with pytest.raises(tf.errors.UnavailableError) as raised, keras_hooks.explained_errors(model):
        raise lost  # one client: TensorFlow's error as it is
    assert raised.value is lost


def test_the_verdict_names_the_clients_behind():
    def state(entered, finished, label, for_s=None):
        return {"entered": entered, "finished": finished, "label": label, "for_s": for_s}

    # Client 2 finished step 3 and never entered step 4; client 1 sleeps in step 3's callbacks.
    states = {
        0: state(5, 4, "fit step 4 of epoch 0", 9.0),
        1: state(4, 3, "fit step 3 of epoch 0", 9.5),
        2: state(4, 4, "fit step 3 of epoch 0"),
    }
    assert clients_behind(states) == [1]
    states[1] = state(4, 4, "fit step 3 of epoch 0")
    assert clients_behind(states) == [1, 2]
    told = stuck_verdict([1, 2], 8.0, states)
    assert told.startswith("tfmp watchdog: clients 1, 2 have not reached fit step 4 of epoch 0, which client 0")
    assert "  client 2: finished fit step 3 of epoch 0, outside any step since" in told
    same = {0: state(5, 4, "evaluate step 0", 901.0), 1: state(5, 4, "evaluate step 0", 901.2)}
    assert clients_behind(same) == []
    assert "every client is in evaluate step 0 and none finished it" in stuck_verdict([], 900.0, same)


def test_steps_are_bound_by_the_settings_or_the_slowest_step_seen():
    defaults = distributed.Cluster(("a:1", "b:2"), 0, "worker", "CPU", 4)
    assert step_bound_s(True, 0.0, defaults) == 900  # the first step of a call: it traces
    assert step_bound_s(False, 0.04, defaults) == 300
    assert step_bound_s(False, 30.0, defaults) == 600  # 20 times the slowest step
    chosen = distributed.Cluster(("a:1", "b:2"), 0, "worker", "CPU", 4, step_timeout_s=8.0, first_step_timeout_s=60.0)
    assert step_bound_s(False, 30.0, chosen) == 8
    assert step_bound_s(True, 30.0, chosen) == 60


def test_a_custom_loop_step_is_a_function_call_and_its_first_call_traces():
    """Outside Keras' calls each tf.function call on the main thread is a
    step, named by the program's line; a function's first call gets the
    first step's bound. (The watchdog thread waits: nothing is published.)"""
    cluster = distributed.Cluster(("a:1", "b:2"), 0, "worker", "CPU", 4, step_timeout_s=8.0, first_step_timeout_s=60.0)
    watchdog = _Watchdog(cluster)
    try:
        assert not watchdog.function_call_began(b"__inference_train_step_42")  # not watching yet
        watchdog._watches_function_calls = True  # as watch_function_calls, without waking the thread
        assert watchdog.function_call_began(b"__inference_train_step_42")
        assert watchdog.progress.label.startswith("the call of train_step at test_stuck_clients.py:")
        assert watchdog.bound_s() == 60
        watchdog.step_finished()
        assert watchdog.function_call_began(b"__inference_train_step_57")  # the same function retraced
        assert watchdog.bound_s() == 8
        watchdog.step_finished()
        assert (watchdog.progress.entered, watchdog.progress.finished) == (2, 2)
    finally:
        watchdog.stop()


def test_bad_step_timeouts_are_errors_before_anything_starts(monkeypatch):
    jobs = ["127.0.0.1:2222", "127.0.0.1:2223"]
    with pytest.raises(ValueError, match=r"first_step_timeout_s=0: use a number of seconds above 0"):
        tfmp.initialize(jobs=jobs, client_id=0, first_step_timeout_s=0)
    with pytest.raises(ValueError, match=r"step_timeout_s='8': use a number of seconds above 0"):
        tfmp.initialize(jobs=jobs, client_id=0, step_timeout_s="8")
    monkeypatch.setenv("TFMP_STEP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"TFMP_STEP_TIMEOUT='soon': use a number of seconds above 0"):
        tfmp.initialize(jobs=jobs, client_id=0)
