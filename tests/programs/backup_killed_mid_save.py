"""Trains with BackupAndRestore on a 2x4 mesh and kills itself (SIGKILL)
inside the backup of epoch index 2, after its weights are written and before
its training metadata: the program of the backup-is-one-unit test.

Usage: backup_killed_mid_save.py BACKUP_DIR
"""

import os
import signal
import sys

import tfmp

tfmp.simulate_devices(8)

import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map  # noqa: E402

KILLED_EPOCH = 2


class KillInsideBackup(keras.callbacks.Callback):
    """Wraps the model's save_weights, which BackupAndRestore calls before
    it writes the epoch: SIGKILL right after the weights of KILLED_EPOCH."""

    def on_train_begin(self, logs=None):
        save_weights = self.model.save_weights

        def killing_save_weights(*args, **kwargs):
            save_weights(*args, **kwargs)
            if self.epoch == KILLED_EPOCH:
                os.kill(os.getpid(), signal.SIGKILL)

        self.model.save_weights = killing_save_weights

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


device_mesh = mesh((2, 4))
model = build_on(tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh)), "mlp", initial_weights(build_mlp))
backup = keras.callbacks.BackupAndRestore(sys.argv[1])
model.fit(*mlp_data(37), batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[KillInsideBackup(), backup])
