"""A tfmp program whose client 1 stops taking part: `stuck_client.py MODE STEP`.

Trains the test MLP on a 2x4 mesh spanning both clients for 3 epochs of 8
batches. At training batch STEP, client 1 sleeps in a callback (MODE
`sleep`: it keeps heartbeating, the other client waits in the step's
collectives) or kills itself (MODE `kill`). Each client prints the error
`fit` raised and its chained TensorFlow error, then exits with status 1.
"""

import os
import signal
import sys
import time

import tfmp

cluster = tfmp.initialize(timeout_s=float(os.environ.get("JOIN_TIMEOUT_S", "60")))

import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import build_mlp, compile_mlp, mesh, mlp_data, mlp_layout_map  # noqa: E402

mode, stuck_step = sys.argv[1], int(sys.argv[2])


class StopTakingPart(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if cluster.client_id == 1 and batch == stuck_step:
            print(f"client 1 stops taking part after batch {batch}", flush=True)
            if mode == "sleep":
                time.sleep(600)
            os.kill(os.getpid(), signal.SIGKILL)


device_mesh = mesh((2, 4))
keras.utils.set_random_seed(0)  # the same model on every client
with tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh)).scope():
    model = compile_mlp(build_mlp())
x, y = mlp_data(64)
try:
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[StopTakingPart()])
except Exception as error:  # noqa: BLE001 - the test reads what the user would see
    print(f"client {cluster.client_id} fit raised {type(error).__name__}: {error}", flush=True)
    print(f"chained: {type(error.__cause__).__name__}: {error.__cause__}", flush=True)
    sys.exit(1)
print(f"client {cluster.client_id} finished", flush=True)
