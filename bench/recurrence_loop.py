"""A recurrence on a mesh as one loop against unrolled, side by side in one process.

A BiLSTM (Embedding with mask_zero, 16 units, gates split over "model") on a
2x4 ("batch", "model") mesh of 8 CPU devices: the first `fit` step (trace,
DTensor's layout, first run) and the median later step, with the recurrence
run as tfmp's loop (`tfmp.lowering.rnn_loop`) and unrolled (the loop
declined). The loop runs first and last, so that its two runs bracket the
machine's drift. docs/performance.md has the numbers of a run.

    PYTHONPATH=$PWD python bench/recurrence_loop.py [--time-steps 32]
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
from tfmp.lowering import rnn as rnn_lowering  # noqa: E402

BATCH = 8


def _model(time_steps: int) -> keras.Model:
    device_mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["lstm_cell/(recurrent_)?kernel"] = (None, "model")
    layout_map["lstm_cell/bias"] = ("model",)
    with tfmp.ModelParallelStrategy(device_mesh, layout_map).scope():
        tokens = keras.Input((time_steps,), dtype="int32")
        x = keras.layers.Embedding(20, 16, mask_zero=True)(tokens)
        x = keras.layers.Bidirectional(keras.layers.LSTM(16))(x)
        model = keras.Model(tokens, keras.layers.Dense(2)(x))
        model.compile("adam", "mse")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-steps", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="later steps timed")
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    n = BATCH * options.steps
    x = rng.integers(1, 20, size=(n, options.time_steps)).astype("int32")
    y = rng.normal(size=(n, 2)).astype("float32")
    looped_rnn = rnn_lowering.looped_rnn
    times = {}
    for way in ("loop", "unrolled", "loop again"):
        rnn_lowering.looped_rnn = looped_rnn if way != "unrolled" else (lambda *args: None)
        times[way] = step_times.first_and_later_step(_model(options.time_steps), x, y, BATCH)
        print(f"{way}: first step {times[way][0]:.2f} s, later steps {times[way][1] * 1000:.1f} ms", flush=True)
    rnn_lowering.looped_rnn = looped_rnn
    unrolled = times["unrolled"][0]
    for way in ("loop", "loop again"):
        print(
            f'RESULT measure="first step, BiLSTM T={options.time_steps} 2x4: unrolled / {way}" '
            f"ratio={unrolled / times[way][0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
