"""tfmp.auto_layout plans Megatron layouts, and training with them is exact."""

import keras
import numpy as np
import pytest

import tfmp
from helpers import assert_parity, assert_weights_close, initial_weights, lm_data, mesh, train
from tfmp.demo import build_transformer_lm, megatron_layout_map


def layouts_of(model):
    return {v.path: v.value.layout.sharding_specs for v in model.variables}


def test_transformer_block_gets_the_megatron_layout():
    device_mesh = mesh((2, 4))
    planned = tfmp.auto_layout(build_transformer_lm(), device_mesh)
    by_hand = megatron_layout_map(device_mesh)
    with tfmp.ModelParallelStrategy(device_mesh, planned).scope():
        auto = build_transformer_lm()
    with tfmp.ModelParallelStrategy(device_mesh, by_hand).scope():
        manual = build_transformer_lm()
    assert layouts_of(auto) == layouts_of(manual)
    assert "ffn_out/bias" in planned.reasons and "attention_norm/gamma" in planned.reasons


def build_cnn():
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(8, 3, activation="relu", name="conv"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(32, activation="relu", name="fc1"),
            keras.layers.Dropout(0.0),
            keras.layers.Dense(16, name="fc2"),
            keras.layers.Dense(10, name="classifier"),
        ],
        name="cnn",
    )


def test_cnn_plan_is_sensible():
    """The convolution splits its filters; the Dense after the pooling takes
    them as row-parallel inputs; the next pair is column, row."""
    planned = tfmp.auto_layout(build_cnn(), mesh((1, 8)))
    assert dict(planned.items()) == {
        "^cnn/conv/kernel$": (None, None, None, "model"),
        "^cnn/conv/bias$": ("model",),
        "^cnn/fc1/kernel$": ("model", None),
        "^cnn/fc2/kernel$": (None, "model"),
        "^cnn/fc2/bias$": ("model",),
        "^cnn/classifier/kernel$": ("model", None),
    }
    assert "row-parallel" in planned.reasons["cnn/fc1/bias"]


def test_indivisible_dimensions_stay_whole_with_a_reason():
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(12, name="a"), keras.layers.Dense(5, name="b")],
        name="odd",
    )
    with pytest.warns(UserWarning, match=r"auto_layout left \['odd/b/kernel'\] replicated"):
        planned = tfmp.auto_layout(model, mesh((1, 8)))
    assert len(planned) == 0
    assert "does not divide" in planned.reasons["odd/b/kernel"]
    assert "partner could not be split" in planned.reasons["odd/a/kernel"]


def test_unbuilt_model_is_an_error():
    with pytest.raises(ValueError, match="needs a built model"):
        tfmp.auto_layout(keras.Sequential([keras.layers.Dense(4)]), mesh((1, 8)))


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
@pytest.mark.parametrize("name", ["transformer", "cnn"])
def test_auto_layout_parity(name, shape):
    build = build_transformer_lm if name == "transformer" else build_cnn
    weights = initial_weights(build)
    if name == "transformer":
        x, y = lm_data(64)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 8, 8, 3)).astype("float32")
        y = rng.integers(0, 10, size=(64,))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compiled(model):
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
        return model

    reference = compiled(build())
    device_mesh = mesh(shape)
    strategy = tfmp.ModelParallelStrategy(device_mesh, tfmp.auto_layout(reference, device_mesh))
    with strategy.scope():
        model = compiled(keras.Model.from_config(reference.get_config()) if name == "transformer" else build())
    assert any(not v.value.layout.is_fully_replicated() for v in model.variables)
    ref_losses, _ = train(reference, x, y)
    losses, _ = train(model, x, y)
    assert len(losses) == 4
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_weights_close(reference.get_weights(), model.get_weights())


def test_strategy_with_auto_layout_map_matches_single_device():
    weights = initial_weights(build_transformer_lm)
    x, y = lm_data(64)

    def compiled(model):
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    reference = compiled(build_transformer_lm())
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map="auto")
    with strategy.scope():
        model = compiled(build_transformer_lm())
    assert all(v.value.layout.is_fully_replicated() for v in model.variables)
    ref_losses, _ = train(reference, x, y)
    losses, _ = train(model, x, y)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_weights_close(reference.get_weights(), model.get_weights())
    with tfmp.ModelParallelStrategy(device_mesh, megatron_layout_map(device_mesh)).scope():
        by_hand = build_transformer_lm()
    assert layouts_of(model) == layouts_of(by_hand)
    kernel = model.get_layer("ffn_in").kernel
    slots = [v for v in model.optimizer.variables if v.shape == kernel.shape]
    assert slots and all(
        s.value.layout.sharding_specs == ["unsharded", "model"] for s in slots
    )


def test_auto_needs_a_model_axis():
    with pytest.raises(ValueError, match="layout_map='auto' splits over mesh axis 'model' is not an axis"):
        tfmp.ModelParallelStrategy(tfmp.DeviceMesh((8,), ("batch",)), layout_map="auto")


def test_rules_match_only_their_own_variable():
    tokens = keras.Input((4,))
    x = keras.layers.Dense(16, name="proj")(tokens)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Dense(8, name="out_proj")(x)
    planned = tfmp.auto_layout(keras.Model(tokens, x), mesh((1, 8)))
    assert planned["proj/kernel"] is None  # unpaired: no Dense follows it directly
    assert planned["out_proj/kernel"] is None
    assert len(planned) == 0


def test_auto_strategy_needs_a_built_model():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)), layout_map="auto")
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"layout_map='auto'.*keras.Input"):
        model.fit(np.zeros((8, 4)), np.zeros((8, 4)), verbose=0)


# KerasHub backbones the plan never saw: it opens their blocks -----------------

HUB_SIZES = dict(vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32)
HUB_AUTO = {
    # GPT-2 keeps its default dropout (0.1): random draws equal one device's.
    "GPT2Backbone": dict(HUB_SIZES, num_heads=4, max_sequence_length=16),
    "MistralBackbone": dict(HUB_SIZES, num_query_heads=8, num_key_value_heads=4),
    "Qwen3Backbone": dict(HUB_SIZES, num_query_heads=8, num_key_value_heads=4, head_dim=4),
}


@pytest.mark.parametrize("name", list(HUB_AUTO))
def test_keras_hub_backbone_with_auto_layout_matches_single_device(name):
    import keras_hub

    from test_keras_interop import token_data

    def build():
        backbone = getattr(keras_hub.models, name)(**HUB_AUTO[name])
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone.output)
        return keras.Model(backbone.input, keras.layers.Dense(4, name="classifier")(pooled))

    model = build()
    planned = tfmp.auto_layout(model, mesh((2, 4)))
    sizes = {v.path: int(np.prod(v.shape)) for v in model.weights}
    split = sum(size for path, size in sizes.items() if planned.match(path))
    assert split / sum(sizes.values()) > 0.85  # all but norms and row biases

    x, _, _ = token_data(n=12)
    y = np.random.default_rng(0).normal(size=(12, 4)).astype("float32")
    assert_parity(build, lambda device_mesh: "auto", x, y)
