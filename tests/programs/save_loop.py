"""Saves a model on a 2x4 mesh over and over, alternating two sets of
weights, until it is killed: the program the kill-during-save tests kill.

Usage: save_loop.py WORK_DIR KIND, KIND one of `keras` (model.save .keras),
`h5` (model.save .h5), `weights` (save_weights), `checkpoint`
(ModelCheckpoint, .keras) and `backup` (BackupAndRestore). Save i writes the
initial weights plus i % 2 (the backup of save i records epoch i + 1).
After the first save is whole it writes WORK_DIR/ready with the seconds
that save took. It stops by itself after 120 s.
"""

import os
import sys
import time

import tfmp

tfmp.simulate_devices(8)

import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_layout_map  # noqa: E402

work, kind = sys.argv[1], sys.argv[2]
device_mesh = mesh((2, 4))
model = build_on(tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh)), "mlp", initial_weights(build_mlp))
weights = [initial_weights(build_mlp), [w + 1 for w in initial_weights(build_mlp)]]

if kind in ("checkpoint", "backup"):
    callback = (
        keras.callbacks.ModelCheckpoint(os.path.join(work, "checkpoint.keras"))
        if kind == "checkpoint"
        else keras.callbacks.BackupAndRestore(os.path.join(work, "backup"))
    )
    callback.set_model(model)

    def save(epoch):
        callback.on_epoch_end(epoch, logs={})

else:
    path = os.path.join(work, {"keras": "model.keras", "h5": "model.h5", "weights": "model.weights.h5"}[kind])
    save_method = model.save_weights if kind == "weights" else model.save

    def save(_):
        save_method(path)

deadline = time.time() + 120
i = 0
while time.time() < deadline:
    model.set_weights(weights[i % 2])
    started = time.time()
    save(i)
    if i == 0:
        with open(os.path.join(work, "ready"), "w") as ready:
            ready.write(str(time.time() - started))
    i += 1
