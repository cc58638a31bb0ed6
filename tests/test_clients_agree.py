"""Clients of one run that disagree are refused on every client, by name.

One `tfmp launch` of two clients on loopback runs every case in turn
(tests/programs/disagree.py): each case prints `CASE name: ...` on both
clients, and the errors of all but the last are caught so that the run goes
on to the next.
"""

import os
import re
import subprocess
import sys
import time

import pytest

import tfmp
from helpers import build_mlp, build_on, initial_weights, mlp_data
from tfmp.strategy.agreement import shard_conflict

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "disagree.py")
BOUND_S = 200


@pytest.fixture(scope="module")
def run():
    started = time.monotonic()
    finished = subprocess.run(
        [sys.executable, "-m", "tfmp", "launch", "--num-processes", "2", "--devices-per-process", "4",
         "--timeout", str(BOUND_S), "--", sys.executable, PROGRAM],
        capture_output=True, text=True, timeout=BOUND_S + 30,
    )
    return finished, time.monotonic() - started


def outcome(run, client, name):
    """What `name` printed on `client`."""
    finished, _ = run
    found = re.findall(rf"^\[client {client}\] CASE {name}: (.*)$", finished.stdout, re.M)
    assert found, finished.stdout[-4000:]
    return found[-1]


@pytest.mark.parametrize("client", [0, 1])
def test_the_same_program_passes_every_check(run, client):
    # GradientSyncMonitor reads this client's own step graph (client 1 too)
    # and compares copies across clients; InputOrderCheck finds the same batches.
    printed = outcome(run, client, "same program")
    assert printed.startswith("mismatched [0.0] gradient_bytes ["), printed
    assert printed == outcome(run, 0, "same program")  # the same losses and traffic
    assert float(re.search(r"gradient_bytes \[([\d.]+)\]", printed).group(1)) > 0


@pytest.mark.parametrize("client", [0, 1])
def test_a_copy_that_differs_on_another_client_is_named(run, client):
    printed = outcome(run, client, "one copy changed")
    assert "('mlp/down/bias', nan)" in printed, printed
    assert "'mlp/down/bias' differ across clients (their fingerprints differ)" in printed


@pytest.mark.parametrize("client", [0, 1])
def test_other_layout_rules_are_refused_before_the_first_step(run, client):
    printed = outcome(run, client, "other rules")
    assert printed.startswith(
        "ClientsDisagreeError: tfmp: the clients of this run do not hold the same model: "
        "client 1 differs from client 0 in its layout rules: client 0 has {'up/kernel': (None, 'model'),"
    ), printed
    assert "'up/kernel': ('model', None)}" in printed and "the same LayoutMap rules" in printed


@pytest.mark.parametrize("client", [0, 1])
def test_another_batch_order_is_refused_with_the_epoch_and_batch(run, client):
    printed = outcome(run, client, "other order")
    assert printed.startswith(
        "ClientsDisagreeError: tfmp: client 1 and client 0 of this run train on different "
        "data: in epoch index 0 (both counted from 0) client 1 read another batch at batch index 2"
    ), printed
    assert "shuffle(..., seed=S)" in printed


@pytest.mark.parametrize("client", [0, 1])
def test_a_custom_loop_is_checked_at_its_first_step(run, client):
    printed = outcome(run, client, "custom loop")
    assert printed.startswith(
        "ClientsDisagreeError: tfmp: the clients of this run do not hold the same model: "
        "client 1 differs from client 0 in the values of 'mlp/up/kernel'"
    ), printed


@pytest.mark.parametrize("client", [0, 1])
def test_a_tf_keras_model_is_checked_as_its_fit_starts(run, client):
    printed = outcome(run, client, "tf_keras")
    assert printed.startswith(
        "ClientsDisagreeError: tfmp: the clients of this run do not hold the same model: "
        "client 1 differs from client 0 in the values of 'head/kernel'"
    ), printed


def test_another_seed_stops_the_run_on_every_client(run):
    finished, seconds = run
    assert finished.returncode not in (0, 124), finished.stdout[-3000:]
    assert seconds < BOUND_S
    for client in (0, 1):
        assert outcome(run, client, "other seed") == "fitting"
        assert re.search(
            rf"^\[client {client}\] tfmp\.strategy\.agreement\.ClientsDisagreeError: tfmp: the clients "
            r"of this run do not hold the same model: client 1 differs from client 0 in the values "
            r"of 'mlp/up/kernel' .* keras\.utils\.set_random_seed\(seed\)",
            finished.stdout, re.M,
        ), finished.stdout[-3000:]
    assert "CASE other seed: trained" not in finished.stdout


def test_a_shard_is_compared_among_the_clients_that_hold_it():
    # Client 0 holds shard "0", clients 1 and 2 shard "1": those two must agree.
    assert shard_conflict([{"0": 5}, {"1": 7}, {"1": 7}]) is None
    assert shard_conflict([{"0": 5}, {"1": 7}, {"1": 8}]) == ("1", 1, 2)
    assert shard_conflict([{"": 5}, {"": 6}]) == ("", 0, 1)


def test_input_order_check_needs_a_model_on_a_tfmp_strategy():
    model = build_on(None, "mlp", initial_weights(build_mlp))
    x, y = mlp_data(16)
    with pytest.raises(ValueError, match="InputOrderCheck checks the batches of a model on a tfmp.ModelParallelStrategy"):
        model.fit(x, y, callbacks=[tfmp.callbacks.InputOrderCheck()], verbose=0)
