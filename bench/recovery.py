"""Recovery time: a client killed -> training again, under `tfmp launch --max-restarts`.

Runs a program that trains the test MLP on a 2x4 mesh spanning 2 clients of
`tfmp launch --max-restarts 1`, with `BackupAndRestore(save_freq=1)`; after
`--after` batches it SIGKILLs client 1 and times, from the kill:

- launch: until `tfmp launch` reports the restart (it notices the dead
  client, stops the other, which waits in a collective, and starts all again);
- initialized: until both new clients have joined (`tfmp.initialize()`:
  Python, TensorFlow, the coordination service);
- restored: until `fit` has restored the backup (model built and compiled,
  backup read);
- training again: until the first step after the restart has finished (its
  step function traced and run): the recovery time.

Then SIGTERM to `tfmp launch` (the job preempted): the time until every
client has saved its backup (printed its message) and until every client
has exited (the grace period a scheduler must give), and the batches
trained after the backup (0: the backup is of the batch in flight). Prints
each figure, median over `--rounds`.

Usage (from the repository root):

    python bench/recovery.py              # 1 round
    python bench/recovery.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BATCHES_PER_EPOCH = 8
EPOCHS = 50


def client(work: str) -> None:
    """The training program each client runs."""
    import tfmp

    cluster = tfmp.initialize(timeout_s=60)
    restart = os.environ.get("TFMP_RESTART_COUNT", "0")
    log = open(os.path.join(work, f"log-{cluster.client_id}"), "a", buffering=1)
    log.write(f"{restart} initialized {time.time()} -1\n")
    with open(os.path.join(work, f"pid-{cluster.client_id}"), "w") as pid:
        pid.write(str(os.getpid()))

    import keras
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from helpers import build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map

    class Timestamps(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            log.write(f"{restart} restored {time.time()} -1\n")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            log.write(f"{restart} batch {time.time()} {self.epoch * BATCHES_PER_EPOCH + batch}\n")
            time.sleep(0.05)

    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    model = build_on(strategy, "mlp", initial_weights(build_mlp))
    x, y = mlp_data(16 * BATCHES_PER_EPOCH)
    backup = keras.callbacks.BackupAndRestore(os.path.join(work, "backup"), save_freq=1)
    # A batch is logged before its backup: at a preemption, the last batch logged is
    # the one the backup is of.
    model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[Timestamps(), backup])
    np.asarray(model.get_weights()[0])


def events(work: str, client_id: int) -> list[tuple[str, str, float]]:
    """(run, what, when) of every line client `client_id` logged."""
    return [(run, what, at) for run, what, at, _ in steps(work, client_id)]


def steps(work: str, client_id: int) -> list[tuple[str, str, float, int]]:
    try:
        with open(os.path.join(work, f"log-{client_id}")) as log:
            lines = [line.split() for line in log if line.endswith("\n")]
    except FileNotFoundError:
        return []
    return [(run, what, float(at), int(step)) for run, what, at, step in lines]


def wait_for(condition, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there in time")
        time.sleep(0.01)


def first(work: str, run: str, what: str) -> float:
    """When the last client of run `run` logged its first `what`."""
    return max(min(at for r, w, at in events(work, c) if (r, w) == (run, what)) for c in (0, 1))


def launch(work: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tfmp", "launch", "--num-processes", "2", "--devices-per-process", "4",
         "--max-restarts", "1", "--", sys.executable, os.path.abspath(__file__), "--client", work],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


def batches(work: str, run: str) -> int:
    return sum(1 for r, w, _ in events(work, 0) if (r, w) == (run, "batch"))


def one_round(after: int) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix="tfmp-recovery-")
    process = launch(work)
    restart_reported: list[float] = []
    saved_reported: list[float] = []

    def read_output() -> None:
        for line in process.stdout:
            if line.startswith("[tfmp launch] restart"):
                restart_reported.append(time.time())
            if "tfmp: preempted: saved a backup" in line:
                saved_reported.append(time.time())

    import threading

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    wait_for(lambda: batches(work, "0") >= after)
    with open(os.path.join(work, "pid-1")) as pid:
        killed_pid = int(pid.read())
    killed = time.time()
    os.kill(killed_pid, signal.SIGKILL)
    wait_for(lambda: any(r == "1" and w == "batch" for r, w, _ in events(work, 0)) and
             any(r == "1" and w == "batch" for r, w, _ in events(work, 1)))
    figures = {
        "kill -> launch restarts": restart_reported[0] - killed,
        "kill -> clients initialized": first(work, "1", "initialized") - killed,
        "kill -> backup restored": first(work, "1", "restored") - killed,
        "kill -> training again (first step done)": first(work, "1", "batch") - killed,
    }
    wait_for(lambda: batches(work, "1") >= 5)
    notified = time.time()
    process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=120)
    figures["SIGTERM -> every client exited"] = time.time() - notified
    assert status == 143, status
    reader.join(timeout=10)
    figures["SIGTERM -> every client saved its backup"] = max(saved_reported) - notified
    last_step = max(step for _, what, _, step in steps(work, 0) if what == "batch")
    metadata = newest_metadata(os.path.join(work, "backup"))
    backed_up = metadata["epoch"] * BATCHES_PER_EPOCH + metadata["tfmp"]["batches_done"]
    figures["batches trained after the preemption backup"] = float(last_step + 1 - backed_up)
    return figures


def newest_metadata(backup_dir: str) -> dict:
    import json

    newest = max(os.listdir(backup_dir), key=lambda name: int(name.split("-")[1]))
    with open(os.path.join(backup_dir, newest, "training_metadata.json")) as file:
        return json.load(file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--after", type=int, default=10, help="batches before the kill")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(args.client)
        return
    rounds = [one_round(args.after) for _ in range(args.rounds)]
    print(f"Recovery of a 2-client tfmp launch (2x4 mesh, MLP), median of {args.rounds} round(s):")
    for name in rounds[0]:
        values = [r[name] for r in rounds]
        unit = "" if name.startswith("batches") else " s"
        print(f"  {name:45s} {statistics.median(values):7.2f}{unit}")


if __name__ == "__main__":
    main()
