"""A tfmp program the multi-client tests run as several clients.

Usage: train_mlp.py OUT_DIR. Trains the test MLP on a 2x4 mesh spanning every
client, saves the model, and (client 0) writes the losses and weights.
"""

import json
import os
import sys

import tfmp

cluster = tfmp.initialize(timeout_s=60)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map, train  # noqa: E402

out = sys.argv[1]
device_mesh = mesh((2, 4))
strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
model = build_on(strategy, "mlp", initial_weights(build_mlp))
losses, history = train(model, *mlp_data(64))
weights = model.get_weights()
model.save(os.path.join(out, "model.keras"))
local = [str(d) for d in device_mesh.dtensor_mesh.local_devices()]
print(f"client {cluster.client_id} of {cluster.num_clients}: local devices {local}")
if cluster.is_chief:
    np.savez(os.path.join(out, "weights.npz"), *weights)
    with open(os.path.join(out, "result.json"), "w") as result:
        json.dump({"losses": losses, "history": history.history}, result)
