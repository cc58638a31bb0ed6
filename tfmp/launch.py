"""`tfmp launch`: several clients of one run as processes on this machine.

For tests, and to try a multi-host program on one machine: each process gets
a free loopback port, its client id and its number of logical devices
through the environment that `tfmp.initialize()` reads, so the program
itself needs no arguments for it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

_POLL_S = 0.1
_GRACE_S = 5.0


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
    """The environment of each client: `tfmp.initialize()` reads it."""
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
) -> int:
    """Runs `command` as `num_processes` clients; returns the exit status.

    Each output line is prefixed with `[client i]`. If one client fails, the
    others are stopped at once and its status is returned (a hung peer
    would otherwise wait for it until its own timeout). With `timeout_s`, all
    are stopped after that long and 124 is returned.

    Args:
        command: The program and its arguments, e.g. `["python", "train.py"]`.
        num_processes: How many clients.
        devices_per_process: Logical devices of each client.
        timeout_s: Longest the run may take, or None.
        out: Where the prefixed output goes.

    Example:

    >>> from tfmp.launch import launch
    >>> # Skipped when run: it starts two TensorFlow processes running a train.py.
    >>> launch(["python", "train.py"], num_processes=2, devices_per_process=4)  # doctest: +SKIP
    0
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(
            f"--num-processes {num_processes} --devices-per-process {devices_per_process}: "
            "both must be at least 1."
        )
    if not command:
        raise ValueError("Give the program to run after --, e.g. tfmp launch ... -- python train.py")
    processes = []
    lock = threading.Lock()
    pumps = []
    for client, extra in enumerate(client_environments(num_processes, devices_per_process)):
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # so that stopping it stops its children too
        )
        processes.append(process)
        pump = threading.Thread(target=_prefix_lines, args=(process.stdout, f"[client {client}] ", out, lock))
        pump.start()
        pumps.append(pump)
    status = _wait(processes, timeout_s, out, lock)
    for pump in pumps:
        pump.join()
    return status


def _prefix_lines(stream: IO[str], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(prefix + line)
            out.flush()


def _wait(processes: list[subprocess.Popen], timeout_s: float | None, out: IO[str], lock: threading.Lock) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        statuses = [p.poll() for p in processes]
        failed = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0)]
        if failed:
            client, status = failed[0]
            _stop(processes)
            with lock:
                out.write(f"[tfmp launch] client {client} exited with status {status}; stopped the others.\n")
            return status
        if all(s == 0 for s in statuses):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            _stop(processes)
            with lock:
                out.write(f"[tfmp launch] still running after {timeout_s:g} s; stopped every client.\n")
            return 124
        time.sleep(_POLL_S)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    end = time.monotonic() + _GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
