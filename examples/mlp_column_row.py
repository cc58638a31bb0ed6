"""Train an MLP split Megatron-style: ColumnParallelDense -> RowParallelDense.

Shows tensor parallelism (the hidden layer is split over the "model" axis) and
data parallelism (each batch is split over the "batch" axis) at once, on a
2x4 ("batch", "model") mesh, with `model.fit` unchanged.

Each block is a `ColumnParallelDense` (the kernel split by output columns: each
device computes a quarter of the hidden units, no communication) followed by a
`RowParallelDense` (the kernel split by input rows: each device multiplies its
quarter of the hidden units, and one all-reduce sums the partial outputs).
Off a mesh both layers are plain `keras.layers.Dense`.

Run (8 simulated CPU devices; about 30 s on 2 cores):

    python examples/mlp_column_row.py

Full size (34 million parameters, 32,768 samples; meant for 8 GPUs or TPU
cores, slow on a CPU):

    python examples/mlp_column_row.py --full

It prints the loss and accuracy of every epoch, then `tfmp.summary`: each
variable's layout and the bytes every device holds. On a host with 8 or more
GPUs or TPU cores the mesh takes those instead of the CPU devices.
"""

from __future__ import annotations

import os

# TensorFlow's C++ logs: fatal errors only (TF_CPP_MIN_LOG_LEVEL=0 shows them
# all). Set before TensorFlow loads; tfmp, imported first, also drops the lines
# TensorFlow writes before it reads this setting.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse

import tfmp  # before Keras: it imports TensorFlow
import keras
import numpy as np

from tfmp.devices import devices_for

# Sizes of the two modes: the small one runs in under a minute on 2 CPU cores.
SIZES = {
    "small": {"features": 32, "hidden": 256, "width": 64, "blocks": 2, "samples": 2048, "epochs": 5},
    "full": {"features": 256, "hidden": 4096, "width": 1024, "blocks": 4, "samples": 32768, "epochs": 5},
}
NUM_CLASSES = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full-size model and data")
    parser.add_argument("--epochs", type=int, default=None, help="overrides the mode's epochs")
    parser.add_argument("--batch", type=int, default=64, help="global batch size (split over 'batch')")
    return parser.parse_args()


def make_data(samples: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Points labelled by a random linear teacher: a task an MLP learns quickly."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    teacher = rng.normal(size=(features, NUM_CLASSES))
    return x, np.argmax(x @ teacher, axis=1).astype("int32")


def build_mlp(features: int, hidden: int, width: int, blocks: int) -> keras.Model:
    """`blocks` column/row-parallel pairs, then a (replicated) classifier head."""
    inputs = keras.Input((features,))
    x = keras.layers.Dense(width, activation="relu", name="embed")(inputs)
    for i in range(blocks):
        h = tfmp.layers.ColumnParallelDense(hidden, activation="relu", name=f"up_{i}")(x)
        x = x + tfmp.layers.RowParallelDense(width, name=f"down_{i}")(h)
    outputs = keras.layers.Dense(NUM_CLASSES, name="classifier")(x)
    return keras.Model(inputs, outputs, name="mlp")



def main() -> None:
    args = parse_args()
    size = SIZES["full" if args.full else "small"]
    tfmp.simulate_devices(8)  # 8 logical CPU devices: must come before any TensorFlow op
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"), devices_for(8))
    strategy = tfmp.ModelParallelStrategy(mesh)  # the layers declare their own layouts
    print(f"mesh: {mesh}")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_mlp(size["features"], size["hidden"], size["width"], size["blocks"])
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = make_data(size["samples"], size["features"])
    history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs or size["epochs"], verbose=0)
    for epoch, (loss, accuracy) in enumerate(
        zip(history.history["loss"], history.history["accuracy"]), start=1
    ):
        print(f"epoch {epoch}: loss {loss:.4f}, accuracy {accuracy:.3f}")
    tfmp.summary(model)


if __name__ == "__main__":
    main()
