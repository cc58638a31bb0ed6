"""Train a Transformer LM on TPU cores with tfmp: tensor + data parallelism.

On a TPU VM (one host, e.g. v4-8 or v5e-8):

    pip install tfmp "tensorflow-tpu" -f https://storage.googleapis.com/libtpu-releases/index.html
    python examples/tpu_train.py --mesh 2x4 --epochs 5

The cluster comes from `TPUClusterResolver`, as for `TPUStrategy`. On a
multi-host TPU slice, run the same command on every host: on GKE each pod
has `TPU_WORKER_HOSTNAMES` and `TPU_WORKER_ID`, on TPU VMs export them (see
docs/multi-host.md); the mesh then spans every host's cores.

`--dry-run` runs every line except the TPU connection (the resolver and
`tfmp.initialize` included) on 8 simulated CPU devices, so that CI checks
the script:

    python examples/tpu_train.py --dry-run --epochs 1

Flags: `--tpu` names the TPU (default `local`, the TPU VM's own cores),
`--mesh BATCHxMODEL`, `--width`, `--layers`, `--vocab`, `--seq`, `--batch`,
`--steps`, `--checkpoint-dir` (BackupAndRestore: a preempted run resumes
from the last epoch).
"""

from __future__ import annotations

import os

# TensorFlow's C++ logs: fatal errors only (TF_CPP_MIN_LOG_LEVEL=0 shows them
# all). Set before TensorFlow loads; tfmp, imported first, also drops the lines
# TensorFlow writes before it reads this setting.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import tempfile

import tfmp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="8 simulated CPU devices, no TPU")
    parser.add_argument("--tpu", default="local", help="TPU name or 'local' (the TPU VM's cores)")
    parser.add_argument("--mesh", default="2x4", help="BATCHxMODEL, e.g. 2x4")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--checkpoint-dir", default=None)
    return parser.parse_args()


def connect(args: argparse.Namespace) -> str:
    """Joins the TPU's hosts and sets up the devices; returns their type."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local" if args.dry_run else args.tpu)
    if args.dry_run:  # all but the TPU itself: 8 CPU devices stand in for its cores
        cluster = tfmp.initialize(cluster_resolver=resolver, device_type="CPU", num_local_devices=8)
    else:
        if args.tpu != "local":  # a TPU reached over the network
            tf.config.experimental_connect_to_cluster(resolver)
        cluster = tfmp.initialize(cluster_resolver=resolver)  # this host, or every host of the slice
    print(f"cluster: {cluster}")
    return cluster.device_type


def build_lm(args: argparse.Namespace):
    """A GPT-style LM whose layers say how they are split over "model"."""
    import keras

    tokens = keras.Input((args.seq,), dtype="int32")
    x = tfmp.layers.VocabParallelEmbedding(args.vocab, args.width, name="embed")(tokens)
    for i in range(args.layers):
        attention = tfmp.layers.ParallelMultiHeadAttention(8, args.width // 8, name=f"attention_{i}")
        x = keras.layers.LayerNormalization(name=f"norm_a{i}")(x + attention(x, x, use_causal_mask=True))
        h = tfmp.layers.ColumnParallelDense(4 * args.width, activation="gelu", name=f"ffn_in_{i}")(x)
        h = tfmp.layers.RowParallelDense(args.width, name=f"ffn_out_{i}")(h)
        x = keras.layers.LayerNormalization(name=f"norm_f{i}")(x + h)
    head = tfmp.layers.Sharded(keras.layers.Dense(args.vocab, name="head"), {"kernel": (None, True), "bias": (True,)})
    return keras.Model(tokens, head(x), name="gpt")


def main() -> None:
    args = parse_args()
    device_type = connect(args)
    import keras

    from tfmp.demo import next_token_data

    batch, model_axis = (int(s) for s in args.mesh.lower().split("x"))
    mesh = tfmp.DeviceMesh((batch, model_axis), ("batch", "model"), tfmp.list_devices(device_type)[: batch * model_axis])
    strategy = tfmp.ModelParallelStrategy(mesh)
    print(f"mesh: {mesh}")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_lm(args)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    tfmp.summary(model)
    x, y = next_token_data(args.batch * args.steps, seq_len=args.seq, vocab_size=args.vocab)
    backup_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="tpu_train_")
    history = model.fit(
        x, y, batch_size=args.batch, epochs=args.epochs, verbose=2,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir)],
    )
    print(f"final loss {history.history['loss'][-1]:.4f}, accuracy {history.history['accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
