"""A tfmp program the multi-client tests run as several clients.

Usage: train_mlp.py OUT_DIR [per_client]. Trains the test MLP on a 2x4 mesh
spanning every client, saves the model and a BackupAndRestore backup, and
(client 0) writes the losses and weights. With `per_client`, each client's dataset holds only its own rows of
every batch (`strategy.distribute_datasets_from_function`), on a 4x2 mesh whose
device order interleaves the clients along the batch axis (client 0 holds
batch positions 0 and 2).
"""

import json
import os
import sys

import tfmp

cluster = tfmp.initialize(timeout_s=60)

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorflow as tf  # noqa: E402
from helpers import BatchLosses, build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map, train  # noqa: E402

BATCH = 16
out = sys.argv[1]
per_client = sys.argv[2:] == ["per_client"]
if per_client:
    first, second = np.split(np.array(tfmp.list_devices()), 2)
    interleaved = np.stack([first.reshape(2, 2), second.reshape(2, 2)], axis=1).reshape(-1)
    device_mesh = tfmp.DeviceMesh((4, 2), ("batch", "model"), list(interleaved))
else:
    device_mesh = mesh((2, 4))
strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
model = build_on(strategy, "mlp", initial_weights(build_mlp))
x, y = mlp_data(64)


def this_clients_rows(context: tf.distribute.InputContext) -> tf.data.Dataset:
    """Only this client's rows of every batch of BATCH."""
    parts, part = context.num_input_pipelines, context.input_pipeline_id
    rows = BATCH // parts
    mine = [a.reshape(-1, parts, rows, a.shape[-1])[:, part].reshape(-1, a.shape[-1]) for a in (x, y)]
    return tf.data.Dataset.from_tensor_slices(tuple(mine)).batch(rows)


if per_client:
    recorder = BatchLosses()
    history = model.fit(strategy.distribute_datasets_from_function(this_clients_rows), verbose=0, callbacks=[recorder])
    losses = recorder.losses
    print(f"client {cluster.client_id} read {len(x) // cluster.num_clients} rows")
else:
    losses, history = train(model, x, y, batch_size=BATCH)
weights = model.get_weights()
model.save(os.path.join(out, "model.keras"))
backup = keras.callbacks.BackupAndRestore(os.path.join(out, "backup"))
backup.set_model(model)
backup.on_epoch_end(0)
local = [str(d) for d in device_mesh.dtensor_mesh.local_devices()]
print(f"client {cluster.client_id} of {cluster.num_clients}: local devices {local}")
if cluster.is_chief:
    np.savez(os.path.join(out, "weights.npz"), *weights)
    with open(os.path.join(out, "result.json"), "w") as result:
        json.dump({"losses": losses, "history": history.history}, result)
