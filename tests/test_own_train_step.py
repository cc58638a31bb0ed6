"""Models with their own `train_step`, as Keras' examples write them, train on
a mesh with one device's numbers.

The VAE is Keras' "Variational AutoEncoder" example (an encoder and a decoder
functional model, a `Sampling` layer drawing with `keras.random.normal`, a
`train_step` with `tf.GradientTape` and loss trackers, no `call`); the GAN is
its "DCGAN: overriding train_step" example (generator and discriminator, an
overridden `compile(d_optimizer, g_optimizer, loss_fn)`, no `call`), in the
TensorFlow spelling written before Keras 3: `tf.random.normal` latent vectors
and `tf.random.uniform` label noise, seeded (`keras.utils.set_random_seed`
sets TensorFlow's global seed), so one device's draws are fixed and the
mesh's must equal them. Tiny sizes; 37 samples at batch 8 on 2x4, so the
last batch (5 rows) does not divide the batch axis. Each program changes
only by the two lines: mesh + strategy, model built and compiled in its scope.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import tfmp
from helpers import SEED, mesh

LATENT = 2
EPOCHS = 2
BATCH = 8
IMAGES = np.random.default_rng(0).uniform(size=(37, 8, 8, 1)).astype("float32")


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def build_vae():
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Flatten()(encoder_inputs)
    x = layers.Dense(16, activation="relu", name="enc_hidden")(x)
    z_mean = layers.Dense(LATENT, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(LATENT,))
    x = layers.Dense(16, activation="relu", name="dec_hidden")(latent_inputs)
    x = layers.Dense(64, activation="sigmoid", name="dec_out")(x)
    decoder_outputs = layers.Reshape((8, 8, 1))(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    return VAE(encoder, decoder, name="vae")


def compile_vae(vae):
    vae.compile(optimizer=keras.optimizers.Adam(0.01))


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        # Sample random points in the latent space
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim), seed=1)
        # Decode them to fake images and combine them with real images
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        # Add random noise to the labels - important trick!
        labels += 0.05 * tf.random.uniform(tf.shape(labels), seed=2)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim), seed=1)
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def build_gan():
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            layers.Flatten(),
            layers.Dense(16, name="d_hidden"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Dense(1, name="d_out"),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(4,)),
            layers.Dense(16, name="g_hidden"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Dense(64, activation="sigmoid", name="g_out"),
            layers.Reshape((8, 8, 1)),
        ],
        name="generator",
    )
    return GAN(discriminator, generator, latent_dim=4)


def compile_gan(gan):
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.001),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.001),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )


PROGRAMS = {"vae": (build_vae, compile_vae), "gan": (build_gan, compile_gan)}

# Megatron pairs written by hand: each block's first Dense column-parallel, its
# second row-parallel.
RULES = {
    "vae": {
        "enc_hidden/kernel": (None, "model"),
        "enc_hidden/bias": ("model",),
        "z_mean/kernel": ("model", None),
        "z_log_var/kernel": ("model", None),
        "dec_hidden/kernel": (None, "model"),
        "dec_hidden/bias": ("model",),
        "dec_out/kernel": ("model", None),
    },
    "gan": {
        "d_hidden/kernel": (None, "model"),
        "d_hidden/bias": ("model",),
        "d_out/kernel": ("model", None),
        "g_hidden/kernel": (None, "model"),
        "g_hidden/bias": ("model",),
        "g_out/kernel": ("model", None),
    },
}


def _fit(model):
    history = model.fit(IMAGES, epochs=EPOCHS, batch_size=BATCH, shuffle=False, verbose=0)
    return history.history, model.get_weights()


@pytest.fixture(scope="module")
def one_device():
    """Each program trained on one device: its initial weights, then its
    History and final weights."""
    runs = {}
    for name, (build, compile_fn) in PROGRAMS.items():
        keras.utils.set_random_seed(SEED)
        model = build()
        weights = model.get_weights()
        compile_fn(model)
        runs[name] = (weights, *_fit(model))
    return runs


def _on_mesh(name, layout_map, weights, compile_in_scope=True):
    build, compile_fn = PROGRAMS[name]
    device_mesh = mesh((2, 4))
    if layout_map != "auto":
        rules, layout_map = layout_map, tfmp.LayoutMap(device_mesh)
        for key, axes in rules.items():
            layout_map[key] = axes
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map=layout_map)
    with strategy.scope():
        keras.utils.set_random_seed(SEED)  # the same seeds for the same draws
        model = build()
        model.set_weights(weights)
        if compile_in_scope:
            compile_fn(model)
    if not compile_in_scope:
        compile_fn(model)
    return model


def _assert_one_devices_numbers(model, one_device_run):
    _, want_history, want_weights = one_device_run
    history, weights = _fit(model)
    assert history.keys() == want_history.keys()
    for key, values in want_history.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    for variable, want, got in zip(model.weights, want_weights, weights, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=variable.path)

def _split_weights(model):
    return [v.path for v in model.weights if "model" in v.value.layout.sharding_specs]


@pytest.mark.parametrize("layouts", ["auto", "rules"])
@pytest.mark.parametrize("name", ["vae", "gan"])
def test_own_train_step_matches_one_device(name, layouts, one_device):
    """Planned from the sub-models' variables ("auto"; Keras on JAX lays a
    subclassed model out from them too), or from rules; Keras' symbolic build,
    which calls the missing `call()`, is skipped as without a strategy."""
    layout_map = "auto" if layouts == "auto" else RULES[name]
    model = _on_mesh(name, layout_map, one_device[name][0])
    _assert_one_devices_numbers(model, one_device[name])
    for sub_model in model.layers:  # each sub-model planned (or ruled) apart
        assert _split_weights(sub_model), f"nothing of {sub_model.name!r} split over 'model'"


def test_gan_compiled_outside_the_scope_adopts_both_optimizers(one_device):
    """`compile` keeps the two optimizers as attributes; made outside the
    strategy's scope, both move onto the mesh at the first fit."""
    model = _on_mesh("gan", "auto", one_device["gan"][0], compile_in_scope=False)
    _assert_one_devices_numbers(model, one_device["gan"])
    assert _split_weights(model)
    for optimizer in (model.d_optimizer, model.g_optimizer):
        assert optimizer.iterations.numpy() == EPOCHS * 5


class ScaledVAE(VAE):
    """A VAE whose `build` makes a weight of its own: unbuilt, its weights
    do not all exist yet."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")


def test_auto_layout_plans_built_sub_models_and_refuses_a_model_with_its_own_build():
    device_mesh = mesh((2, 4))
    vae = build_vae()
    plan = tfmp.auto_layout(vae, device_mesh)
    split = {v.path for v in vae.weights if plan.match(v.path) is not None}
    assert vae.encoder.get_layer("enc_hidden").kernel.path in split
    assert vae.decoder.get_layer("dec_out").kernel.path in split
    unbuilt = ScaledVAE(vae.encoder, vae.decoder, name="scaled_vae")
    with pytest.raises(ValueError, match="auto_layout needs a built model; 'scaled_vae'"):
        tfmp.auto_layout(unbuilt, device_mesh)
