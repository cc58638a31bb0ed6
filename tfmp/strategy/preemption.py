"""A preemption notice (SIGTERM) during `fit`: save a backup, then exit.

Cluster schedulers announce a preemption with SIGTERM and kill the process
a grace period later (30 s on Kubernetes and GCE spot VMs by default). While
`fit` runs with `keras.callbacks.BackupAndRestore` under tfmp, SIGTERM only
raises a flag; at the end of the batch in flight the callback saves a backup
and the process exits with `PREEMPTED_EXIT_CODE`. Running the same command
again resumes from that batch (`tfmp.strategy.backups`).

In a multi-client run the clients agree at every batch end whether any of
them was notified, through a max over a one-element-per-device tensor on the
mesh (a collective, so every client gets the same answer at the same
batch). Any, not all: a scheduler preempts one host at a time, and a backup
needs every client, since its values are gathered with all of them; if
only the notified client saved, the others would wait for it forever.

Once notified, further SIGTERMs are ignored: a second one (a launcher
stopping every client) must not cut the save short; the scheduler's own
SIGKILL at the end of the grace period still bounds it.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp import distributed
from tfmp._env import PREEMPTED_EXIT_CODE
from tfmp.integrations.internals import TensorFlowTrainer


class PreemptionNotice:
    """The SIGTERM handler of a `fit` with `BackupAndRestore`; one per process.

    `arm()` installs it (from `on_train_begin`), `disarm()` puts the previous
    handler back (from `on_train_end`, or before exiting on a notice). A
    SIGTERM while no `fit` is running (one that raised never disarmed) goes
    to the previous handler, or stops the process as SIGTERM does.
    """

    def __init__(self) -> None:
        self.received = False
        self._armed = False
        self._previous: Any = None

    def arm(self) -> None:
        self.received = False
        if self._armed or threading.current_thread() is not threading.main_thread():
            # Python lets only the main thread handle signals.
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._armed = True

    def disarm(self) -> None:
        self.received = False
        if not self._armed or threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._previous)
        self._armed = False
        self._previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not _in_fit(frame):
            previous = self._previous
            self.disarm()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.received:
            return
        self.received = True
        print(
            "tfmp: SIGTERM received (preemption notice): saving a backup at the end of "
            "this batch, then exiting.",
            file=sys.stderr,
            flush=True,
        )

    def agreed(self, mesh: dtensor.Mesh | None) -> bool:
        """Whether any client was notified. Every client of a multi-client
        run must call it at the same batch: it is a collective on `mesh`."""
        cluster = distributed.cluster()
        if cluster is None or cluster.num_clients == 1 or mesh is None:
            return self.received
        return any_client_flagged(self.received, mesh)


def _in_fit(frame: Any) -> bool:
    """Whether Keras' `fit` is on the interrupted stack."""
    fit_code = inspect.unwrap(TensorFlowTrainer.fit).__code__
    while frame is not None:
        if frame.f_code is fit_code:
            return True
        frame = frame.f_back
    return False


def any_client_flagged(flag: bool, mesh: dtensor.Mesh) -> bool:
    """`flag` of any client, through a max over the whole mesh."""
    local = len(mesh.local_devices())
    layout = dtensor.Layout(list(mesh.dim_names), mesh)
    shard = tf.constant(np.full([1] * len(mesh.dim_names), float(flag), np.float32))
    flags = dtensor.pack([shard] * local, layout)
    reached = tf.reduce_max(flags)
    return bool(dtensor.unpack(reached)[0].numpy() > 0)


notice = PreemptionNotice()
