"""Train a GPT-style LM with tensor + data parallelism, and watch it with tfmp's monitors.

The model is `tfmp.demo.build_transformer_lm`: plain Keras layers, untouched
by parallelism. The parallel plan is the table `tfmp.demo.MEGATRON_RULES`
(attention split by heads, the feed-forward block column- then row-parallel,
embedding and LM head split by vocabulary), applied on a 2x4
("batch", "model") mesh: each batch is split in two, every split weight in four.

Two callbacks put their figures into `History` and TensorBoard:

- `tfmp.callbacks.DeviceMemoryMonitor`: `mem/<device>/param_bytes`, the bytes
  of parameter and optimizer-slot shards each device holds (and measured
  memory on GPU/TPU), and `mem/process/max_rss_bytes`.
- `tfmp.callbacks.GradientSyncMonitor`: `sync/*`, the bytes one training step
  communicates per device (gradients, activations, per mesh axis) and
  `sync/mismatched_variables`, a bit-for-bit check that replicas agree.

Run (8 simulated CPU devices; about 30 s on 2 cores):

    python examples/gpt_tensor_data_parallel.py

Full size (7.4 million parameters, 128-token context; meant for 8 GPUs or TPU
cores, slow on a CPU):

    python examples/gpt_tensor_data_parallel.py --full --log-dir logs/gpt

then `tensorboard --logdir logs/gpt`. Without `--log-dir` the TensorBoard
logs go to a temporary directory, whose path is printed. On a host with 8 or
more GPUs or TPU cores the mesh takes those instead of the CPU devices.
"""

from __future__ import annotations

import os

# TensorFlow's C++ logs: fatal errors only (TF_CPP_MIN_LOG_LEVEL=0 shows them
# all). Set before TensorFlow loads; tfmp, imported first, also drops the lines
# TensorFlow writes before it reads this setting.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import tempfile

import tfmp  # before Keras: it imports TensorFlow
import keras

from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data
from tfmp.devices import devices_for

# Sizes of the two modes: the small one runs in under a minute on 2 CPU cores.
SIZES = {
    "small": {"vocab_size": 64, "seq_len": 16, "d_model": 64, "ffn_dim": 128, "sequences": 512, "epochs": 3},
    "full": {"vocab_size": 4096, "seq_len": 128, "d_model": 512, "ffn_dim": 2048, "sequences": 16384, "epochs": 5},
}
NUM_HEADS = 8  # divides by the "model" axis: each device holds 2 heads


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full-size model and data")
    parser.add_argument("--epochs", type=int, default=None, help="overrides the mode's epochs")
    parser.add_argument("--batch", type=int, default=32, help="global batch size (split over 'batch')")
    parser.add_argument("--log-dir", default=None, help="TensorBoard directory (default: a temporary one)")
    return parser.parse_args()



def main() -> None:
    args = parse_args()
    size = SIZES["full" if args.full else "small"]
    tfmp.simulate_devices(8)  # 8 logical CPU devices: must come before any TensorFlow op
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"), devices_for(8))
    strategy = tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh))
    print(f"mesh: {mesh}")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_transformer_lm(
            vocab_size=size["vocab_size"],
            seq_len=size["seq_len"],
            d_model=size["d_model"],
            num_heads=NUM_HEADS,
            ffn_dim=size["ffn_dim"],
        )
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = next_token_data(size["sequences"], seq_len=size["seq_len"], vocab_size=size["vocab_size"])
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="gpt_tensor_data_parallel_")
    callbacks = [
        tfmp.callbacks.DeviceMemoryMonitor(every_n_steps=8),
        tfmp.callbacks.GradientSyncMonitor(check_every_n_epochs=1),
        # After the monitors, so that their figures are in the logs it writes.
        keras.callbacks.TensorBoard(log_dir),
    ]
    history = model.fit(
        x, y, batch_size=args.batch, epochs=args.epochs or size["epochs"], verbose=0, callbacks=callbacks
    )
    for epoch, (loss, accuracy) in enumerate(
        zip(history.history["loss"], history.history["accuracy"]), start=1
    ):
        print(f"epoch {epoch}: loss {loss:.4f}, accuracy {accuracy:.3f}")
    # mem/*: bytes held per device; sync/*: bytes sent per device per training step.
    print("\nlast epoch's monitor figures (History):")
    for key in sorted(history.history):
        if key.startswith(("sync/", "mem/")):
            print(f"  {key}: {history.history[key][-1]:,.0f}")
    print(f"\nTensorBoard logs: {log_dir}")


if __name__ == "__main__":
    main()
