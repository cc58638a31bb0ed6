"""TensorFlow ops that user code calls directly (layers and train_steps
written before Keras 3) run on a mesh with one device's numbers.

Random ops: TensorFlow's stateful kernels (`tf.random.normal`, `uniform`,
`truncated_normal`, `tf.keras.backend.random_normal`) draw bitwise one
device's numbers on the mesh, step after step, once the global seed is set
(with or without an op seed). Unseeded ones,
`tf.random.shuffle` and `tf.random.categorical` cannot equal one device's
(one device seeds an unseeded kernel at random; no stateless op reproduces
the shuffle and multinomial kernels): those are checked in distribution, and
whole on every device (every shard of the replicated draw equal), since a
draw that differed between devices would train silently wrong.

Other op families (shapes, reductions, math, gathers, one-hot and argmax, selections, casts) run
in a layer between a column- and a row-parallel Dense, where the activation
is split over batch and "model", with a last batch that does not divide the
batch axis (21 samples at batch 8 on 2x4).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from helpers import assert_parity, mesh, rules

import tfmp


def _seeded_draws():
    shape = tf.stack([tf.constant(5), 3])  # a shape known only as the step runs
    return {
        "normal": tf.random.normal(shape, mean=1.0, stddev=2.0, seed=1),
        "uniform": tf.random.uniform([7], minval=-1.0, maxval=3.0, seed=2),
        "randint": tf.random.uniform([6], maxval=10, dtype=tf.int32, seed=3),
        "truncated": tf.random.truncated_normal([4, 2], seed=4),
        "legacy_keras": tf.keras.backend.random_normal([3], seed=5),
        "same_seed_again": tf.random.normal(shape, mean=1.0, stddev=2.0, seed=1),
        # Seeded by the global seed and its place among the graph's unseeded ops.
        "global_seed_only": tf.random.uniform([5]),
    }


def _three_steps(step):
    results = []
    for _ in range(3):
        results.append({k: v.numpy() for k, v in step().items()})
    return results


@pytest.fixture(scope="module")
def strategy():
    return tfmp.ModelParallelStrategy(mesh((2, 4)))


def test_seeded_stateful_draws_equal_one_devices_step_after_step(strategy):
    tf.random.set_seed(11)
    want = _three_steps(tf.function(_seeded_draws))
    tf.random.set_seed(11)
    step = tf.function(lambda: strategy.run(_seeded_draws))
    got = _three_steps(step)
    for want_step, got_step in zip(want, got):
        for key in want_step:
            np.testing.assert_array_equal(got_step[key], want_step[key], err_msg=key)
    # A kernel continues its sequence from step to step.
    assert not np.array_equal(want[0]["normal"], want[1]["normal"])


def _distribution_draws():
    logits = tf.math.log([[0.2, 0.3, 0.5]])
    return {
        "normal": tf.random.normal([20000]),
        "shuffled": tf.random.shuffle(tf.range(64)),
        "categorical": tf.random.categorical(logits, 20000),
    }


def test_unseeded_shuffled_and_categorical_draws_match_in_distribution(strategy):
    """No equality to one device is possible here (see the module docstring):
    moments, a permutation, class frequencies within 4 standard errors, and
    the same numbers on every device."""
    tf.random.set_seed(None)  # no seed anywhere: one device seeds at random
    step = tf.function(lambda: strategy.run(_distribution_draws))
    first, second = step(), step()
    for name, value in first.items():
        shards = [s.numpy() for s in dtensor.unpack(value)]
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0], err_msg=f"{name} differs between devices")
    normal = first["normal"].numpy()
    assert abs(normal.mean()) < 4 / np.sqrt(normal.size)
    assert abs(normal.std() - 1) < 4 / np.sqrt(2 * normal.size)
    shuffled = first["shuffled"].numpy()
    np.testing.assert_array_equal(np.sort(shuffled), np.arange(64))
    assert not np.array_equal(shuffled, np.arange(64))
    assert not np.array_equal(shuffled, second["shuffled"].numpy())  # a new permutation each step
    counts = np.bincount(first["categorical"].numpy().ravel(), minlength=3) / 20000
    np.testing.assert_allclose(counts, [0.2, 0.3, 0.5], atol=4 * np.sqrt(0.25 / 20000))


class NoisyDense(keras.layers.Layer):
    """A pre-Keras-3 layer: Gaussian noise from tf.random.normal, seeded."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, activation="relu", name="up")

    def call(self, x, training=False):
        if training:
            x = x + 0.1 * tf.random.normal(tf.shape(x), seed=6)
        return self.dense(x)


def test_a_layer_drawing_with_tf_random_trains_like_one_device():
    def build():
        inputs = keras.Input((16,))
        hidden = NoisyDense(32, name="noisy")(inputs)
        return keras.Model(inputs, keras.layers.Dense(8, name="down")(hidden))

    x, y = _data(21)
    tf.random.set_seed(11)
    assert_parity(build, rules(DENSE_SPLIT), x, y, steps=3, batch_size=8)


# Each family of TensorFlow ops, as a layer's call on an activation split over
# batch and "model" (after the column-parallel "up").
OP_FAMILIES = {
    "shape_reshape_concat_stack": lambda x: tf.reduce_sum(tf.stack([x, 2 * x], axis=1), axis=1)
    + tf.concat([x[:, :16], x[:, 16:]], axis=-1)
    + tf.reshape(x, [-1, 32])
    + tf.zeros(tf.shape(x)),
    "reductions": lambda x: x - tf.reduce_mean(x, -1, keepdims=True)
    + tf.reduce_sum(x, -1, keepdims=True) / 10
    + tf.reduce_max(x, -1, keepdims=True)
    - tf.reduce_min(x, -1, keepdims=True),
    "math": lambda x: tf.math.tanh(x) + tf.square(x) * 0.1 + tf.sqrt(tf.abs(x) + 1.0)
    + tf.exp(-tf.abs(x)) + tf.nn.relu(x),
    "gather_one_hot_argmax": lambda x: x
    * tf.one_hot(tf.argmax(x, axis=-1), x.shape[-1], on_value=2.0, off_value=0.5)
    + tf.gather(x, [3, 1, 2, 0] * (x.shape[-1] // 4), axis=-1),
    "where_cond": lambda x: tf.where(x > 0, x, 0.1 * x)
    + tf.cond(tf.reduce_sum(x) > 0, lambda: x, lambda: -x),
    "casting": lambda x: x
    + tf.stop_gradient(tf.cast(tf.cast(x * 10, tf.int32), tf.float32) / 10 - x)
    + tf.cast(tf.cast(x, tf.float64) * 2, tf.float32),
}


class TensorFlowOps(keras.layers.Layer):
    def __init__(self, family, **kwargs):
        super().__init__(**kwargs)
        self.family = family

    def call(self, x):
        return OP_FAMILIES[self.family](x)


DENSE_SPLIT = {"up/kernel": (None, "model"), "up/bias": ("model",), "down/kernel": ("model", None)}


def _data(n):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 16)).astype("float32"), rng.normal(size=(n, 8)).astype("float32")


@pytest.mark.parametrize("family", sorted(OP_FAMILIES))
def test_tensorflow_op_family_matches_one_device(family):
    def build():
        inputs = keras.Input((16,))
        x = keras.layers.Dense(32, name="up")(inputs)
        x = TensorFlowOps(family)(x)
        return keras.Model(inputs, keras.layers.Dense(8, name="down")(x))

    x, y = _data(21)
    assert_parity(build, rules(DENSE_SPLIT), x, y, steps=3, batch_size=8)
