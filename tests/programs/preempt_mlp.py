"""Trains the test MLP with BackupAndRestore(save_freq=2) on a 2x4 mesh of
every client's devices, slowly enough to be preempted mid-epoch: the
program the preemption and restart tests launch, stop and launch again.

Usage: preempt_mlp.py WORK_DIR [crash_once]. Each client writes its pid to
WORK_DIR/pid-<client>; client 0 appends "run epoch batch loss" to
WORK_DIR/losses after every batch (run: TFMP_RESTART_COUNT, or the number
of earlier lines' runs) and, at the end, the final weights
(WORK_DIR/final.npz) and history (WORK_DIR/history.json). With
`crash_once`, client 1 raises at batch index 3 of epoch index 1 unless
WORK_DIR/crashed exists, which it creates.
"""

import json
import os
import sys
import time

import tfmp

cluster = tfmp.initialize(timeout_s=60)

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map  # noqa: E402

work = sys.argv[1]
crash_once = sys.argv[2:] == ["crash_once"]
with open(os.path.join(work, f"pid-{cluster.client_id}"), "w") as pid:
    pid.write(str(os.getpid()))


class Progress(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if crash_once and cluster.client_id == 1 and (self.epoch, batch) == (1, 3):
            if not os.path.exists(os.path.join(work, "crashed")):
                open(os.path.join(work, "crashed"), "w").close()
                raise RuntimeError("client 1 crashed once")
        if cluster.is_chief:
            with open(os.path.join(work, "losses"), "a") as losses:
                losses.write(f"{os.environ.get('TFMP_RESTART_COUNT', '0')} {self.epoch} {batch} {logs['loss']!r}\n")
        time.sleep(0.3)  # slow enough to be preempted in the middle of an epoch


device_mesh = mesh((2, 4))
model = build_on(tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh)), "mlp", initial_weights(build_mlp))
backup = keras.callbacks.BackupAndRestore(os.path.join(work, "backup"), save_freq=2)
history = model.fit(*mlp_data(37), batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[Progress(), backup])
weights = model.get_weights()
if cluster.is_chief:
    np.savez(os.path.join(work, "final.npz"), *weights)
    with open(os.path.join(work, "history.json"), "w") as file:
        json.dump(history.history, file)
