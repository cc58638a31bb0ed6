"""`keras.distribution` and KerasHub layout maps run on tfmp, with single-device numbers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import SEED, assert_parity, build_mlp, compile_mlp, mlp_data


def keras_mesh(shape, axis_names, devices=None):
    """A Keras DeviceMesh over Keras' own device names (`"cpu:0"`, ...)."""
    devices = keras.distribution.list_devices() if devices is None else devices
    return keras.distribution.DeviceMesh(shape, axis_names, devices[: int(np.prod(shape))])


def specs(variable):
    return list(variable.value.layout.sharding_specs)


# keras.distribution -> ModelParallelStrategy ----------------------------------


def test_from_keras_model_parallel_mlp_matches_single_device():
    device_mesh = keras_mesh((2, 4), ("batch", "model"))
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")

    strategy = tfmp.ModelParallelStrategy.from_keras(distribution)

    assert isinstance(strategy, tfmp.ModelParallelStrategy)
    assert strategy.mesh.shape == (2, 4)
    assert strategy.mesh.axis_names == ("batch", "model")
    assert list(strategy.mesh.devices.flatten()) == [f"/device:CPU:{i}" for i in range(8)]
    assert strategy.batch_axis == "batch"
    assert dict(strategy.layout_map) == {
        ".*up/kernel": (None, "model"),
        ".*up/bias": ("model",),
        ".*down/kernel": ("model", None),
    }
    model = assert_parity(
        build_mlp, None, *mlp_data(), strategy=strategy, compile_fn=compile_mlp,
        steps=8, loss_atol=0, batch_size=16, epochs=2,
    )
    assert specs(model.get_layer("up").kernel) == ["unsharded", "model"]
    assert specs(model.get_layer("up").bias) == ["model"]
    assert specs(model.get_layer("down").kernel) == ["model", "unsharded"]
    assert specs(model.get_layer("down").bias) == ["unsharded"]


def test_from_keras_model_parallel_batch_dim_name():
    """The batch goes over the distribution's batch dimension, whatever its name."""
    device_mesh = keras_mesh((4, 2), ("data", "model"), [f"CPU:{i}" for i in range(8)])
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*up/kernel"] = (None, "model")
    strategy = tfmp.ModelParallelStrategy.from_keras(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    )
    assert strategy.batch_axis == "data"
    assert strategy.mesh.shape == (4, 2)
    assert list(strategy.mesh.devices.flatten()) == [f"/device:CPU:{i}" for i in range(8)]


def test_from_keras_data_parallel_mlp_matches_single_device():
    distribution = keras.distribution.DataParallel(devices=keras.distribution.list_devices())

    strategy = tfmp.ModelParallelStrategy.from_keras(distribution)

    assert strategy.mesh.shape == (8,)
    assert strategy.mesh.axis_names == ("batch",)
    assert strategy.batch_axis == "batch"
    assert len(strategy.layout_map) == 0
    model = assert_parity(
        build_mlp, None, *mlp_data(), strategy=strategy, compile_fn=compile_mlp,
        steps=8, loss_atol=0, batch_size=16, epochs=2,
    )
    assert all(v.value.layout.is_fully_replicated() for v in model.variables)


def test_from_keras_data_parallel_takes_its_mesh_and_batch_axis():
    """A DataParallel over a mesh of its own: its axis splits the batch, and no
    variable is split. (Keras 3.15's DataParallel fails to warn about a 2-D
    mesh, `TypeError: category must be a Warning subclass`, so only 1-D.)"""
    distribution = keras.distribution.DataParallel(
        device_mesh=keras_mesh((8,), ("data",), [f"CPU:{i}" for i in range(8)])
    )
    strategy = tfmp.ModelParallelStrategy.from_keras(distribution)
    assert (strategy.mesh.shape, strategy.batch_axis) == ((8,), "data")
    assert list(strategy.mesh.devices) == [f"/device:CPU:{i}" for i in range(8)]
    assert len(strategy.layout_map) == 0


@pytest.mark.parametrize(
    "value",
    [
        None,
        keras.distribution.LayoutMap(None),
        "model_parallel",
    ],
    ids=["None", "LayoutMap", "str"],
)
def test_from_keras_rejects_anything_else(value):
    with pytest.raises(TypeError, match=type(value).__name__) as raised:
        tfmp.ModelParallelStrategy.from_keras(value)
    message = str(raised.value)
    assert "keras.distribution.ModelParallel" in message
    assert "keras.distribution.DataParallel" in message
    assert "ModelParallelStrategy(mesh, layout_map)" in message


def test_from_keras_rejects_a_tfmp_mesh():
    with pytest.raises(TypeError, match="DeviceMesh"):
        tfmp.ModelParallelStrategy.from_keras(tfmp.DeviceMesh((2, 4), ("batch", "model")))


@pytest.mark.parametrize(
    "embedding_axes", [("model", "batch"), None], ids=["split", "replicated"]
)
def test_embedding_under_sgd_matches_single_device(embedding_axes):
    """Keras' SGD applies an Embedding's sparse gradient with a scatter
    (`ResourceScatterSub`), which DTensor cannot lay out; tfmp applies it dense."""

    def build():
        return keras.Sequential(
            [
                keras.Input((8,), dtype="int32"),
                keras.layers.Embedding(64, 16, name="embed"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(4, name="head"),
            ],
            name="bag",
        )

    def compile_fn(model):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        return model

    layout_map = keras.distribution.LayoutMap(keras_mesh((2, 4), ("batch", "model")))
    if embedding_axes:
        layout_map[".*embed/embeddings"] = embedding_axes
    strategy = tfmp.ModelParallelStrategy.from_keras(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    rng = np.random.default_rng(SEED)
    x = rng.integers(0, 64, size=(32, 8)).astype("int32")  # repeated ids in each batch
    y = rng.normal(size=(32, 4)).astype("float32")

    model = assert_parity(
        build, None, x, y, strategy=strategy, compile_fn=compile_fn,
        steps=8, loss_atol=0, batch_size=8, epochs=2,
    )
    want = list(embedding_axes) if embedding_axes else ["unsharded", "unsharded"]
    assert specs(model.get_layer("embed").embeddings) == want


# KerasHub backbones with their own layout maps ---------------------------------


@pytest.fixture(scope="module")
def keras_hub():
    import keras_hub  # in the test extra: missing, these tests fail rather than skip

    return keras_hub


def token_data(n=32, seq_len=8, vocab=64, seed=0):
    """Tokens, a padding mask with padded rows, and next-token targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(n, seq_len + 1)).astype("int32")
    padding_mask = np.ones((n, seq_len), "int32")
    padding_mask[::3, seq_len - 2 :] = 0
    x = {"token_ids": tokens[:, :-1], "padding_mask": padding_mask}
    return x, tokens[:, 1:], padding_mask


def hub_distribution(backbone_class, device_mesh):
    """What a KerasHub user writes for JAX: the backbone's own rules in a ModelParallel."""
    layout_map = backbone_class.get_layout_map(
        device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"
    )
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def assert_layouts_are_keras_layouts(model, distribution):
    """Each variable has the layout Keras' ModelParallel gives it (re.fullmatch
    of its rules), on the distribution's mesh."""
    sharded = 0
    for variable in model.variables:
        layout = distribution.get_variable_layout(variable)
        want = ["unsharded" if axis is None else axis for axis in layout.axes]
        assert specs(variable) == want, variable.path
        sharded += any(axis is not None for axis in layout.axes)
    return sharded


def test_gemma_causal_lm_with_its_layout_map_matches_single_device(keras_hub):
    """GemmaCausalLM (tied embedding as LM head) on a 2x4 mesh with
    GemmaBackbone.get_layout_map: weights split over "model" and "batch" at once."""

    def build():
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=64,
            num_layers=1,
            num_query_heads=4,
            num_key_value_heads=4,
            hidden_dim=16,
            intermediate_dim=64,
            head_dim=4,
        )
        return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)

    def compile_fn(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01))  # KerasHub's loss and metric
        return model

    distribution = hub_distribution(
        keras_hub.models.GemmaBackbone, keras_mesh((2, 4), ("batch", "model"))
    )
    strategy = tfmp.ModelParallelStrategy.from_keras(distribution)
    x, y, padding_mask = token_data()

    model = assert_parity(
        build, None, x, y, strategy=strategy, compile_fn=compile_fn,
        steps=8, loss_atol=0, sample_weight=padding_mask, batch_size=8, epochs=2,
    )

    assert assert_layouts_are_keras_layouts(model, distribution) == 8
    by_path = {v.path: v for v in model.variables}
    assert specs(by_path["token_embedding/embeddings"]) == ["model", "batch"]
    assert specs(by_path["decoder_block_0/attention/query/kernel"]) == ["model", "batch", "unsharded"]
    assert specs(by_path["decoder_block_0/ffw_linear/kernel"]) == ["model", "batch"]
    assert strategy.layout_map.unmatched_keys() == []
    # Each device holds 1/8 of the embedding table: (64/4, 16/2).
    shards = tf.experimental.dtensor.unpack(by_path["token_embedding/embeddings"].value.read_value())
    assert [tuple(s.shape) for s in shards] == [(16, 8)] * 8


# Tiny configurations of every KerasHub backbone with get_layout_map (besides
# Gemma, above): grouped-query attention, and experts for the MoE ones.
HUB_BACKBONES = {
    "llama": ("LlamaBackbone", {}),
    "qwen": ("QwenBackbone", {}),
    "qwen_moe": (
        "QwenMoeBackbone",
        {"moe_intermediate_dim": 16, "shared_expert_intermediate_dim": 16, "num_experts": 4, "top_k": 2},
    ),
    "qwen3_moe": (
        "Qwen3MoeBackbone",
        # Every token to every expert: Qwen3's routing weights are then
        # continuous in the weights. With top_k=2 a router near-tie (sample 10
        # here) flips an expert on float noise: gradients agree to 2e-6
        # relative, yet predictions after 5 Adam steps are up to 2.3e-4 apart.
        # qwen_moe covers top_k < num_experts.
        {"moe_intermediate_dim": 16, "num_experts": 4, "top_k": 4, "head_dim": 4},
    ),
}


def build_hub_classifier(keras_hub, name):
    """A KerasHub backbone + masked mean-pool + Dense: a model its tests never saw."""
    class_name, extra = HUB_BACKBONES[name]
    backbone = getattr(keras_hub.models, class_name)(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=8,
        num_key_value_heads=4,
        hidden_dim=16,
        intermediate_dim=32,
        tie_word_embeddings=True,  # no unused reverse_embeddings: the head is ours
        **extra,
    )
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(
        backbone.output, mask=backbone.input["padding_mask"]
    )
    logits = keras.layers.Dense(4, name="classifier")(pooled)
    return keras.Model(backbone.input, logits, name=f"{name}_classifier")


def compile_classifier(model):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@pytest.mark.parametrize("name", list(HUB_BACKBONES))
def test_backbone_with_its_own_layout_map_matches_single_device(keras_hub, name):
    """The backbone's own get_layout_map through keras.distribution.ModelParallel,
    as a JAX user writes it. Llama's and Qwen's rules split the hidden dimension
    over "batch" in the embedding but over "model" in the query/key/value
    kernels; each layer reads its weights with the batch axis gathered, so
    DTensor computes with them as GSPMD does on JAX."""
    class_name = HUB_BACKBONES[name][0]
    distribution = hub_distribution(
        getattr(keras_hub.models, class_name), keras_mesh((2, 4), ("batch", "model"))
    )
    strategy = tfmp.ModelParallelStrategy.from_keras(distribution)
    x, _, padding_mask = token_data(n=20)
    labels = np.random.default_rng(SEED).integers(0, 4, size=(len(padding_mask),))

    model = assert_parity(
        lambda: build_hub_classifier(keras_hub, name),
        None,
        x,
        labels,
        strategy=strategy,
        compile_fn=compile_classifier,
        steps=5,
        loss_atol=0,
        batch_size=4,
    )

    assert assert_layouts_are_keras_layouts(model, distribution) >= 6
    # The MoE blocks hold experts where the rules expect a dense FFN.
    unmatched = strategy.layout_map.unmatched_keys()
    assert all("feedforward" in key for key in unmatched) if "moe" in name else not unmatched


def test_backbone_fully_sharded_with_auto_layout_matches_single_device(keras_hub):
    """Llama with `layout_map="auto"` and `fully_shard=True` on 2x4: every
    weight of rank 2 is split over both axes; those split over "model" for
    memory only are gathered over both as their layer reads them, one axis
    at a time."""
    strategy = tfmp.ModelParallelStrategy(
        tfmp.DeviceMesh((2, 4), ("batch", "model")), layout_map="auto", fully_shard=True
    )
    x, _, padding_mask = token_data(n=20)
    labels = np.random.default_rng(SEED).integers(0, 4, size=(len(padding_mask),))
    model = assert_parity(
        lambda: build_hub_classifier(keras_hub, "llama"), None, x, labels, strategy=strategy,
        compile_fn=compile_classifier, steps=5, loss_atol=0, batch_size=4,
    )
    matrices = [v.value for v in model.trainable_variables if len(v.shape) == 2]
    assert matrices and all({"batch", "model"} <= set(v.layout.sharding_specs) for v in matrices)
    gathered_twice = [v for v in matrices if v.gathered_axes == ("batch", "model")]
    assert gathered_twice and all(v.compute_layout.is_fully_replicated() for v in gathered_twice)
