"""`tfmp launch`: several clients of one run as processes on this machine.

For tests, and to try a multi-host program on one machine: each process gets
a free loopback port, its client id and its number of logical devices
through the environment that `tfmp.initialize()` reads, so the program
itself needs no arguments for it.

With `max_restarts`, a failed run is started again, every client, as
torchrun's elastic agent does; a program with `BackupAndRestore` resumes
from its newest backup. A SIGTERM to `launch` (the job is preempted) is
passed to every client, which saves a backup and exits with
`PREEMPTED_EXIT_CODE` (`tfmp.strategy.preemption`, `tfmp._env`); `launch` then exits
with it too, without restarting.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Iterator, Sequence

from tfmp._env import PREEMPTED_EXIT_CODE

_POLL_S = 0.1
_GRACE_S = 5.0
# How long preempted clients get to finish their batch and save a backup.
_PREEMPTION_GRACE_S = 60.0
# A usage error (argparse's status) does not go away by restarting.
_USAGE_ERROR = 2
# A failed client's last lines are printed again after the others stop, since
# their output buries them.
_LAST_LINES = 20


def free_ports(count: int) -> list[int]:
    """Ports on 127.0.0.1 that are free now (held open together while chosen,
    so that no two are the same)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def client_environments(num_processes: int, devices_per_process: int, device_type: str = "CPU") -> list[dict[str, str]]:
    """The environment of each client: `tfmp.initialize()` reads it. One
    client gets no `DTENSOR_*` variables: DTensor would name its devices
    after a job that no server runs."""
    if num_processes == 1:
        return [{"TFMP_NUM_LOCAL_DEVICES": str(devices_per_process), "TFMP_DEVICE_TYPE": device_type}]
    jobs = ",".join(f"127.0.0.1:{port}" for port in free_ports(num_processes))
    return [
        {
            "DTENSOR_JOBS": jobs,
            "DTENSOR_CLIENT_ID": str(client),
            "DTENSOR_JOB_NAME": "worker",
            "TFMP_NUM_LOCAL_DEVICES": str(devices_per_process),
            "TFMP_DEVICE_TYPE": device_type,
        }
        for client in range(num_processes)
    ]


def launch(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int,
    timeout_s: float | None = None,
    out: IO[str] = sys.stdout,
    max_restarts: int = 0,
    restart_processes: int | None = None,
    restart_devices_per_process: int | None = None,
) -> int:
    """Runs `command` as `num_processes` clients; returns the exit status.

    Each output line is prefixed with `[client i]`. If one client fails, the
    others are stopped at once and its status is returned (a hung peer
    would otherwise wait for it until its own timeout); a preempted client
    (status `PREEMPTED_EXIT_CODE`) is the sign that all are saving a backup,
    and the others get time to finish it. With `timeout_s`, all are stopped
    after that long in all and 124 is returned.

    A failed run (any status but 0, 124 and 2, a usage error) is started
    again, every client, up to `max_restarts` times, each restart reported
    with its reason; each client's `TFMP_RESTART_COUNT` says how many came
    before. Restarts may use fewer clients or devices
    (`restart_processes`, `restart_devices_per_process`): a program that
    builds its mesh from `tfmp.list_devices()` resumes its backup on them.
    A SIGTERM to `launch` goes to every client and ends the run with
    `PREEMPTED_EXIT_CODE`, with no restart.

    Args:
        command: The program and its arguments, e.g. `["python", "train.py"]`.
        num_processes: How many clients.
        devices_per_process: Logical devices of each client.
        timeout_s: Longest the run may take, restarts included, or None.
        out: Where the prefixed output goes.
        max_restarts: How many times a failed run is started again.
        restart_processes: Clients of a restarted run (None: as many).
        restart_devices_per_process: Devices of each client of a restarted
            run (None: as many).

    Example:

    >>> from tfmp.launch import launch
    >>> # Skipped when run: it starts two TensorFlow processes running a train.py.
    >>> launch(["python", "train.py"], num_processes=2, devices_per_process=4, max_restarts=3)  # doctest: +SKIP
    0
    """
    restart_processes = num_processes if restart_processes is None else restart_processes
    restart_devices_per_process = devices_per_process if restart_devices_per_process is None else restart_devices_per_process
    if min(num_processes, devices_per_process, restart_processes, restart_devices_per_process) < 1:
        raise ValueError(
            f"--num-processes {num_processes} --devices-per-process {devices_per_process} "
            f"--restart-num-processes {restart_processes} --restart-devices-per-process "
            f"{restart_devices_per_process}: each must be at least 1."
        )
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"--max-restarts {max_restarts!r}: use 0 (no restarts) or more.")
    if not command:
        raise ValueError("Give the program to run after --, e.g. tfmp launch ... -- python train.py")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    lock = threading.Lock()
    with _sigterm_noted() as preempted:
        status = _run(command, num_processes, devices_per_process, deadline, timeout_s, out, lock, 0, preempted)
        for restart in range(1, max_restarts + 1):
            if not _restartable(status, preempted):
                break
            with lock:
                out.write(
                    f"[tfmp launch] restart {restart} of {max_restarts}: the run failed with "
                    f"{_status_text(status)}; starting {restart_processes} "
                    f"client{'s' if restart_processes > 1 else ''} of {restart_devices_per_process} devices again (a program with "
                    "BackupAndRestore resumes from its newest backup).\n"
                )
                out.flush()
            status = _run(
                command, restart_processes, restart_devices_per_process, deadline, timeout_s, out, lock, restart, preempted
            )
    return status


def _run(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int,
    deadline: float | None,
    timeout_s: float | None,
    out: IO[str],
    lock: threading.Lock,
    restart: int,
    preempted: threading.Event,
) -> int:
    """One run of every client; its status."""
    processes = []
    pumps = []
    last_lines = []
    for client, extra in enumerate(client_environments(num_processes, devices_per_process)):
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **extra, "TFMP_RESTART_COUNT": str(restart)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # so that stopping it stops its children too
        )
        processes.append(process)
        last_lines.append(collections.deque(maxlen=_LAST_LINES))
        pump = threading.Thread(
            target=_prefix_lines, args=(process.stdout, f"[client {client}] ", out, lock, last_lines[-1])
        )
        pump.start()
        pumps.append(pump)
    status, failed_client = _wait(processes, deadline, timeout_s, out, lock, preempted)
    for pump in pumps:
        pump.join()
    if failed_client is not None:
        ending = "".join(f"[tfmp launch]   {line}" for line in last_lines[failed_client])
        out.write(
            f"[tfmp launch] client {failed_client} exited with {_status_text(status)}; stopped the others. "
            f"Its last lines:\n{ending}"
        )
        out.flush()
    return status


@contextlib.contextmanager
def _sigterm_noted() -> Iterator[threading.Event]:
    """Sets the event on SIGTERM, while the block runs (in the main thread)."""
    preempted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield preempted
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: preempted.set())
    try:
        yield preempted
    finally:
        signal.signal(signal.SIGTERM, previous)


def _restartable(status: int, preempted: threading.Event) -> bool:
    """Whether a run that ended with `status` is started again: a failure,
    or a client preempted alone (its host going away); not a success, the
    timeout, a usage error, or the whole job preempted (`launch` itself got
    SIGTERM)."""
    return not preempted.is_set() and status not in (0, 124, _USAGE_ERROR)


def _status_text(status: int) -> str:
    if status < 0:
        return f"status {status} (killed by {signal.Signals(-status).name})"
    if status == PREEMPTED_EXIT_CODE:
        return f"status {status} (a client was preempted and saved a backup)"
    return f"status {status}"


def _prefix_lines(
    stream: IO[str], prefix: str, out: IO[str], lock: threading.Lock, last_lines: collections.deque
) -> None:
    for line in stream:
        last_lines.append(line)
        with lock:
            out.write(prefix + line)
            out.flush()


def _wait(
    processes: list[subprocess.Popen],
    deadline: float | None,
    timeout_s: float | None,
    out: IO[str],
    lock: threading.Lock,
    preempted: threading.Event,
) -> tuple[int, int | None]:
    """The run's status, and the client that failed first (None if none did)."""
    while True:
        if preempted.is_set():
            _stop(processes, _PREEMPTION_GRACE_S)
            with lock:
                out.write(
                    "[tfmp launch] SIGTERM: passed it to every client (each saves a backup and "
                    f"stops); exit statuses {[p.returncode for p in processes]}.\n"
                )
            return PREEMPTED_EXIT_CODE, None
        statuses = [p.poll() for p in processes]
        failed = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0)]
        if failed:
            client, status = failed[0]
            # The others are saving the same backup: let them finish it.
            _stop(processes, _PREEMPTION_GRACE_S if status == PREEMPTED_EXIT_CODE else _GRACE_S)
            return status, client
        if all(s == 0 for s in statuses):
            return 0, None
        if deadline is not None and time.monotonic() > deadline:
            _stop(processes)
            with lock:
                out.write(f"[tfmp launch] still running after {timeout_s:g} s; stopped every client.\n")
            return 124, None
        time.sleep(_POLL_S)


def _stop(processes: list[subprocess.Popen], grace_s: float = _GRACE_S) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
