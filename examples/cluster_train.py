"""Train on the cluster this job runs in: SLURM, Kubernetes, Cloud TPU or `tfmp launch`.

The same program runs in every client (one per host, or one per GPU): its
first line, `tfmp.initialize()`, finds the cluster from what the cluster
manager set (a SLURM job step, the `TF_CONFIG` of a Kubeflow TFJob, a TPU
slice's variables, or `tfmp launch`'s), then the mesh spans every client's
devices: data parallel across clients, tensor parallel within each.

    srun python examples/cluster_train.py --device GPU     # examples/slurm/train.sbatch
    kubectl apply -f examples/kubernetes/tfjob.yaml        # 2 TFJob workers
    tfmp launch --num-processes 2 --devices-per-process 4 -- python examples/cluster_train.py

`--backup-dir` (on a file system every client sees) makes a restarted job
(`sbatch --requeue`, the TFJob's `restartPolicy`, `tfmp launch
--max-restarts`) resume from its last backup; client 0 saves the model there.
Flags: `--device CPU|GPU|TPU`, `--epochs`, `--batch`, `--hidden`.
"""

from __future__ import annotations

import argparse
import os

import tfmp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="CPU, GPU or TPU (default: the cluster's, else CPU)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--backup-dir", default=None, help="BackupAndRestore directory all clients see")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cluster = tfmp.initialize(device_type=args.device)  # before anything else touches TensorFlow
    import keras
    import numpy as np

    mesh = tfmp.DeviceMesh((cluster.num_clients, cluster.local_devices), ("batch", "model"))
    strategy = tfmp.ModelParallelStrategy(mesh)  # the layers declare their own layouts
    keras.utils.set_random_seed(0)  # the same initial weights in every client
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((32,)),
            tfmp.layers.ColumnParallelDense(args.hidden, activation="relu", name="up"),
            tfmp.layers.RowParallelDense(10, name="down"),
        ])
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    rng = np.random.default_rng(0)  # every client reads the same data
    x = rng.normal(size=(1024, 32)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(32, 10)), axis=1)
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(args.backup_dir, "backup"))] if args.backup_dir else []
    history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0, callbacks=callbacks)
    if args.backup_dir:
        model.save(os.path.join(args.backup_dir, "model.keras"))  # written by client 0
    print(
        f"client {cluster.client_id} of {cluster.num_clients} on mesh {mesh}: final loss "
        f"{history.history['loss'][-1]:.4f}, accuracy {history.history['accuracy'][-1]:.3f}"
    )


if __name__ == "__main__":
    main()
