"""Convolutions run natively against as sums over taps, side by side.

A small convnet (two 3x3 Conv2D on 16x16x3, max pooling, Dense), Adam,
batch 32, on ("batch", "model") meshes of 8 CPU devices, with the
convolutions' kernels laid out three ways:

- whole: no rule splits them (the Dense is split over "model"), on 8x1
  and 2x4;
- filters: both kernels split over "model" on their filters, on 2x4 and
  1x8;
- channels: the second kernel split over "model" on its input channels,
  on 2x4 and 1x8;
- transposed: the second convolution a Conv2DTranspose of stride 2, its
  kernel whole, on 8x1 and 2x4.

For each: the first `fit` step (trace, DTensor's layout, first run) and the
median later step, with every convolution run as Keras' own op (on a kernel
gathered whole where it is split: `tfmp.lowering.conv._native_conv`) and as
tfmp's sum over kernel taps, and which way tfmp picks for each layer
(`tfmp.lowering.conv._runs_natively`, from the work a device duplicates per
element the taps move). The native way runs first and last, so that its two
runs bracket the machine's drift. docs/performance.md has the numbers of a
run.

    PYTHONPATH=$PWD python bench/native_conv.py [--steps 10] [--filters 16 64]
"""

from __future__ import annotations

import argparse
import math

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import step_times  # noqa: E402

import tfmp  # noqa: E402
from tfmp.forward import compute_specs  # noqa: E402
from tfmp.lowering import conv as conv_lowering  # noqa: E402

BATCH = 32
KERNEL_RULES = {
    "whole": {},
    "filters": {"conv_[ab]/kernel": (None, None, None, "model")},
    "channels": {"conv_b/kernel": (None, None, "model", None)},
    "transposed": {},
}
MESHES = {
    "whole": ((8, 1), (2, 4)),
    "filters": ((2, 4), (1, 8)),
    "channels": ((2, 4), (1, 8)),
    "transposed": ((8, 1), (2, 4)),
}


def _second_conv(kernels: str, filters: int) -> keras.layers.Layer:
    if kernels == "transposed":
        return keras.layers.Conv2DTranspose(filters, 3, strides=2, activation="relu", padding="same", name="conv_b")
    return keras.layers.Conv2D(filters, 3, activation="relu", padding="same", name="conv_b")


def _model(shape: tuple[int, int], kernels: str, filters: int) -> keras.Model:
    device_mesh = tfmp.DeviceMesh(shape, ("batch", "model"))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["dense/kernel"] = ("model", None)
    for key, layout in KERNEL_RULES[kernels].items():
        layout_map[key] = layout
    with tfmp.ModelParallelStrategy(device_mesh, layout_map).scope():
        model = keras.Sequential(
            [
                keras.Input((16, 16, 3)),
                keras.layers.Conv2D(filters, 3, activation="relu", padding="same", name="conv_a"),
                keras.layers.MaxPooling2D(),
                _second_conv(kernels, filters),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(8, name="dense"),
            ]
        )
        model.compile("adam", "mse")
    return model


def _tfmp_ways(model: keras.Model, threshold: float) -> str:
    """Each convolution's way as tfmp picks it, with the work it duplicates
    gathered per element the taps move."""
    ways = []
    for layer in model.layers:
        if isinstance(layer, (keras.layers.Conv2D, keras.layers.Conv2DTranspose)):
            mesh = layer.kernel._value.compute_layout.mesh
            specs = compute_specs(layer.kernel)
            channels = "fc" if isinstance(layer, keras.layers.Conv2DTranspose) else "cf"
            work = conv_lowering._gathered_work_per_moved_element(layer.kernel.shape, specs, mesh, channels)
            ways.append(f"{layer.name} {'natively' if work <= threshold else 'by taps'} ({work:.0f})")
    return ", ".join(ways)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="later steps timed")
    parser.add_argument("--filters", type=int, nargs="+", default=[16, 64], help="filters of each Conv2D")
    parser.add_argument("--kernels", nargs="+", default=list(KERNEL_RULES), choices=list(KERNEL_RULES))
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    n = BATCH * options.steps
    x = rng.normal(size=(n, 16, 16, 3)).astype("float32")
    y = rng.normal(size=(n, 8)).astype("float32")
    threshold = conv_lowering.GATHERED_WORK_PER_MOVED_ELEMENT
    for filters in options.filters:
        for kernels in options.kernels:
            for shape in MESHES[kernels]:
                case = f"{filters} filters, kernels {kernels}, {shape[0]}x{shape[1]}"
                print(f"{case}: tfmp runs {_tfmp_ways(_model(shape, kernels, filters), threshold)}", flush=True)
                step_times.compare_ways(
                    f"convnet {case}",
                    case,
                    _use,
                    lambda: _model(shape, kernels, filters),
                    x,
                    y,
                    BATCH,
                )
                conv_lowering.GATHERED_WORK_PER_MOVED_ELEMENT = threshold


def _use(way: str) -> None:
    """Every convolution by taps, or natively wherever possible."""
    conv_lowering.GATHERED_WORK_PER_MOVED_ELEMENT = -1 if way == "taps" else math.inf

if __name__ == "__main__":
    main()
