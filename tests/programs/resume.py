"""Trains with BackupAndRestore, slowly, recording its progress: the program
the kill-and-resume test kills and restarts.

Usage: resume.py WORK_DIR MESH (e.g. 2x4) EPOCHS. Writes WORK_DIR/progress
("epoch batch") after every batch, WORK_DIR/epoch_<e>.npz (weights and
optimizer state) after every epoch, WORK_DIR/start.npz at the start of
training (after any restore) and WORK_DIR/final.npz at the end.
"""

import os
import sys
import time

import tfmp

tfmp.simulate_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map  # noqa: E402

work, shape, epochs = sys.argv[1], tuple(int(s) for s in sys.argv[2].split("x")), int(sys.argv[3])


def state(model):
    model.optimizer.build(model.trainable_variables)
    return [np.asarray(v) for v in model.weights + model.optimizer.variables]


class Progress(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        np.savez(os.path.join(work, "start.npz"), *state(self.model))

    def on_train_batch_end(self, batch, logs=None):
        with open(os.path.join(work, "progress"), "w") as progress:
            progress.write(f"{self.epoch} {batch}")
        time.sleep(0.3)  # slow enough to be killed in the middle of an epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        np.savez(os.path.join(work, f"epoch_{epoch}.npz"), *state(self.model))


device_mesh = mesh(shape)
model = build_on(tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh)), "mlp", initial_weights(build_mlp))
backup = keras.callbacks.BackupAndRestore(os.path.join(work, "backup"), save_freq="epoch")
model.fit(*mlp_data(64), batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=[backup, Progress()])
np.savez(os.path.join(work, "final.npz"), *state(model))
