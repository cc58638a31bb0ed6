"""TensorFlow ops that user code calls directly (layers and train_steps
written before Keras 3) run on a mesh with one device's numbers.

Random ops: TensorFlow's stateful kernels (`tf.random.normal`, `uniform`,
`truncated_normal`, `gamma`, `tf.keras.backend.random_normal`) draw bitwise
one device's numbers on the mesh, step after step, once the global seed is
set (with or without an op seed), and so do the stateless draws
(`tf.random.stateless_*`). Unseeded ones, `tf.random.shuffle`,
`tf.random.categorical` and `tf.random.poisson` cannot equal one device's
(one device seeds an unseeded kernel at random; no stateless op reproduces
the shuffle, multinomial and Poisson kernels): those are checked in
distribution, and whole on every device (every shard of the replicated draw
equal), since a draw that differed between devices would train silently
wrong. A `tf.random.Generator` draws MirroredStrategy's numbers.

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
        "gamma": tf.random.gamma(shape, alpha=[0.5, 2.0], beta=[1.0, 3.0], seed=7),
        **_stateless_draws(),
    }


def _stateless_draws():
    """TensorFlow's stateless draws: the ops DTensor has no layout rule for
    run replicated (`tfmp._env.REPLICATED_OPS`); the others have rules."""
    seed = tf.constant([1, 2])
    return {
        "stateless_normal": tf.random.stateless_normal([5, 3], seed),
        "stateless_uniform_int": tf.random.stateless_uniform(
            [6], seed, minval=0, maxval=10, dtype=tf.int32
        ),
        "stateless_truncated": tf.random.stateless_truncated_normal([4, 2], seed),
        "stateless_categorical": tf.random.stateless_categorical(
            tf.math.log([[0.2, 0.3, 0.5]]), 8, seed
        ),
        "stateless_gamma": tf.random.stateless_gamma([4, 2], seed, alpha=[0.5, 2.0]),
        "stateless_poisson": tf.random.stateless_poisson([5], seed, lam=3.0),
        "stateless_binomial": tf.random.stateless_binomial([5], seed, counts=10.0, probs=0.3),
        "stateless_parameterized_truncated": tf.random.stateless_parameterized_truncated_normal(
            [5], seed, means=0.0, stddevs=2.0, minvals=-1.0, maxvals=1.0
        ),
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
    assert not np.array_equal(want[0]["gamma"], want[1]["gamma"])


def _distribution_draws(generator):
    logits = tf.math.log([[0.2, 0.3, 0.5]])
    return {
        "normal": tf.random.normal([20000]),
        "shuffled": tf.random.shuffle(tf.range(64)),
        "categorical": tf.random.categorical(logits, 20000),
        "poisson": tf.random.poisson([20000], lam=3.0),
        "generator_normal": generator.normal([20000]),
        "generator_binomial": generator.binomial([20000], counts=10.0, probs=0.3),
    }


def _within_4_standard_errors(draws, mean, variance):
    assert abs(draws.mean() - mean) < 4 * np.sqrt(variance / draws.size)


def test_unseeded_shuffled_categorical_and_poisson_draws_match_in_distribution(strategy):
    """No equality to one device is possible here (see the module docstring;
    TensorFlow's Poisson kernel starts again in each traced function):
    moments, a permutation, class frequencies within 4 standard errors, and
    the same numbers on every device."""
    tf.random.set_seed(None)  # no seed anywhere: one device seeds at random
    with strategy.scope():
        generator = tf.random.Generator.from_non_deterministic_state()
    step = tf.function(lambda: strategy.run(lambda: _distribution_draws(generator)))
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
    _within_4_standard_errors(first["poisson"].numpy(), 3.0, 3.0)
    assert not np.array_equal(first["poisson"].numpy(), second["poisson"].numpy())
    _within_4_standard_errors(first["generator_normal"].numpy(), 0.0, 1.0)
    _within_4_standard_errors(first["generator_binomial"].numpy(), 3.0, 10 * 0.3 * 0.7)
    assert not np.array_equal(
        first["generator_normal"].numpy(), second["generator_normal"].numpy()
    )


def _generator_draws(generator):
    return {
        "normal": generator.normal([5, 3]),
        "uniform_int": generator.uniform([6], maxval=9, dtype=tf.int32),
        "binomial": generator.binomial([4], counts=10.0, probs=0.3),
    }


def test_a_generator_draws_what_it_draws_under_mirrored_strategy(strategy):
    """Under any tf.distribute strategy TensorFlow folds the replica's id
    into a `tf.random.Generator`'s key, so its numbers are not the ones it
    draws outside a strategy; on the mesh they are those of
    MirroredStrategy's (one replica, id 0), step after step."""
    mirrored = tf.distribute.MirroredStrategy(["CPU:0"])
    with mirrored.scope():
        reference = tf.random.Generator.from_seed(5)
    with strategy.scope():
        generator = tf.random.Generator.from_seed(5)
    want = _three_steps(tf.function(lambda: mirrored.run(lambda: _generator_draws(reference))))
    got = _three_steps(tf.function(lambda: strategy.run(lambda: _generator_draws(generator))))
    for want_step, got_step in zip(want, got):
        for key in want_step:
            np.testing.assert_array_equal(got_step[key], want_step[key], err_msg=key)
    assert not np.array_equal(want[0]["normal"], want[1]["normal"])


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


# Noise drawn in a layer's call, shaped like its input `x` (split over batch
# and "model"), with TensorFlow's random ops: draws that equal one device's,
# and draws that match it only in distribution.
EQUAL_DRAWS = {
    "gamma": lambda layer, x: tf.random.gamma(tf.shape(x), alpha=2.0, seed=7),
    "stateless_gamma": lambda layer, x: tf.random.stateless_gamma(tf.shape(x), [1, 2], alpha=2.0),
    "stateless_poisson": lambda layer, x: tf.random.stateless_poisson(tf.shape(x), [3, 4], lam=2.0),
    "stateless_binomial": lambda layer, x: tf.random.stateless_binomial(
        tf.shape(x), [5, 6], counts=4.0, probs=0.5
    ),
    "stateless_categorical": lambda layer, x: tf.random.stateless_categorical(x, 32, [7, 8]),
    "stateless_truncated": lambda layer, x: tf.random.stateless_parameterized_truncated_normal(
        tf.shape(x), [9, 10], means=0.0, stddevs=1.0, minvals=-1.0, maxvals=1.0
    ),
}
DISTRIBUTION_DRAWS = {
    "poisson": lambda layer, x: tf.random.poisson(tf.shape(x), lam=2.0, seed=8),
    "generator_normal": lambda layer, x: layer.generator.normal(tf.shape(x)),
    "generator_binomial": lambda layer, x: layer.generator.binomial(
        tf.shape(x), counts=4.0, probs=0.5
    ),
}


class DrawingDense(keras.layers.Layer):
    """A pre-Keras-3 layer: a Dense, then noise from each of `draws`."""

    def __init__(self, draws, **kwargs):
        super().__init__(**kwargs)
        self.draws = draws
        self.dense = keras.layers.Dense(32, name="up")
        self.generator = tf.random.Generator.from_seed(5)

    def call(self, x, training=False):
        x = self.dense(x)
        if training:
            for draw in self.draws.values():
                x = x + 0.01 * tf.cast(draw(self, x), x.dtype)
        return x


def _drawing_model(draws):
    def build():
        inputs = keras.Input((16,))
        hidden = DrawingDense(draws, name="noisy")(inputs)
        return keras.Model(inputs, keras.layers.Dense(8, name="down")(hidden))

    return build


def test_a_layer_drawing_gamma_and_stateless_draws_trains_like_one_device():
    x, y = _data(37)  # the last batch, of 5 rows, divides no mesh axis
    tf.random.set_seed(11)
    assert_parity(_drawing_model(EQUAL_DRAWS), rules(DENSE_SPLIT), x, y, steps=5, batch_size=8)


def test_a_layer_drawing_poisson_and_a_generator_trains_alike_on_every_device():
    """These match one device in distribution only; each device draws the same
    numbers, so the replicated weights stay equal on every device."""
    x, y = _data(37)
    tf.random.set_seed(11)
    with tfmp.ModelParallelStrategy(mesh((2, 4)), rules(DENSE_SPLIT)(mesh((2, 4)))).scope():
        model = _drawing_model(DISTRIBUTION_DRAWS)()
        model.compile(optimizer="adam", loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][1] < history.history["loss"][0]
    replicated = {
        "down/bias": model.get_layer("down").bias.value,
        "generator state": model.get_layer("noisy").generator.state,
    }
    for name, variable in replicated.items():
        copies = [copy.numpy() for copy in dtensor.unpack(variable.read_value())]
        assert len(copies) == 8
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=name)
