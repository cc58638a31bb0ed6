"""A compiled epoch as one loop against a traced copy of the step per batch, side by side.

The program of TensorFlow's custom-loop tutorial, its variant that compiles
the whole epoch: `for batch in dist_dataset:` around `strategy.run` inside a
`tf.function`, an MLP with Adam on a 2x4 ("batch", "model") mesh of 8 CPU
devices with `layout_map="auto"`, 61 batches of 8 with a last of 5. Each way
times its first three calls (the first traces and lays out). tfmp runs the
loop through `MeshDataset.reduce` (the full batches in one `tf.while_loop`,
the partial last batch after it); `tf.function(autograph=False)` keeps the
loop in Python, which traces one copy of the step per batch. The loop runs
first and last, so that its two runs bracket the machine's drift.
docs/performance.md has the numbers of a run.

    PYTHONPATH=$PWD python bench/compiled_epoch.py [--batches 61]
"""

from __future__ import annotations

import argparse
import time

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmp  # noqa: E402

BATCH = 8
CALLS = 3


def _epoch_function(autograph: bool, dataset: tf.data.Dataset):
    strategy = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((2, 4), ("batch", "model")), layout_map="auto")
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)]
        )
        optimizer = keras.optimizers.Adam(0.01)
    loss_object = keras.losses.MeanSquaredError(reduction=None)

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(labels, model(features, training=True)), global_batch_size=BATCH)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function(autograph=autograph)
    def train_epoch():
        total_loss = 0.0
        for batch in dist_dataset:
            total_loss += strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)
        return total_loss

    return train_epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=61, help="batches per epoch, the last of 5 rows")
    options = parser.parse_args()
    rows = BATCH * (options.batches - 1) + 5
    rng = np.random.default_rng(0)
    data = rng.normal(size=(rows, 16)).astype("float32"), rng.normal(size=(rows, 4)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(BATCH)
    times = {}
    for way in ("loop", "per batch", "loop again"):
        train_epoch = _epoch_function(way != "per batch", dataset)
        times[way] = []
        for _ in range(CALLS):
            start = time.perf_counter()
            float(train_epoch())
            times[way].append(time.perf_counter() - start)
        print(f"{way}: calls " + " / ".join(f"{t:.2f}" for t in times[way]) + " s", flush=True)
    for way in ("loop", "loop again"):
        for call in range(CALLS):
            print(
                f'RESULT measure="compiled epoch of {options.batches} batches, call {call + 1}: '
                f'per batch / {way}" ratio={times["per batch"][call] / times[way][call]:.2f}',
                flush=True,
            )


if __name__ == "__main__":
    main()
