"""tfmp.auto_layout plans Megatron layouts, and training with them is exact."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import assert_parity, assert_weights_close, initial_weights, lm_data, mesh, train
from tfmp.demo import build_transformer_lm, megatron_layout_map
from tfmp.strategy.placement import to_layout


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
    # Unpaired (a norm between them): split for memory only, each on its largest dimension.
    assert planned["proj/kernel"] == tfmp.gather_on_use((None, "model"))
    assert planned["out_proj/kernel"] == tfmp.gather_on_use(("model", None))
    assert isinstance(planned["out_proj/kernel"], tfmp.layout.GatheredOnUse)
    assert "gathered on use" in planned.reasons["proj/kernel"]
    assert len(planned) == 2
    assert len(tfmp.auto_layout(keras.Model(tokens, x), mesh((1, 8)), storage_split=False)) == 0


def test_auto_strategy_needs_a_built_model():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)), layout_map="auto")
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"layout_map='auto'.*keras.Input"):
        model.fit(np.zeros((8, 4)), np.zeros((8, 4)), verbose=0)


class Resampler(keras.layers.Layer):
    """Two 1x1 convolutions with a resize between them in `call`, where the
    plan does not see it (DepthAnything's head)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.reduce = keras.layers.Conv2D(4, 1, name="reduce")
        self.mix = keras.layers.Conv2D(8, 1, name="mix")

    def call(self, x):
        return self.mix(keras.ops.image.resize(self.reduce(x), (4, 4)))


class Branches(keras.layers.Layer):
    """One convolution per level, kept in a list (an FPN's levels): made one
    after the other, but not one after the other in the data."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.convs = [keras.layers.Conv2D(8, 1, name=f"level_{i}") for i in range(2)]

    def call(self, x):
        return [conv(x) for conv in self.convs]


def test_convolution_pairs_keep_per_channel_layers_and_avoid_pooling():
    """A batch norm or a depthwise convolution between a column and its row
    splits with them; a pooling, or a block that resizes, ends a pair, and a
    separable convolution reading a pooling stays whole (DTensor pools and
    resizes a batch split only); layers a block keeps in a list do not pair."""
    planned = tfmp.auto_layout(build_convs(), mesh((2, 4)))
    split_for_compute = {
        key: axes for key, axes in planned.items()
        if not isinstance(axes, tfmp.layout.GatheredOnUse)
    }
    assert split_for_compute == {
        "^expand/kernel$": (None, None, None, "model"),
        **{f"^norm/{v}$": ("model",) for v in ("gamma", "beta", "moving_mean", "moving_variance")},
        "^depthwise/kernel$": (None, None, "model", None),
        "^depthwise/bias$": ("model",),
        "^project/kernel$": (None, None, "model", None),
    }
    assert "reads a pooling's output" in planned.reasons["separable/depthwise_kernel"]
    assert "pools or resizes" in planned.reasons["resampler/reduce/kernel"]
    assert "one of a list" in planned.reasons["branches/level_1/kernel"]
    # The others: stored split, gathered on use.
    assert planned["stem/kernel"] == tfmp.gather_on_use((None, None, None, "model"))
    assert planned["branches/level_1/kernel"] == tfmp.gather_on_use((None, None, "model", None))
    assert "gathered on use" in planned.reasons["resampler/reduce/kernel"]


def build_convs():
    layers = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
    x = layers.MaxPooling2D(name="pool")(x)
    # No biases before the batch norm: their gradient is 0 in theory, float
    # noise that Adam turns into steps of the learning rate.
    x = layers.SeparableConv2D(8, 3, padding="same", use_bias=False, name="separable")(x)
    x = layers.Conv2D(8, 1, use_bias=False, name="expand")(x)
    x = layers.BatchNormalization(name="norm")(x)
    x = layers.DepthwiseConv2D(3, padding="same", name="depthwise")(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(8, 1, name="project")(x)
    x = Resampler(name="resampler")(x)
    outputs = Branches(name="branches")(x)
    return keras.Model(inputs, outputs, name="convs")


def test_weights_split_for_memory_only_train_like_one_device():
    """Every kernel of `build_convs` is split: for compute where it pairs,
    else stored split and gathered on use; training matches one device, and
    every kernel and its Adam slots are split over "model"."""

    def build():
        convs = build_convs()
        pooled = [keras.layers.GlobalAveragePooling2D()(level) for level in convs.outputs]
        head = keras.layers.Dense(4, name="head")(keras.layers.Concatenate()(pooled))
        return keras.Model(convs.input, head)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(12, 4)).astype("float32")
    model = assert_parity(build, lambda device_mesh: "auto", x, y)
    kernels = [v for v in model.trainable_variables if len(v.shape) >= 2]
    slots = [v for v in model.optimizer.variables if len(v.shape) >= 2]
    assert len(slots) == 2 * len(kernels) == 2 * 11
    for variable in kernels + slots:
        assert "model" in variable.value.layout.sharding_specs, variable.path
    stem = model.get_layer("stem").kernel.value
    assert stem.layout.sharding_specs[-1] == "model"
    assert stem.compute_layout.is_fully_replicated()


def build_channelwise_cnn():
    """An inverted residual: expand, batch norm, depthwise, project."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            # No bias before a batch norm: its gradient is 0 up to float noise,
            # which Adam turns into steps of the learning rate.
            layers.Conv2D(8, 3, padding="same", use_bias=False, name="expand"),
            layers.BatchNormalization(name="norm"),
            layers.ReLU(),
            layers.DepthwiseConv2D(3, padding="same", name="depthwise"),
            layers.Conv2D(8, 1, name="project"),
            layers.GlobalAveragePooling2D(),
            layers.Dense(4, name="head"),
        ],
        name="channelwise_cnn",
    )


def test_per_channel_layers_split_with_their_pair_train_like_one_device():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(24, 4)).astype("float32")
    model = assert_parity(build_channelwise_cnn, lambda device_mesh: "auto", x, y)
    layouts = layouts_of(model)
    assert layouts["channelwise_cnn/norm/moving_mean"] == ["model"]
    depthwise = layouts["channelwise_cnn/depthwise/kernel"]
    assert depthwise == ["unsharded", "unsharded", "model", "unsharded"]


class DenseAttention(keras.layers.Layer):
    """Grouped-query attention of plain Dense layers (Gemma 3n, SmolLM)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query = keras.layers.Dense(16, name="query")
        self.key = keras.layers.Dense(8, name="key")
        self.value = keras.layers.Dense(8, name="value")
        self.output_dense = keras.layers.Dense(16, name="output")

    def call(self, x):
        query, key, value = self.query(x), self.key(x), self.value(x)
        scores = keras.ops.softmax(keras.ops.einsum("bqd,bkd->bqk", query[..., :8], key))
        values = keras.ops.einsum("bqk,bkd->bqd", scores, value)
        return self.output_dense(keras.ops.concatenate([values, values], axis=-1))


def test_plain_dense_attention_splits_query_key_value_by_columns_and_output_by_rows():
    """A query as wide as its input could feed the key or share its input:
    in a block the plan reads query, key, value as columns and the last,
    the output, as their row. In a functional model the graph decides:
    two projections of one input are no pair."""
    inputs = keras.Input((4, 16))
    towers = [keras.layers.Dense(16, name=f"tower_{i}")(inputs) for i in range(2)]
    outputs = DenseAttention(name="attention")(keras.layers.Add()(towers))
    planned = tfmp.auto_layout(keras.Model(inputs, outputs), mesh((1, 4)), storage_split=False)
    column, row = (None, "model"), ("model", None)
    assert {key: axes for key, axes in planned.items() if key.endswith("kernel$")} == {
        "^attention/query/kernel$": column,
        "^attention/key/kernel$": column,
        "^attention/value/kernel$": column,
        "^attention/output/kernel$": row,
    }


class MergedHeadsAttention(keras.layers.Layer):
    """Attention whose output projection is a Dense over the heads merged
    (Falcon, Bloom): it reads whole heads of the query and value."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query = keras.layers.EinsumDense("abc,cde->abde", (None, 4, 4), name="query")
        self.value = keras.layers.EinsumDense("abc,cde->abde", (None, 4, 4), name="value")
        self.output_dense = keras.layers.Dense(16, name="output")

    def call(self, x):
        query, value = self.query(x), self.value(x)
        scores = keras.ops.softmax(keras.ops.einsum("bqhd,bkhd->bhqk", query, query))
        heads = keras.ops.einsum("bhqk,bkhd->bqhd", scores, value)
        return self.output_dense(keras.ops.reshape(heads, (-1, x.shape[1], 16)))


def build_merged_heads_model():
    inputs = keras.Input((4, 16))
    x = MergedHeadsAttention(name="attention")(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x), name="merged_heads")


def test_dense_over_merged_heads_is_row_parallel_and_trains_like_one_device():
    planned = tfmp.auto_layout(build_merged_heads_model(), mesh((2, 4)), storage_split=False)
    assert {key: axes for key, axes in planned.items() if key.endswith("kernel$")} == {
        "^attention/query/kernel$": (None, "model", None),
        "^attention/value/kernel$": (None, "model", None),
        "^attention/output/kernel$": ("model", None),
    }
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 4, 16)).astype("float32")
    y = rng.normal(size=(12, 4)).astype("float32")
    assert_parity(build_merged_heads_model, lambda device_mesh: "auto", x, y)


class Block(keras.layers.Layer):
    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(width, name="up")
        self.down = keras.layers.Dense(4, name="down")

    def call(self, x):
        return self.down(self.up(x))


def test_a_path_two_variables_share_keeps_a_rule_only_if_it_fits_both():
    """Towers built on their own (CLIP's) give their variables the same paths;
    one rule lays out both, so it must fit both shapes."""

    def tower(width, name):
        inputs = keras.Input((4,))
        return keras.Model(inputs, Block(width, name="block")(inputs), name=name)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Add()([tower(16, "a")(inputs), tower(6, "b")(inputs)]))
    planned = tfmp.auto_layout(model, mesh((1, 8)))
    assert len(planned) == 0
    assert "does not fit [(4, 6)]" in planned.reasons["block/up/kernel"]


# KerasHub backbones the plan never saw: it opens their blocks -----------------

# Below 85% of the bytes split for compute, and why (tiny configs: 8-32 wide,
# where a patch embedding or a position table weighs as much as a block). A
# projection without a partner is split for memory only, gathered on use
# (docs/tensor-parallel.md says why).
HUB_LESS_SPLIT = {
    "AlbertBackbone": (0.75, "its factorized embedding projection is unpaired"),
    "BASNetBackbone": (0.75, "convolutions next to poolings and bilinear upsampling"),
    "BLIP2Backbone": (0.75, "patch embedding, query tokens, position tables"),
    "BertBackbone": (0.80, "position and segment tables, norms"),
    "CLIPBackbone": (0.70, "patch embedding, position tables, the towers' projections"),
    "CSPNetBackbone": (0.70, "stem and transition convolutions are unpaired"),
    "DFineBackbone": (0.15, "detection heads; per-level convolutions kept in lists"),
    "DINOV2Backbone": (0.15, "its 14 x 14 x 3 patch embedding is 79% of a width-16 model"),
    "DINOV3Backbone": (0.35, "its 8 x 8 x 3 patch embedding is 56% of the bytes"),
    "DeepLabV3Backbone": (0.20, "parallel pyramid branches kept in a list"),
    "DeiTBackbone": (0.60, "patch embedding, position table"),
    "DenseNetBackbone": (0.35, "stem before a pooling; transitions pool"),
    "DepthAnythingBackbone": (0.60, "its head resizes between convolutions; per-level ones"),
    "EfficientNetBackbone": (0.65, "stem and head convolutions are unpaired"),
    "ElectraBackbone": (0.80, "position and segment tables, norms"),
    "FNetBackbone": (0.70, "no attention weights: tables and norms weigh more"),
    "FluxBackbone": (0.50, "fused modulation and QKV projections"),
    "Gemma3nBackbone": (0.80, "AltUp projections kept in lists"),
    "HGNetV2Backbone": (0.55, "stem and grouped convolutions"),
    "MetaCLIP2Backbone": (0.70, "patch embedding, position tables, the towers' projections"),
    "MiTBackbone": (0.70, "overlapping patch embeddings, reduction convolutions"),
    "MobileNetBackbone": (0.55, "grouped (depthwise) convolutions"),
    "MobileNetV5Backbone": (0.00, "an RMS norm over channels between every two convolutions"),
    "MoonshineBackbone": (0.65, "audio stem convolutions, fused gated MLP"),
    "PARSeqBackbone": (0.65, "patch embedding, unpaired output head"),
    "PaliGemmaBackbone": (0.80, "patch embedding, image projection"),
    "Qwen3_5Backbone": (0.80, "its linear attention's fused projections are unpaired"),
    "RWKV7Backbone": (0.75, "low-rank adapters and mixing vectors"),
    "RetinaNetBackbone": (0.05, "its FPN keeps its convolutions in per-level dicts"),
    "SAM3PromptableConceptBackbone": (0.60, "patch embedding, fused QKV, FPN convolutions"),
    "SAMBackbone": (0.20, "fused QKV with relative positions, patch embedding"),
    "SegFormerBackbone": (0.65, "overlapping patch embeddings, reduction convolutions"),
    "SigLIPBackbone": (0.80, "patch embedding, position tables"),
    "StableDiffusion3Backbone": (0.05, "its VAE's group norms break every convolution pair"),
    "SwinTransformerBackbone": (0.50, "fused QKV, patch merging"),
    "ViTBackbone": (0.60, "patch embedding, position table"),
    "ViTDetBackbone": (0.20, "fused QKV with relative positions, patch embedding"),
    "XceptionBackbone": (0.75, "a separable convolution reading a pooling stays whole"),
}


def fits(axes, shape, device_mesh):
    return len(axes) == len(shape) and all(
        axis is None or (axis in device_mesh.axis_names and dim % device_mesh.axis_size(axis) == 0)
        for axis, dim in zip(axes, shape)
    )


@pytest.mark.filterwarnings("ignore:tfmp. auto_layout left")
def test_auto_layout_splits_every_keras_hub_backbone():
    """Every backbone class KerasHub exports, tiny: each planned layout fits
    its variable and the mesh, most bytes are split for compute (floors
    above), and 85% or more are split in memory, counting the weights stored
    split and gathered on use (tests/hub_backbones.py)."""
    import keras_hub

    from hub_backbones import ABSTRACT, BACKBONES

    exported = {name for name in dir(keras_hub.models) if name.endswith("Backbone")}
    assert exported == set(BACKBONES) | set(ABSTRACT)
    device_mesh = mesh((2, 4))
    too_little, too_little_stored, misfits = {}, {}, []
    for name, build in BACKBONES.items():
        backbone = build()
        planned = tfmp.auto_layout(backbone, device_mesh)
        split = stored = total = 0
        for variable in backbone.weights:
            size = int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
            total += size
            axes = planned[variable.path]
            if axes is not None:
                stored += size
                split += 0 if isinstance(axes, tfmp.layout.GatheredOnUse) else size
                if not fits(axes, tuple(variable.shape), device_mesh):
                    misfits.append((name, variable.path, tuple(variable.shape), axes))
        at_least = HUB_LESS_SPLIT.get(name, (0.85,))[0]
        if split / total < at_least:
            too_little[name] = (round(split / total, 3), at_least)
        # MobileNet: a batch norm's four per-channel vectors follow every
        # (depthwise) convolution, and vectors stay whole.
        if stored / total < (0.8 if name == "MobileNetBackbone" else 0.85):
            too_little_stored[name] = round(stored / total, 3)
    assert misfits == []
    assert too_little == {}
    assert too_little_stored == {}


HUB_PARITY = ["GPT2Backbone", "MistralBackbone", "Qwen3Backbone", "MixtralBackbone", "ViTBackbone"]


@pytest.mark.parametrize("name", HUB_PARITY)
def test_keras_hub_backbone_with_auto_layout_matches_single_device(name):
    from hub_backbones import BACKBONES, SMALL_IMAGE
    from test_keras_interop import token_data

    def build():
        backbone = BACKBONES[name]()
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone.output)
        return keras.Model(backbone.input, keras.layers.Dense(4, name="classifier")(pooled))

    y = np.random.default_rng(0).normal(size=(12, 4)).astype("float32")
    if name == "ViTBackbone":
        x = np.random.default_rng(1).normal(size=(12, *SMALL_IMAGE)).astype("float32")
        # The attention key bias: its gradient is 0 in theory, float noise here.
        assert_parity(build, lambda device_mesh: "auto", x, y, zero_gradient=r"/key/bias$")
        return
    # GPT-2 keeps its default dropout (0.1): random draws equal one device's.
    x, _, _ = token_data(n=12)
    assert_parity(build, lambda device_mesh: "auto", x, y)


def test_expert_banks_split_over_an_expert_axis():
    """On a ("batch", "expert", "model") mesh, "auto" splits KerasHub
    Mixtral's expert banks on their experts over "expert", says so in
    `reasons`, and the rest Megatron-style over "model"; the model trains
    like one device (every device of "expert" computes its experts for the
    tokens it holds, their sum over the axis is the mixture's output; 13
    rows at batch 4), and no axis is left idle."""
    import warnings

    from hub_backbones import BACKBONES
    from test_keras_interop import token_data

    def build():
        backbone = BACKBONES["MixtralBackbone"]()
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone.output)
        return keras.Model(backbone.input, keras.layers.Dense(4, name="classifier")(pooled))

    device_mesh = mesh((2, 2, 2), ("batch", "expert", "model"))
    plan = tfmp.auto_layout(build(), device_mesh)
    banks = {path: axes for path, axes in plan.items() if "expert" in axes}
    assert banks and all(axes[0] == "expert" and set(axes[1:]) == {None} for axes in banks.values()), banks
    assert all(plan.reasons[path.strip("^$").replace("\\", "")].endswith("over 'expert', the mesh's expert axis")
               for path in banks)
    assert any("model" in axes for axes in plan.values())
    x, _, _ = token_data(n=13)
    y = np.random.default_rng(0).normal(size=(13, 4)).astype("float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*splits nothing.*")
        assert_parity(
            build, x=x, y=y, strategy=tfmp.ModelParallelStrategy(device_mesh, "auto"), batch_size=4, steps=4
        )


@pytest.mark.parametrize(
    "specs", [("unsharded", "model"), ("batch", "model"), ("model", "batch"), ("batch", "unsharded")]
)
def test_a_replicated_variable_moves_to_a_split_layout_as_a_relayout_would(specs):
    """`to_layout` of a replicated value (a variable `move_variable` moves to
    its planned layout) slices each device's own copy: each device ends with
    the shard DTensor's relayout gives it, bit for bit."""
    device_mesh = mesh((2, 4)).dtensor_mesh
    whole = np.arange(8 * 12, dtype="float32").reshape(8, 12)
    value = dtensor.copy_to_mesh(tf.constant(whole), dtensor.Layout.replicated(device_mesh, 2))
    layout = dtensor.Layout(list(specs), device_mesh)
    moved = to_layout(value, layout)
    relaid = dtensor.relayout(value, layout)
    assert dtensor.fetch_layout(moved) == layout
    for ours, theirs in zip(dtensor.unpack(moved), dtensor.unpack(relaid)):
        assert ours.device == theirs.device
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


@pytest.mark.parametrize("on_mesh", [True, False])
def test_a_dimension_that_does_not_divide_is_a_named_error(on_mesh):
    """6 rows over the 4 devices of "model", from the mesh or the host."""
    device_mesh = mesh((2, 4)).dtensor_mesh
    value = np.ones((6, 2), "float32")
    if on_mesh:
        value = dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(device_mesh, 2))
    with pytest.raises(ValueError, match=r"A value of shape \(6, 2\) cannot take layout \['model', 'unsharded'\]: "
                       r"dimension 0 \(6\) does not divide by mesh axis 'model' of size 4"):
        to_layout(value, dtensor.Layout(["model", "unsharded"], device_mesh))
