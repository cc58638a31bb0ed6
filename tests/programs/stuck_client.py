"""A tfmp program whose client 1 stops taking part: `stuck_client.py MODE STEP`.

Trains the test MLP on a 2x4 mesh spanning both clients for 3 epochs of 8
batches. At training batch STEP, client 1 sleeps in a callback (MODE
`sleep`: it keeps heartbeating, the other client waits in the step's
collectives) or kills itself (MODE `kill`). Each client prints the error
`fit` raised and its chained TensorFlow error, then exits with status 1.
MODE `loop` trains in a custom loop as TensorFlow's tutorial writes it
(`strategy.run` in a `tf.function` over a distributed dataset); client 1
sleeps before step STEP.
"""

import os
import signal
import sys
import time

import tfmp

cluster = tfmp.initialize(timeout_s=float(os.environ.get("JOIN_TIMEOUT_S", "60")))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

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


def custom_loop(strategy, model, x, y):
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))

    @tf.function
    def train_step(batch):
        def step(features, targets):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(features, training=True) - targets))
            gradients = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        return strategy.run(step, args=batch)

    for epoch in range(3):
        for step_number, batch in enumerate(dataset):
            if cluster.client_id == 1 and epoch == 0 and step_number == stuck_step:
                print(f"client 1 stops taking part before step {step_number}", flush=True)
                time.sleep(600)
            train_step(batch)


device_mesh = mesh((2, 4))
keras.utils.set_random_seed(0)  # the same model on every client
strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
with strategy.scope():
    model = compile_mlp(build_mlp())
x, y = mlp_data(64)
if mode == "loop":
    try:
        custom_loop(strategy, model, x, y)
    except Exception as error:  # noqa: BLE001
        print(f"client {cluster.client_id} the loop raised {type(error).__name__}: {error}", flush=True)
        sys.exit(1)
    print(f"client {cluster.client_id} finished", flush=True)
    sys.exit(0)
try:
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[StopTakingPart()])
except Exception as error:  # noqa: BLE001 - the test reads what the user would see
    print(f"client {cluster.client_id} fit raised {type(error).__name__}: {error}", flush=True)
    print(f"chained: {type(error.__cause__).__name__}: {error.__cause__}", flush=True)
    sys.exit(1)
print(f"client {cluster.client_id} finished", flush=True)
