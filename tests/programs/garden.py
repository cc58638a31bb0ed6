"""Model Garden's `train_lib.run_experiment` on a 2x4 mesh spanning every client.

Usage: garden.py OUT_DIR. Trains the Model Garden test classifier 8 steps
(`train` mode), then runs the experiment again to 12 steps
(`train_and_eval`), restoring step 8 from the checkpoints every client wrote
into OUT_DIR/model; client 0 writes the per-step logs, the final evaluation
and the weights.
"""

import json
import os
import sys

import tfmp

cluster = tfmp.initialize(timeout_s=60)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from garden_helpers import initial_weights, megatron_layout_map, run_experiment  # noqa: E402

out = sys.argv[1]
weights = initial_weights()
device_mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
strategy = tfmp.ModelParallelStrategy(device_mesh, megatron_layout_map(device_mesh))
first = run_experiment(strategy, weights, os.path.join(out, "model"), 8, mode="train")
resumed = run_experiment(strategy, weights, os.path.join(out, "model"), 12)
if cluster.is_chief:
    np.savez(os.path.join(out, "weights.npz"), *resumed[2])
    with open(os.path.join(out, "result.json"), "w") as result:
        json.dump({"first": first[0], "resumed": resumed[0], "evaluation": resumed[1]}, result)
