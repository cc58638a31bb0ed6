"""Preemption and restarts: a SIGTERM during `fit` with `BackupAndRestore`
saves a backup at the end of the batch and exits with status 143; a backup
taken mid-epoch (`save_freq=N` batches, or a SIGTERM) resumes after its
batch, so the resumed run's per-batch losses, metrics and final weights are
an uninterrupted run's; `tfmp launch --max-restarts` relaunches every
client after a failure and the program resumes from its newest backup.

The reference is one device, plain Keras, 37 rows at batch 8 (a last batch
of 5, which the 2x4 mesh's batch axis does not divide), 3 epochs.
"""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

from tfmp import launch as tfmp_launch
from helpers import BatchLosses, build_mlp, build_on, initial_weights, mlp_data, strategy_on
from tfmp.strategy.preemption import PREEMPTED_EXIT_CODE

WEIGHTS = initial_weights(build_mlp)
EPOCHS = 3
BATCH = 8
ROWS = 37  # 5 batches an epoch


def fit(model, callbacks, **kwargs):
    losses = BatchLosses()
    history = model.fit(*mlp_data(ROWS), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[losses, *callbacks], **kwargs)
    return losses.losses, history


@pytest.fixture(scope="module")
def uninterrupted():
    """Per-batch losses, epoch history and final weights of one device."""
    model = build_on(None, "mlp", WEIGHTS)
    losses, history = fit(model, [])
    return losses, history.history, model.get_weights()


def assert_resumed_exactly(uninterrupted, losses, history, weights, resumed_at):
    """The resumed run logged the uninterrupted run's losses from batch
    `resumed_at` (counted over the whole run) on, and ends with its weights."""
    want_losses, want_history, want_weights = uninterrupted
    np.testing.assert_allclose(losses, want_losses[resumed_at:], rtol=1e-5, atol=1e-6)
    epochs_run = len(history["loss"])
    for key, values in history.items():
        np.testing.assert_allclose(values, want_history[key][-epochs_run:], rtol=1e-5, atol=1e-6)
    for want, got in zip(want_weights, weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class SigtermAt(keras.callbacks.Callback):
    """Sends this process SIGTERM at the end of batch `batch` of epoch `epoch`."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_at_the_batch_and_save_freq_resumes_mid_epoch_exactly(tmp_path, uninterrupted, capfd):
    backup = str(tmp_path / "backup")
    # Preempted after batch index 2 of epoch index 1 (global batch 8), on 2x4.
    first = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    with pytest.raises(SystemExit) as exited:
        fit(first, [SigtermAt(1, 2), keras.callbacks.BackupAndRestore(backup, save_freq=2)])
    assert exited.value.code == PREEMPTED_EXIT_CODE
    assert "preempted: saved a backup in" in capfd.readouterr().err
    # Skipping the batches done needs the same batches.
    with pytest.raises(ValueError, match="epoch of 5 batches, but this fit's epochs have 10"):
        build_on(None, "mlp", WEIGHTS).fit(*mlp_data(ROWS), batch_size=4, epochs=EPOCHS, verbose=0,
                                           callbacks=[keras.callbacks.BackupAndRestore(backup)])
    # Resumed on 4x2 (after batch index 2 of epoch index 1) with backups
    # every 2 batches from there: after batches 4 (epoch 1), 1, 3 (epoch 2);
    # crashed at batch index 3 of epoch index 2, before its backup.
    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (2, 3):
                raise RuntimeError("crashed")

    second = build_on(strategy_on((4, 2)), "mlp", WEIGHTS)
    with pytest.raises(RuntimeError, match="crashed"):
        fit(second, [Crash(), keras.callbacks.BackupAndRestore(backup, save_freq=2)])
    third = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    losses, history = fit(third, [keras.callbacks.BackupAndRestore(backup, save_freq=2)])
    # The last backup covers batches 0 and 1 of epoch index 2: resumed at
    # batch 5 * 2 + 2 of the run.
    assert_resumed_exactly(uninterrupted, losses, history.history, third.get_weights(), resumed_at=12)
    assert not os.path.exists(backup)


PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "preempt_mlp.py")


def launch(work, *options):
    return subprocess.Popen(
        [sys.executable, "-m", "tfmp", "launch", "--num-processes", "2", "--devices-per-process", "4",
         "--timeout", "240", *options, "--", sys.executable, PROGRAM, str(work), *(["crash_once"] if options else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def batches_logged(work):
    try:
        with open(work / "losses") as losses:
            return len(losses.read().splitlines())
    except FileNotFoundError:
        return 0


def sigterm_after(process, work, batches, pid_of):
    """SIGTERM to `pid_of()` once client 0 has logged `batches` batches in all."""
    deadline = time.monotonic() + 200
    while batches_logged(work) < batches and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pid_of(), signal.SIGTERM)
    output, _ = process.communicate(timeout=200)
    return process.returncode, output


def test_sigterm_to_one_client_then_a_crash_restarted_onto_one_client(tmp_path, uninterrupted):
    """On two clients of `tfmp launch`: SIGTERM to client 1 alone in epoch
    index 0 makes both clients save the same batch and exit 143. Relaunched
    with --max-restarts 1, client 1 crashes once in epoch index 1; the
    restart runs as one client of 8 devices. Every batch's loss (the last
    run's where batches ran twice), the last run's history and the final
    weights are an uninterrupted run's."""
    client_1 = lambda: int((tmp_path / "pid-1").read_text())  # noqa: E731
    status, output = sigterm_after(launch(tmp_path), tmp_path, 2, client_1)
    assert status == PREEMPTED_EXIT_CODE, output[-3000:]
    for client in (0, 1):
        assert f"[client {client}] tfmp: preempted: saved a backup in" in output, output[-3000:]
    assert "[client 1] tfmp: SIGTERM received" in output and "[client 0] tfmp: SIGTERM received" not in output
    stopped_after = batches_logged(tmp_path)
    assert 2 <= stopped_after < 5  # inside epoch index 0
    finished = launch(tmp_path, "--max-restarts", "1", "--restart-num-processes", "1", "--restart-devices-per-process", "8")
    output, _ = finished.communicate(timeout=280)
    assert finished.returncode == 0, output[-3000:]
    assert "[tfmp launch] restart 1 of 1: the run failed with status 1" in output, output[-3000:]
    assert "client 1 crashed once" in output
    rows = [line.split() for line in (tmp_path / "losses").read_text().splitlines()]
    # The relaunch resumed after the preempted batch, not at the epoch's
    # start; the restart resumed from a backup of epoch index 1, not at the start.
    assert rows[stopped_after][1:3] == ["0", str(stopped_after)], rows
    assert [run for run, *_ in rows].count("1") < 2 * 5, rows
    latest = {(int(epoch), int(batch)): float(loss) for _, epoch, batch, loss in rows}
    assert sorted(latest) == [(epoch, batch) for epoch in range(EPOCHS) for batch in range(5)]
    with open(tmp_path / "history.json") as file:
        history = json.load(file)
    final = np.load(tmp_path / "final.npz")
    assert_resumed_exactly(uninterrupted, [latest[key] for key in sorted(latest)], history,
                           [final[f"arr_{i}"] for i in range(len(final.files))], resumed_at=0)


def probe(work, mode, **options):
    """`launch` of `restart_probe.py` (no TensorFlow: quick) on 2 clients of 4 devices; status and output."""
    out = io.StringIO()
    command = [sys.executable, os.path.join(os.path.dirname(PROGRAM), "restart_probe.py"), str(work), mode]
    status = tfmp_launch.launch(command, 2, 4, timeout_s=60, out=out, **options)
    return status, out.getvalue()


def test_launch_restarts_failures_only_and_passes_sigterm_to_every_client(tmp_path):
    status, output = probe(tmp_path, "crash_once", max_restarts=2, restart_processes=1, restart_devices_per_process=8)
    assert status == 0, output
    assert "[tfmp launch] restart 1 of 2: the run failed with status 3; starting 1 client of 8 devices" in output
    assert "[client 0] restart 1: 1 clients of 8 devices" in output and "restart 2" not in output
    with pytest.raises(ValueError, match="--max-restarts -1: use 0"):
        probe(tmp_path, "usage", max_restarts=-1)
    with pytest.raises(ValueError, match="--restart-devices-per-process 0: each must be at least 1"):
        probe(tmp_path, "usage", restart_devices_per_process=0)
    status, output = probe(tmp_path, "usage", max_restarts=2)
    assert status == 2 and "restart 1" not in output, output
    # The job preempted: SIGTERM to launch reaches every client, none restarts.
    started = [tmp_path / f"started-{client}" for client in (0, 1)]

    def preempt_when_started():
        while not all(path.exists() for path in started):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt_when_started, daemon=True).start()
    status, output = probe(tmp_path, "preemptible", max_restarts=2)
    assert status == PREEMPTED_EXIT_CODE, output
    assert "SIGTERM: passed it to every client (each saves a backup and stops); exit statuses [143, 143]" in output
    assert "restart 1" not in output
