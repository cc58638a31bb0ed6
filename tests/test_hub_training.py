"""KerasHub backbones that needed a fix to train with `layout_map="auto"`,
and the fixes on their own: each on a 2x4 mesh against one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tfmp
from helpers import assert_parity, strategy_on
from tfmp.strategy import keras_hooks

X = np.random.default_rng(1).normal(size=(12, 6)).astype("float32")
Y = np.random.default_rng(0).normal(size=(12, 4)).astype("float32")


def test_vitdet_backbone_with_auto_layout_matches_single_device():
    """ViTDet normalizes images with two host constants of its functional
    graph (`x - ops.array(mean)`), which the step captures."""
    from hub_backbones import BACKBONES, IMAGE

    def build():
        backbone = BACKBONES["ViTDetBackbone"]()
        pooled = keras.layers.GlobalAveragePooling2D(name="pool")(backbone.output)
        return keras.Model(backbone.input, keras.layers.Dense(4, name="classifier")(pooled))

    x = np.random.default_rng(1).normal(size=(12, *IMAGE)).astype("float32")
    # The key's third of the fused qkv bias: its gradient is 0 in theory.
    # KerasHub leaves the qkv Dense unnamed (dense_<n>, numbered per build),
    # so the pattern also takes in the attention's output bias.
    assert_parity(
        build, lambda device_mesh: "auto", x, Y, zero_gradient=r"relative_pe_\d+/dense_\d+/bias$"
    )


def build_with_constants():
    """A functional model holding host tensors: the small ones become
    constants of the step's graph, a large one a replicated copy."""
    shift = ops.array(np.linspace(-1, 1, 6), dtype="float32")
    table = ops.array(np.random.default_rng(2).normal(size=(6, 4)), dtype="float32")
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu", name="up")(inputs - shift)
    outputs = keras.layers.Dense(4, name="down")(hidden) + ops.matmul(inputs, table)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("constant_elements", [keras_hooks._CONSTANT_ELEMENTS, 0])  # noqa: SLF001
def test_host_tensors_a_model_holds_reach_the_step(monkeypatch, constant_elements):
    monkeypatch.setattr(keras_hooks, "_CONSTANT_ELEMENTS", constant_elements)
    assert_parity(build_with_constants, lambda device_mesh: "auto", X, Y)


def test_initializer_holding_a_tensor_made_in_the_scope():
    """A tensor made eagerly in the scope is a host tensor, like any other
    value an initializer holds (MoonshineRotaryEmbedding's inverse
    frequencies; a scope that made it a DTensor broke the initial value)."""
    strategy = strategy_on((2, 4))
    with strategy.scope():
        frequencies = 1.0 / (10.0 ** (ops.arange(0, 3, dtype="float32") / 3))
        initializer = keras.initializers.Constant(frequencies)
        variable = keras.Variable(initializer=initializer, shape=(3,), dtype="float32")
    np.testing.assert_allclose(variable.numpy(), 1.0 / 10.0 ** (np.arange(3) / 3), rtol=1e-6)
    assert initializer.value is frequencies  # the user's initializer is left as it was


class PlusEye(keras.layers.Layer):
    """`x @ (kernel + eye)` with `ops.eye(n, m, k)`: tf.eye is a MatrixDiagV3,
    which DTensor runs replicated (`tfmp._env.REPLICATED_OPS`)."""

    def __init__(self, units, k=0, **kwargs):
        super().__init__(**kwargs)
        self.units, self.k = units, k

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")

    def call(self, x):
        return ops.matmul(x, self.kernel + ops.eye(x.shape[-1], self.units, k=self.k))


@pytest.mark.parametrize("k", [0, 2, -1])
def test_eye_matches_single_device(k):
    def build():
        inputs = keras.Input((6,))
        hidden = PlusEye(8, k=k, name="plus_eye")(inputs)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))

    def layout_map_fn(device_mesh):
        layout_map = tfmp.LayoutMap(device_mesh)
        layout_map["plus_eye/kernel"] = (None, "model")
        return layout_map

    assert_parity(build, layout_map_fn, X, Y)


def test_embedding_split_on_vocabulary_feeding_a_row_parallel_layer():
    """Layout propagation asks the lookup for features split over "model"
    (Gemma 3n); DTensor's GatherV2 refuses an output split unlike the table
    ("input and output layout do not agree on non-axis dim 1")."""

    def build():
        tokens = keras.Input((8,), dtype="int32")
        embedded = keras.layers.Embedding(64, 16, name="embedding")(tokens)
        hidden = keras.layers.Dense(32, name="row")(embedded)
        pooled = keras.layers.GlobalAveragePooling1D()(hidden)
        return keras.Model(tokens, keras.layers.Dense(4, name="head")(pooled))

    def layout_map_fn(device_mesh):
        layout_map = tfmp.LayoutMap(device_mesh)
        layout_map["embedding/embeddings"] = ("model", None)
        layout_map["row/kernel"] = ("model", None)
        return layout_map

    tokens = np.random.default_rng(0).integers(0, 64, size=(12, 8)).astype("int32")
    assert_parity(build, layout_map_fn, tokens, Y)


class AltUpLike(keras.layers.Layer):
    """Gemma 3n's AltUp in small: a stack of two versions of the activations
    (the batch its second dimension), read back by index."""

    def call(self, x):
        stack = ops.stack([x, ops.tanh(x)], axis=0)
        return stack[0] * stack[-1] + ops.transpose(stack, (1, 2, 3, 0))[:, :, :, 1]


def test_indexing_a_stack_split_on_its_second_dimension():
    """DTensor's StridedSlice with a shrink_axis_mask (`stack[0]`) labels its
    output with the input's sharding less the last dimension's, not the
    indexed one's: the batch's split lands on the sequence, with the values
    of other rows (then a layout oscillation and a refused Transpose in
    Gemma 3n)."""

    def build():
        inputs = keras.Input((4, 6))
        hidden = AltUpLike(name="altup")(keras.layers.Dense(8, name="up")(inputs))
        pooled = keras.layers.GlobalAveragePooling1D()(hidden)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(pooled))

    x = np.random.default_rng(1).normal(size=(12, 4, 6)).astype("float32")
    assert_parity(build, lambda device_mesh: "auto", x, Y)


class RelativeBiasLike(keras.layers.Layer):
    """T5's relative position bias in small: a (buckets, heads) table read
    whole, looked up by a (query, key) grid of buckets, added to scores
    split over heads."""

    def build(self, input_shape):
        self.bias = self.add_weight((8, 4), name="bias")

    def call(self, x):
        positions = ops.arange(6)
        buckets = ops.abs(positions[None, :] - positions[:, None]) % 8
        bias = ops.transpose(ops.take(self.bias, buckets, axis=0), (2, 0, 1))  # (4, 6, 6)
        return ops.einsum("bhq,hqk->bhk", x, bias + 1.0)


def test_lookup_into_a_weight_read_whole_by_heads_split_scores():
    """A lookup into a replicated or `gather_on_use` table gives its output
    the table's unsplit feature dimension; a consumer split over heads made
    DTensor refuse the GatherV2 ("input and output layout do not agree on
    non-axis dim 1", T5)."""

    def build():
        inputs = keras.Input((6,))
        heads = keras.layers.Reshape((4, 6))(keras.layers.Dense(24, name="heads")(inputs))
        hidden = RelativeBiasLike(name="rel")(heads)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.Flatten()(hidden)))

    def layout_map_fn(device_mesh):
        layout_map = tfmp.LayoutMap(device_mesh)
        layout_map["heads/kernel"] = (None, "model")
        layout_map["rel/bias"] = tfmp.gather_on_use(("model", None))
        return layout_map

    assert_parity(build, layout_map_fn, X, Y)


def _pooled_features(output):
    """(batch, ..., features) -> (batch, features), the mean over the middle
    axes (a Reshape to (batch, -1, features) first: SAM3 returns other
    ranks than it declares). A (batch, batch) similarity matrix (CLIP's
    logits: its last axis unknown to the graph) -> its mean and logsumexp
    over that axis."""
    if output.shape[-1] is None:
        return ops.concatenate(
            [ops.mean(output, axis=-1, keepdims=True), ops.logsumexp(output, axis=-1, keepdims=True)],
            axis=-1,
        )
    return ops.mean(keras.layers.Reshape((-1, output.shape[-1]))(output), axis=1)


# The attention key biases' float noise, which Adam turns into steps: CLIP's
# differ from one device's by up to 2.6e-3 after 3 steps (one step moves a
# weight by up to 0.01), SigLIP's by less than 1e-3.
ZERO_GRADIENT_ATOL = {"CLIPBackbone": 1e-2}


@pytest.mark.parametrize("name", ["SigLIPBackbone", "CLIPBackbone"])
def test_multi_output_backbones_with_auto_layout_match_single_device(name):
    """A backbone with a dict of outputs (contrastive logits, detections)
    under a head that takes every float output: each pooled to (batch,
    features) by `_pooled_features`, all concatenated, then a Dense(4)."""
    from hub_backbones import BACKBONES, SMALL_IMAGE

    def build():
        backbone = BACKBONES[name]()
        outputs = [
            output for output in keras.tree.flatten(backbone.output)
            if keras.backend.is_float_dtype(output.dtype)
        ]
        pooled = ops.concatenate([_pooled_features(output) for output in outputs], axis=-1)
        return keras.Model(backbone.input, keras.layers.Dense(4, name="head")(pooled))

    # Seed 1 gives one patch-embedding weight a gradient 4e-5 of the median,
    # whose float noise Adam turns into a 3e-4 relative difference.
    rng = np.random.default_rng(2)
    x = {
        "images": rng.normal(size=(12, *SMALL_IMAGE)).astype("float32"),
        "token_ids": rng.integers(1, 64, size=(12, 8)).astype("int32"),
    }
    # The attention key biases of both towers: their gradient is 0 in theory.
    assert_parity(
        build,
        lambda device_mesh: "auto",
        x,
        Y,
        zero_gradient=r"/(self_attn|attention)/key/bias$",
        zero_gradient_atol=ZERO_GRADIENT_ATOL.get(name, 1e-3),
    )


class RegionGather(keras.layers.Layer):
    """SAM3's ROI align in small: `tf.gather_nd` with indices of rank 7."""

    def call(self, features, points):
        indices = ops.cast(ops.reshape(points, (-1, 1, 1, 1, 1, 1, 4)), "int32")
        return ops.reshape(tf.gather_nd(features, indices), (-1, 6))


def test_gather_nd_with_high_rank_indices_matches_single_device():
    """Its gradient (a ScatterNd into a 6-D tensor) crashed the process on a
    mesh; tfmp gathers a list of the indices and reshapes."""

    def build():
        image, points = keras.Input((4, 4, 3), name="image"), keras.Input((6, 4), name="points")
        features = keras.layers.Dense(8, name="features")(image)
        gathered = RegionGather(name="region_gather")(features, points)
        return keras.Model({"image": image, "points": points}, keras.layers.Dense(4, name="head")(gathered))

    rng = np.random.default_rng(1)
    rows = np.broadcast_to((np.arange(12) % 4)[:, None], (12, 6))
    points = np.stack(
        [rows, rng.integers(0, 4, (12, 6)), rng.integers(0, 4, (12, 6)), rng.integers(0, 8, (12, 6))], -1
    )
    x = {"image": rng.normal(size=(12, 4, 4, 3)).astype("float32"), "points": points.astype("float32")}
    assert_parity(build, lambda device_mesh: "auto", x, Y)
