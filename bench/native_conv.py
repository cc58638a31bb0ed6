"""Convolutions with whole kernels run natively against as sums over taps, side by side.

A small convnet (two 3x3 Conv2D of 16 filters on 16x16x3, max pooling,
Dense), Adam, batch 32, on 8x1 and on 2x4 ("batch", "model") meshes of 8
CPU devices with the convolutions' kernels whole (the Dense split on 2x4):
the first `fit` step (trace, DTensor's layout, first run) and the mean later
step, with the convolutions run as DTensor's own Conv ops
(`tfmp.lowering.conv._native_conv`) and as tfmp's sum over kernel taps. The
native way runs first and last, so that its two runs bracket the machine's
drift. docs/performance.md has the numbers of a run.

    PYTHONPATH=$PWD python bench/native_conv.py [--steps 10]
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
from tfmp.lowering import conv as conv_lowering  # noqa: E402

BATCH = 32


def _model(shape: tuple[int, int]) -> keras.Model:
    device_mesh = tfmp.DeviceMesh(shape, ("batch", "model"))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["dense/kernel"] = ("model", None)
    with tfmp.ModelParallelStrategy(device_mesh, layout_map).scope():
        model = keras.Sequential(
            [
                keras.Input((16, 16, 3)),
                keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(8, name="dense"),
            ]
        )
        model.compile("adam", "mse")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="later steps timed")
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    n = BATCH * options.steps
    x = rng.normal(size=(n, 16, 16, 3)).astype("float32")
    y = rng.normal(size=(n, 8)).astype("float32")
    runs_natively = conv_lowering._runs_natively
    for shape in ((8, 1), (2, 4)):
        times = {}
        for way in ("native", "taps", "native again"):
            conv_lowering._runs_natively = runs_natively if way != "taps" else (lambda *args: False)
            times[way] = step_times.first_and_later_step(_model(shape), x, y, BATCH)
            print(
                f"{shape[0]}x{shape[1]} {way}: first step {times[way][0]:.2f} s, "
                f"later steps {times[way][1] * 1000:.1f} ms",
                flush=True,
            )
        conv_lowering._runs_natively = runs_natively
        for way in ("native", "native again"):
            for index, measure in enumerate(("first step", "later step")):
                print(
                    f'RESULT measure="convnet {shape[0]}x{shape[1]}, {measure}: taps / {way}" '
                    f"ratio={times['taps'][index] / times[way][index]:.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
