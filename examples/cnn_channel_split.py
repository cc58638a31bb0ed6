"""Train a small CNN whose convolutions are split over devices by channels.

Each block is a pair of `tfmp.layers.ParallelConv2D`, the convolutional form
of Megatron's column/row split of an MLP:

- `split="filters"`: the kernel is split by output filters, so each device
  computes a quarter of the feature maps; no communication forward.
- `split="channels"`: the kernel is split by input channels, so each device
  convolves the quarter of the feature maps it already holds; one all-reduce
  sums the partial outputs.

The pair holds a quarter of its kernels per device, and the split feature maps
between the two convolutions never travel. The mesh is 2x4
("batch", "model"): images are also split over "batch". Off a mesh
`ParallelConv2D` is `keras.layers.Conv2D`.

The task: generated noisy images with one bright square, labelled by the
quadrant the square is in.

Run (8 simulated CPU devices; about 40 s on 2 cores):

    python examples/cnn_channel_split.py

Full size (2.3 million parameters, 64x64 images; meant for 8 GPUs or TPU
cores, slow on a CPU):

    python examples/cnn_channel_split.py --full

It prints the loss and accuracy of every epoch, the validation accuracy and
`tfmp.summary`. On a host with 8 or more GPUs or TPU cores the mesh takes
those instead of the CPU devices.
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
    "small": {"image_size": 16, "widths": (16, 32), "images": 768, "epochs": 3},
    "full": {"image_size": 64, "widths": (64, 128, 256), "images": 16384, "epochs": 8},
}
NUM_CLASSES = 4  # the quadrant of the bright square
SQUARE = 4  # side of the square, in pixels
# A faint square in strong noise, so that learning takes more than one epoch.
BRIGHTNESS = 0.5
NOISE = 0.6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full-size model and data")
    parser.add_argument("--epochs", type=int, default=None, help="overrides the mode's epochs")
    parser.add_argument("--batch", type=int, default=64, help="global batch size (split over 'batch')")
    return parser.parse_args()


def make_images(count: int, image_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Noisy RGB images with one bright square; the label is its quadrant."""
    rng = np.random.default_rng(seed)
    images = rng.normal(0.0, NOISE, size=(count, image_size, image_size, 3)).astype("float32")
    labels = rng.integers(0, NUM_CLASSES, size=count).astype("int32")
    half = image_size // 2
    for image, label in zip(images, labels):
        top = (label // 2) * half + rng.integers(0, half - SQUARE + 1)
        left = (label % 2) * half + rng.integers(0, half - SQUARE + 1)
        image[top : top + SQUARE, left : left + SQUARE] += BRIGHTNESS
    return images, labels


def conv_block(x: keras.KerasTensor, width: int, name: str) -> keras.KerasTensor:
    """A filter-split conv, a channel-split conv, then 2x2 pooling."""
    x = tfmp.layers.ParallelConv2D(
        2 * width, 3, padding="same", activation="relu", split="filters", name=f"{name}_filters"
    )(x)
    x = tfmp.layers.ParallelConv2D(
        width, 3, padding="same", activation="relu", split="channels", name=f"{name}_channels"
    )(x)
    return keras.layers.MaxPooling2D(name=f"{name}_pool")(x)


def build_cnn(image_size: int, widths: tuple[int, ...]) -> keras.Model:
    """`conv_block`s of the given widths, global pooling and a classifier."""
    inputs = keras.Input((image_size, image_size, 3))
    x = inputs
    for i, width in enumerate(widths):
        x = conv_block(x, width, name=f"block_{i}")
    x = keras.layers.GlobalMaxPooling2D(name="pool")(x)
    outputs = keras.layers.Dense(NUM_CLASSES, name="classifier")(x)
    return keras.Model(inputs, outputs, name="cnn")



def main() -> None:
    args = parse_args()
    size = SIZES["full" if args.full else "small"]
    tfmp.simulate_devices(8)  # 8 logical CPU devices: must come before any TensorFlow op
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"), devices_for(8))
    strategy = tfmp.ModelParallelStrategy(mesh)  # the layers declare their own layouts
    print(f"mesh: {mesh}")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_cnn(size["image_size"], size["widths"])
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = make_images(size["images"], size["image_size"])
    x_val, y_val = make_images(size["images"] // 4, size["image_size"], seed=1)
    history = model.fit(
        x, y, batch_size=args.batch, epochs=args.epochs or size["epochs"], verbose=0,
        validation_data=(x_val, y_val),
    )
    for epoch, (loss, accuracy) in enumerate(
        zip(history.history["loss"], history.history["accuracy"]), start=1
    ):
        print(f"epoch {epoch}: loss {loss:.4f}, accuracy {accuracy:.3f}")
    print(
        f"validation: loss {history.history['val_loss'][-1]:.4f}, "
        f"accuracy {history.history['val_accuracy'][-1]:.3f}"
    )
    tfmp.summary(model)


if __name__ == "__main__":
    main()
