"""tfmp.layers: declared layouts, Keras behaviour off the mesh, errors, saving."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import assert_parity, build_layers_lm, initial_weights, lm_data, mesh, rules

SHARDED = tfmp.layers


def test_declared_layouts_on_2x4():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)))
    with strategy.scope():
        model = build_layers_lm()
    specs = {v.path: v.value.layout.sharding_specs for v in model.variables}
    assert specs["embed/embeddings"] == ["model", "unsharded"]
    assert specs["attention/query/kernel"] == ["unsharded", "model", "unsharded"]
    assert specs["attention/value/bias"] == ["model", "unsharded"]
    assert specs["attention/attention_output/kernel"] == ["model", "unsharded", "unsharded"]
    assert specs["attention/attention_output/bias"] == ["unsharded"]
    assert specs["ffn_in/kernel"] == ["unsharded", "model"]
    assert specs["ffn_in/bias"] == ["model"]
    assert specs["ffn_out/kernel"] == ["model", "unsharded"]
    assert specs["ffn_out/bias"] == ["unsharded"]
    head = [p for p in specs if p.endswith("head/kernel")]
    assert head and specs[head[0]] == ["unsharded", "model"]
    shards = dtensor.unpack(model.get_layer("ffn_in").kernel.value.read_value())
    assert {tuple(s.shape) for s in shards} == {(32, 16)}


def test_off_the_mesh_they_are_their_keras_counterparts():
    keras.utils.set_random_seed(0)
    pairs = [
        (SHARDED.ColumnParallelDense(6, activation="relu"), keras.layers.Dense(6, activation="relu")),
        (SHARDED.RowParallelDense(6), keras.layers.Dense(6)),
        (SHARDED.Sharded(keras.layers.Dense(6), {"kernel": (None, True)}), keras.layers.Dense(6)),
    ]
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    for parallel, plain in pairs:
        parallel.build((None, 4))
        plain.build((None, 4))
        plain.set_weights(parallel.get_weights())
        np.testing.assert_allclose(parallel(x).numpy(), plain(x).numpy(), rtol=1e-6)
    tokens = np.array([[1, 5, 63]])
    embed = SHARDED.VocabParallelEmbedding(64, 4)
    plain_embed = keras.layers.Embedding(64, 4)
    embed.build((None, 3))
    plain_embed.build((None, 3))
    plain_embed.set_weights(embed.get_weights())
    np.testing.assert_array_equal(embed(tokens).numpy(), plain_embed(tokens).numpy())


def test_mesh_without_the_axis_replicates():
    strategy = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((8,), ("batch",)))
    with strategy.scope():
        layer = SHARDED.ColumnParallelDense(16)
        layer.build((None, 4))
    assert layer.kernel.value.layout.is_fully_replicated()


def test_layout_map_rule_that_disagrees_is_an_error():
    device_mesh = mesh((2, 4))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["ffn_in/kernel"] = ("model", None)
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map)
    with pytest.raises(ValueError, match=r"layer 'ffn_in' declares the layout \(None, 'model'\) but LayoutMap rule 'ffn_in/kernel' gives \('model', None\)"):
        with strategy.scope():
            build_layers_lm()


def test_sharded_errors():
    built = keras.layers.Dense(3)
    built.build((None, 2))
    with pytest.raises(ValueError, match="already built"):
        SHARDED.Sharded(built, {"kernel": (None, True)})
    with pytest.raises(TypeError, match=r"layouts\['bias'\] = 'model'"):
        SHARDED.Sharded(keras.layers.Dense(3), {"bias": "model"})
    wrong = SHARDED.Sharded(keras.layers.Dense(3), {"kernal": (None, True)})
    with pytest.raises(ValueError, match=r"'kernal'.*its weights are"):
        wrong.build((None, 2))


def test_saved_model_with_layers_reloads_with_layouts(tmp_path):
    device_mesh = mesh((1, 8))
    weights = initial_weights(build_layers_lm)
    with tfmp.ModelParallelStrategy(device_mesh).scope():
        model = build_layers_lm()
        model.set_weights(weights)
    path = str(tmp_path / "layers.keras")
    model.save(path)
    with tfmp.ModelParallelStrategy(mesh((2, 4))).scope():
        loaded = keras.models.load_model(path)
    assert loaded.get_layer("ffn_out").kernel.value.layout.sharding_specs == ["model", "unsharded"]
    head = loaded.layers[-1].layer.kernel.value
    assert head.layout.sharding_specs == ["unsharded", "model"]
    for want, got in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(got, want)
    x, _ = lm_data(8)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_shards_on_each_device_match_the_summary():
    from tfmp.inspect.summary import placements

    with tfmp.ModelParallelStrategy(mesh((2, 4))).scope():
        model = build_layers_lm()
    rows = {row.path: row for row in placements(model)}
    for variable in model.variables:
        shards = dtensor.unpack(variable.value.read_value())
        assert {tuple(s.shape) for s in shards} == {rows[variable.path].shard_shape}


def test_vocab_parallel_embedding_keeps_lora_and_keras_ids():
    def build():
        tokens = keras.Input((6,), dtype="int32")
        embed = SHARDED.VocabParallelEmbedding(64, 8, name="embed")
        pooled = keras.layers.GlobalAveragePooling1D()(embed(tokens))
        model = keras.Model(tokens, keras.layers.Dense(4, name="head")(pooled))
        embed.enable_lora(2)
        return model

    rng = np.random.default_rng(0)
    # A negative id counts from the end of the vocabulary, as in Keras.
    tokens = rng.integers(-64, 64, size=(48, 6)).astype("int32")
    targets = rng.normal(size=(48, 4)).astype("float32")
    model = assert_parity(build, rules({}), tokens, targets)
    embed = model.get_layer("embed")
    assert embed.lora_embeddings_a.value.layout.sharding_specs == ["model", "unsharded"]
    assert not embed._embeddings.trainable
    past_the_vocabulary = np.full((8, 6), 64, dtype="int32")
    # The device whose gather fails cancels the others; which error DTensor
    # reports first is a race.
    with pytest.raises((tf.errors.InvalidArgumentError, tf.errors.CancelledError)):
        model.predict(past_the_vocabulary, verbose=0)
    # fit without a progress bar reads no step's outputs: tfmp reads them, so
    # the failed steps raise instead of being skipped (loss 0.0, weights kept).
    with pytest.raises((tf.errors.InvalidArgumentError, tf.errors.CancelledError)):
        model.fit(past_the_vocabulary, targets[:8], batch_size=8, verbose=0)
