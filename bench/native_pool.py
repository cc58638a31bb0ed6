"""Max pooling as Keras' own op on the batch split against a sum over taps, side by side.

A convnet (two 3x3 Conv2D with max pooling after each, global average
pooling, a Dense), Adam, batch 32, on ("batch", "model") meshes of 8 CPU
devices, the convolutions' kernels laid out three ways:

- whole: no rule splits them, on 8x1 and 2x4;
- filters: both split over "model" on their filters (each pooling's input
  channels split), on 2x4 and 1x8;
- paired: the first split on its filters, the second on its input
  channels (Megatron's pair of a column- and a row-parallel layer, across
  the pooling), on 2x4 and 1x8.

For each: the first `fit` step and the median later step with the poolings
run as Keras' own `MaxPool` on their input pinned to the batch split
(channels gathered where split: `tfmp.lowering.pooling._native_max_pool`),
and as tfmp's maximum over the window's taps. The native way runs first and
last, bracketing the machine's drift; each way prints its last loss (the two
agree to float order). docs/performance.md has the numbers of a run.

    PYTHONPATH=$PWD python bench/native_pool.py [--steps 10] [--filters 16 64] [--image 32]
"""

from __future__ import annotations

import argparse

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import step_times  # noqa: E402

import tfmp  # noqa: E402
from tfmp.lowering import pooling  # noqa: E402

BATCH = 32
KERNEL_RULES = {
    "whole": {},
    "filters": {"conv_[ab]/kernel": (None, None, None, "model"), "conv_[ab]/bias": ("model",)},
    "paired": {
        "conv_a/kernel": (None, None, None, "model"),
        "conv_a/bias": ("model",),
        "conv_b/kernel": (None, None, "model", None),
    },
}
MESHES = {"whole": ((8, 1), (2, 4)), "filters": ((2, 4), (1, 8)), "paired": ((2, 4), (1, 8))}


def _model(shape: tuple[int, int], kernels: str, filters: int, image: int) -> keras.Model:
    device_mesh = tfmp.DeviceMesh(shape, ("batch", "model"))
    keras.utils.set_random_seed(0)
    layout_map = tfmp.LayoutMap(device_mesh)
    for key, layout in KERNEL_RULES[kernels].items():
        layout_map[key] = layout
    with tfmp.ModelParallelStrategy(device_mesh, layout_map).scope():
        model = keras.Sequential(
            [
                keras.Input((image, image, 3)),
                keras.layers.Conv2D(filters, 3, activation="relu", padding="same", name="conv_a"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(filters, 3, activation="relu", padding="same", name="conv_b"),
                keras.layers.MaxPooling2D(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(8, name="dense"),
            ]
        )
        model.compile("adam", "mse")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="later steps timed")
    parser.add_argument("--filters", type=int, nargs="+", default=[16, 64], help="filters of each Conv2D")
    parser.add_argument("--image", type=int, default=32, help="height and width of the input images")
    parser.add_argument("--kernels", nargs="+", default=list(KERNEL_RULES), choices=list(KERNEL_RULES))
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    n = BATCH * options.steps
    x = rng.normal(size=(n, options.image, options.image, 3)).astype("float32")
    y = rng.normal(size=(n, 8)).astype("float32")
    native_ranks = pooling.NATIVE_INPUT_RANKS
    for filters in options.filters:
        for kernels in options.kernels:
            for shape in MESHES[kernels]:
                case = f"{filters} filters, kernels {kernels}, {shape[0]}x{shape[1]}"
                step_times.compare_ways(
                    f"max pooling {case}",
                    case,
                    lambda way: setattr(pooling, "NATIVE_INPUT_RANKS", () if way == "taps" else native_ranks),
                    lambda: _model(shape, kernels, filters, options.image),
                    x,
                    y,
                    BATCH,
                    describe=lambda model: f"loss after {_loss(model, x, y):.6f}",
                )
                pooling.NATIVE_INPUT_RANKS = native_ranks


def _loss(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    return float(model.evaluate(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0))

if __name__ == "__main__":
    main()
