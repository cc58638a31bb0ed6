"""Train a model several times larger than fits one device, by sharding it.

This is the reason model parallelism exists. Give every device the same
memory budget for parameters plus optimizer state (Adam keeps two slots per
weight, so that is three times the parameters), counted as `tfmp.summary`
counts it (`tfmp.inspect.summary.bytes_per_device`). Then:

(a) the widest MLP whose weights and Adam state fit the budget on one device;
(b) the widest MLP whose weights and Adam state, split over 4 devices (a 1x4
    ("batch", "model") mesh, Megatron column/row split by `SHARDED_RULES`),
    fit the same budget on each of them: about 4 times the parameters.

Both train the same way (Adam, epochs, batch size, seed) on scikit-learn's
bundled digits dataset (8x8 images of handwritten digits, no download), with
a validation split. The script prints each model's size, its bytes on the
fullest device against the budget and its validation loss and accuracy, and
exits non-zero if either model's per-device bytes exceed the budget.

The model code (`build_mlp`) is plain Keras; parallelism is only the rules
table. Widths are found by building candidate models and measuring them.

Needs scikit-learn (`pip install scikit-learn`). Run (8 simulated CPU
devices; about 55 s on 2 cores):

    python examples/bigger_model.py

Full size (a 64 MiB budget: models of millions of parameters):

    python examples/bigger_model.py --full

On a host with 4 or more GPUs or TPU cores the models run on those instead
of the CPU devices.
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
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from tfmp.callbacks.memory import short_name
from tfmp.devices import devices_for
from tfmp.inspect.summary import bytes_per_device

# Per-device budget of parameters + optimizer state, and training, per mode.
MODES = {
    "small": {"budget_bytes": 32 * 1024, "epochs": 20},
    "full": {"budget_bytes": 64 * 1024**2, "epochs": 30},
}
BATCH_SIZE = 64
LEARNING_RATE = 1e-3
NUM_CLASSES = 10
MODEL_AXIS_SIZE = 4

# Megatron's split of the MLP: column-parallel layers split their outputs,
# the row-parallel layers after them consume those split outputs and sum.
SHARDED_RULES = {
    r"hidden_1/kernel": (None, "model"),
    r"hidden_1/bias": ("model",),
    r"hidden_2/kernel": ("model", None),
    r"hidden_3/kernel": (None, "model"),
    r"hidden_3/bias": ("model",),
    r"logits/kernel": ("model", None),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="a 64 MiB budget instead of 32 KiB")
    parser.add_argument("--epochs", type=int, default=None, help="overrides the mode's epochs")
    return parser.parse_args()


def load_digits_split() -> list[np.ndarray]:
    """Digits scaled to [0, 1], split 80/20 into training and validation."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def build_mlp(width: int) -> keras.Model:
    """Three hidden layers of `width` units on the 64 pixels, then 10 logits."""
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(width, activation="relu", name="hidden_1"),
            keras.layers.Dense(width, activation="relu", name="hidden_2"),
            keras.layers.Dense(width, activation="relu", name="hidden_3"),
            keras.layers.Dense(NUM_CLASSES, name="logits"),
        ],
        name=f"mlp_{width}",
    )


def build_compiled(strategy: tfmp.ModelParallelStrategy, width: int) -> keras.Model:
    """`build_mlp(width)` on the strategy's devices, with Adam's state created."""
    with strategy.scope():
        model = build_mlp(width)
        model.compile(
            optimizer=keras.optimizers.Adam(LEARNING_RATE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        # Created now rather than at the first step, so that they are counted.
        model.optimizer.build(model.trainable_variables)
    return model


def largest_device_bytes(model: keras.Model) -> int:
    """Bytes of parameters + optimizer state on the fullest device."""
    return max(kinds["total"] for kinds in bytes_per_device(model).values())


def widest_fitting(strategy: tfmp.ModelParallelStrategy, budget: int, step: int) -> int:
    """The largest width, a multiple of `step`, whose model fits `budget` per device.

    Bytes grow with width, so widths double until one does not fit and are
    then bisected.
    """

    def fits(width: int) -> bool:
        return largest_device_bytes(build_compiled(strategy, width)) <= budget

    fitting, too_wide = 0, step
    while fits(too_wide):
        fitting, too_wide = too_wide, 2 * too_wide
    while too_wide - fitting > step:
        middle = (fitting + too_wide) // 2 // step * step
        fitting, too_wide = (middle, too_wide) if fits(middle) else (fitting, middle)
    if fitting == 0:
        raise SystemExit(f"Even width {step} does not fit {budget:,} bytes per device.")
    return fitting


def train_and_report(
    label: str,
    strategy: tfmp.ModelParallelStrategy,
    width: int,
    budget: int,
    data: list[np.ndarray],
    epochs: int,
) -> int:
    """Trains `build_mlp(width)`, prints its figures; returns its parameter count.

    Raises:
        SystemExit: If a device holds more than `budget` bytes.
    """
    x_train, x_val, y_train, y_val = data
    keras.utils.set_random_seed(0)  # the same data order for both models
    model = build_compiled(strategy, width)
    history = model.fit(
        x_train, y_train, batch_size=BATCH_SIZE, epochs=epochs, verbose=0, validation_data=(x_val, y_val)
    )
    per_device = {short_name(device): kinds["total"] for device, kinds in bytes_per_device(model).items()}
    largest = max(per_device.values())
    parameters = model.count_params()
    print(f"{label}: width {width}, {parameters:,} parameters")
    print(f"{label}: bytes per device: " + ", ".join(f"{name} {size:,}" for name, size in per_device.items()))
    print(f"{label}: largest device {largest:,} bytes of budget {budget:,} ({largest / budget:.0%})")
    print(
        f"{label}: validation loss {history.history['val_loss'][-1]:.4f}, "
        f"accuracy {history.history['val_accuracy'][-1]:.3f}"
    )
    if largest > budget:
        raise SystemExit(f"{label}: {largest:,} bytes on one device exceed the budget of {budget:,}.")
    return parameters



def main() -> None:
    args = parse_args()
    mode = MODES["full" if args.full else "small"]
    tfmp.simulate_devices(8)  # 8 logical CPU devices: must come before any TensorFlow op
    budget, epochs = mode["budget_bytes"], args.epochs or mode["epochs"]
    devices = devices_for(MODEL_AXIS_SIZE)
    one_device = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((1, 1), ("batch", "model"), devices[:1]))
    sharded_mesh = tfmp.DeviceMesh((1, MODEL_AXIS_SIZE), ("batch", "model"), devices)
    sharded = tfmp.ModelParallelStrategy(sharded_mesh, SHARDED_RULES)
    print(f"budget: {budget:,} bytes per device (parameters + Adam state)")

    # Split layers need widths that divide by the number of devices they span.
    one_width = widest_fitting(one_device, budget, step=1)
    sharded_width = widest_fitting(sharded, budget, step=MODEL_AXIS_SIZE)
    data = load_digits_split()
    one_parameters = train_and_report("one device", one_device, one_width, budget, data, epochs)
    sharded_parameters = train_and_report(
        f"sharded over {MODEL_AXIS_SIZE}", sharded, sharded_width, budget, data, epochs
    )
    print(f"sharded model / one-device model: {sharded_parameters / one_parameters:.2f}x the parameters")


if __name__ == "__main__":
    main()
