"""Every weight-bearing and random Keras layer on the mesh, against one device.

Each case is one Keras layer in a tiny model, a layout (its natural split by
LayoutMap rules, or `layout_map="auto"`) and the meshes it runs on; each is
trained with Adam for 4 steps on one device and on the mesh from the same
weights, the last on a partial batch that does not divide by the batch axis
of the 2x4 mesh (3 whole batches on 1x8, whose batch axis divides any batch),
and per-step losses, final weights and predictions must agree to 1e-5
(`helpers.assert_parity`). Weights whose exact gradient is zero (a bias
right before a normalization) move by float noise under Adam: they are
compared with the same 1e-5 absolute floor as the rest, which such noise stays
under here.

The page docs/supported-layers.md is generated from `CASES`:
`python tests/test_supported_layers.py` rewrites it, and
`test_supported_layers_page_is_current` fails when it is out of date.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

import keras
import numpy as np
import pytest

from helpers import MinimalCell, assert_parity, rules

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "supported-layers.md")
# Batches of 4, 4, 4 and 3 rows: the last does not divide by the batch axis
# of a 2x4 mesh, so the strategy runs it whole on both devices of that axis,
# in a step Keras traces again with an unknown batch size.
BATCH_SIZE = 4
N = 15
STEPS = -(-N // BATCH_SIZE)  # on a 2x4 mesh


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer on the mesh.

    Attributes:
        layer: What the page calls it.
        split: How its weights are split, in words.
        make: Builds the layer (a fresh one per model).
        input_shape: Shape of one example.
        layout: LayoutMap rules over the layer (named "layer"), or "auto".
        meshes: ("batch", "model") mesh shapes it runs on.
        integer_inputs: Inputs are token ids below 16.
        zero_gradient: Regex of weights whose exact gradient is zero.
    """

    layer: str
    split: str
    make: Callable[[], Any]
    input_shape: tuple[int, ...]
    layout: Any = dataclasses.field(default_factory=dict)
    meshes: tuple[tuple[int, int], ...] = ((2, 4),)
    integer_inputs: bool = False
    zero_gradient: str | None = None

    def samples(self, shape: tuple[int, int]) -> int:
        """N, or whole batches only where no batch can be partial (a batch
        axis of size 1)."""
        return N if shape[0] > 1 else N - N % BATCH_SIZE

    @property
    def id(self) -> str:
        return f"{self.layer}-{self.split}".replace(" ", "_")


L = keras.layers
MODEL = "model"
BOTH = ((2, 4), (1, 8))


def _kernel(*axes):
    return {"layer/kernel": axes}


_COLUMN = {"column/kernel": (None, MODEL)}


def _filters(spatial_rank):
    """A conv named "conv" split over its filters."""
    return {"conv/kernel": (None,) * (spatial_rank + 1) + (MODEL,)}


KEY_BIAS = "key/bias"


CASES = (
    Case("Dense", "column: kernel outputs, bias", lambda: L.Dense(8, name="layer"), (6,),
         {"layer/kernel": (None, MODEL), "layer/bias": (MODEL,)}, BOTH),
    Case("Dense", "row: kernel inputs", lambda: L.Dense(8, name="layer"), (8,), _kernel(MODEL, None)),
    Case("Dense", "fully sharded: kernel over batch and model", lambda: L.Dense(8, name="layer"), (8,),
         _kernel("batch", MODEL)),
    Case("EinsumDense", "heads", lambda: L.EinsumDense("btd,dnh->btnh", (4, 4, 2), name="layer"), (4, 6),
         _kernel(None, MODEL, None)),
    Case("Embedding", "vocabulary", lambda: L.Embedding(16, 8, name="layer"), (5,),
         {"layer/embeddings": (MODEL, None)}, integer_inputs=True),
    Case("Embedding", "vocabulary and hidden over batch", lambda: L.Embedding(16, 8, name="layer"), (5,),
         {"layer/embeddings": (MODEL, "batch")}, integer_inputs=True),
    Case("LayerNormalization", "gamma, beta", lambda: L.LayerNormalization(name="layer"), (8,),
         {"layer/gamma": (MODEL,), "layer/beta": (MODEL,)}),
    Case("GroupNormalization", "gamma, beta", lambda: L.GroupNormalization(4, name="layer"), (4, 8),
         {"layer/gamma": (MODEL,), "layer/beta": (MODEL,)}),
    Case("BatchNormalization", "gamma, beta, moving statistics",
         lambda: L.BatchNormalization(name="layer"), (8,),
         {"layer/(gamma|beta|moving_mean|moving_variance)": (MODEL,)}),
    Case("MultiHeadAttention", "heads (query, key, value, output)",
         lambda: _SelfAttention(L.MultiHeadAttention(4, 2, name="layer")), (4, 8),
         {"layer/(query|key|value)/kernel": (None, MODEL, None), "layer/attention_output/kernel": (MODEL, None, None)}, zero_gradient=KEY_BIAS),
    Case("GroupQueryAttention", "heads",
         lambda: _SelfAttention(L.GroupQueryAttention(2, 8, 4, name="layer")), (4, 8),
         {"layer/query/kernel": (None, MODEL, None), "layer/(key|value)/kernel": (None, MODEL, None),
          "layer/attention_output/kernel": (MODEL, None, None)}, zero_gradient=KEY_BIAS),
    Case("Conv1D", "filters", lambda: L.Conv1D(8, 3, padding="same", name="layer"), (6, 4),
         {"layer/kernel": (None, None, MODEL), "layer/bias": (MODEL,)}),
    Case("Conv2D", "filters", lambda: L.Conv2D(8, 3, name="layer"), (6, 6, 4),
         {"layer/kernel": (None, None, None, MODEL), "layer/bias": (MODEL,)}, BOTH),
    Case("Conv2D", "input channels, stride 2", lambda: L.Conv2D(8, 3, strides=2, padding="same", name="layer"),
         (6, 6, 4), _kernel(None, None, MODEL, None)),
    Case("Conv3D", "filters", lambda: L.Conv3D(4, 2, name="layer"), (4, 4, 4, 2),
         _kernel(None, None, None, None, MODEL)),
    Case("Conv1DTranspose", "filters", lambda: L.Conv1DTranspose(8, 3, strides=2, name="layer"), (5, 4),
         _kernel(None, MODEL, None)),
    Case("Conv2DTranspose", "filters", lambda: L.Conv2DTranspose(8, 3, strides=2, padding="same", name="layer"),
         (4, 4, 4), _kernel(None, None, MODEL, None)),
    Case("Conv3DTranspose", "filters", lambda: L.Conv3DTranspose(4, 2, name="layer"), (3, 3, 3, 2),
         _kernel(None, None, None, MODEL, None)),
    Case("DepthwiseConv1D", "channels", lambda: L.DepthwiseConv1D(3, depth_multiplier=2, name="layer"), (6, 4),
         _kernel(None, MODEL, None)),
    Case("DepthwiseConv2D", "none (batch only)", lambda: L.DepthwiseConv2D(3, name="layer"), (6, 6, 4), {}),
    Case("DepthwiseConv2D", "channels", lambda: L.DepthwiseConv2D(3, padding="same", name="layer"), (6, 6, 8),
         _kernel(None, None, MODEL, None)),
    Case("SeparableConv1D", "channels", lambda: L.SeparableConv1D(8, 3, name="layer"), (6, 4),
         {"layer/depthwise_kernel": (None, MODEL, None), "layer/pointwise_kernel": (None, MODEL, None)}),
    Case("SeparableConv2D", "channels", lambda: L.SeparableConv2D(8, 3, name="layer"), (6, 6, 4),
         {"layer/depthwise_kernel": (None, None, MODEL, None), "layer/pointwise_kernel": (None, None, MODEL, None)}),
    Case("SimpleRNN", "units", lambda: L.SimpleRNN(8, name="layer"), (5, 4),
         {"layer/simple_rnn_cell/(kernel|recurrent_kernel)": (None, MODEL)}),
    Case("LSTM", "gate units", lambda: L.LSTM(8, return_sequences=True, name="layer"), (5, 4),
         {"layer/lstm_cell/(kernel|recurrent_kernel)": (None, MODEL), "layer/lstm_cell/bias": (MODEL,)}, BOTH),
    Case("GRU", "gate units, go_backwards", lambda: L.GRU(8, go_backwards=True, name="layer"), (5, 4),
         {"layer/gru_cell/(kernel|recurrent_kernel)": (None, MODEL)}),
    Case("Bidirectional", "LSTM gate units", lambda: L.Bidirectional(L.LSTM(4, return_sequences=True), name="layer"),
         (3, 4), {"layer/.*/(kernel|recurrent_kernel)": (None, MODEL)}),
    Case("RNN", "custom cell", lambda: L.RNN(MinimalCell(8), name="layer"), (5, 4), {}),
    Case("ConvLSTM2D", "filters", lambda: L.ConvLSTM2D(4, (1, 3), padding="same", name="layer"), (2, 3, 3, 2),
         {"layer/.*(kernel|recurrent_kernel)": (None, None, None, MODEL)}),
    Case("Dropout", "activations over batch and model", lambda: _AfterColumn(L.Dropout(0.5)), (8,), _COLUMN, BOTH),
    Case("SpatialDropout1D", "activations over batch", lambda: L.SpatialDropout1D(0.5), (5, 8), {}),
    Case("SpatialDropout2D", "activations over batch", lambda: L.SpatialDropout2D(0.5), (4, 4, 8), {}),
    Case("GaussianNoise", "activations over batch and model", lambda: _AfterColumn(L.GaussianNoise(0.5)), (8,),
         _COLUMN),
    Case("GaussianDropout", "activations over batch and model", lambda: _AfterColumn(L.GaussianDropout(0.5)),
         (8,), _COLUMN),
    Case("AlphaDropout", "activations over batch and model", lambda: _AfterColumn(L.AlphaDropout(0.5)), (8,),
         _COLUMN),
    Case("RandomFlip", "images over batch", lambda: L.RandomFlip(), (4, 4, 3), {}),
    Case("RandomContrast", "images over batch", lambda: L.RandomContrast(0.5), (4, 4, 3), {}),
    Case("RandomBrightness", "images over batch", lambda: L.RandomBrightness(0.5), (4, 4, 3), {}),
    Case("RandomCrop", "images over batch, then pooled", lambda: _Pooled(L.RandomCrop(4, 4)), (6, 6, 3), {}),
    Case("RandomRotation", "images over batch; nearest, constant fill",
         lambda: L.RandomRotation(0.3, fill_mode="constant", interpolation="nearest"), (6, 6, 3), {}),
    Case("RandomZoom", "images over batch; bilinear, reflect", lambda: L.RandomZoom(0.3), (6, 6, 3), {}),
    Case("RandomTranslation", "images over batch; bilinear, wrap",
         lambda: L.RandomTranslation(0.3, 0.3, fill_mode="wrap"), (6, 6, 3), {}),
    Case("RandomShear", "images over batch; bilinear, nearest fill",
         lambda: L.RandomShear(0.3, 0.3, fill_mode="nearest"), (6, 6, 3), {}),
    Case("RandomPerspective", "images over batch", lambda: L.RandomPerspective(0.5), (6, 6, 3), {}),
    Case("AveragePooling1D", "activations over batch and channels",
         lambda: _AfterConv(L.AveragePooling1D(2), L.Conv1D), (6, 4), _filters(1)),
    Case("AveragePooling2D", "activations over batch and channels, same padding",
         lambda: _AfterConv(L.AveragePooling2D(3, strides=2, padding="same"), L.Conv2D), (5, 5, 4),
         _filters(2)),
    Case("AveragePooling3D", "activations over batch and channels",
         lambda: _AfterConv(L.AveragePooling3D(2), L.Conv3D), (4, 4, 4, 2), _filters(3)),
    Case("MaxPooling2D", "activations over batch and channels",
         lambda: _AfterConv(L.MaxPooling2D(2), L.Conv2D), (6, 6, 4), _filters(2)),
    Case("GlobalAveragePooling2D", "activations over batch and channels",
         lambda: _AfterConv(L.GlobalAveragePooling2D(), L.Conv2D), (6, 6, 4), _filters(2)),
    Case("Transformer block", "auto", lambda: _TransformerBlock(), (4, 8), "auto", BOTH, zero_gradient=KEY_BIAS),
    Case("CNN", "auto", lambda: _ConvStack(), (6, 6, 4), "auto"),
)


class _SelfAttention(keras.layers.Layer):
    def __init__(self, attention, **kwargs):
        super().__init__(**kwargs)
        self.attention = attention

    def call(self, x):
        return self.attention(x, x)


class _AfterColumn(keras.layers.Layer):
    """A column-parallel Dense, then the layer: its input is split over "model"."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.column = keras.layers.Dense(8, name="column")
        self.inner = inner

    def call(self, x, training=None):
        return self.inner(self.column(x), training=training)


class _AfterConv(keras.layers.Layer):
    """A 1x1 conv split over its filters, then the layer: its input is split
    over "model" on channels."""

    def __init__(self, inner, conv_type, **kwargs):
        super().__init__(**kwargs)
        self.conv = conv_type(8, 1, name="conv")
        self.inner = inner

    def call(self, x):
        return self.inner(self.conv(x))


class _Pooled(keras.layers.Layer):
    """The layer, then global average pooling: under any tf.distribute
    strategy Keras builds the model by calling it with training=False, where
    RandomCrop keeps its input's size, and a head on the uncropped shape
    fails that build (on one device too, with OneDeviceStrategy)."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self.pool = keras.layers.GlobalAveragePooling2D()

    def call(self, x, training=None):
        return self.pool(self.inner(x, training=training))


class _TransformerBlock(keras.layers.Layer):
    """A custom layer holding attention and an FFN: auto_layout opens it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.GroupQueryAttention(2, 8, 4)
        self.norm = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(16, activation="gelu")
        self.down = keras.layers.Dense(8)

    def call(self, x):
        x = self.norm(x + self.attention(x, x))
        return x + self.down(self.up(x))


class _ConvStack(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(8, 3, padding="same", activation="relu")
        self.depthwise = keras.layers.DepthwiseConv2D(3, padding="same")
        self.pointwise = keras.layers.Conv2D(8, 1)

    def call(self, x):
        return self.pointwise(self.depthwise(self.conv(x)))


def _model(case: Case) -> keras.Model:
    """The layer, then a Dense head: every case has weights to train."""
    inputs = keras.Input(case.input_shape, dtype="int32" if case.integer_inputs else "float32")
    outputs = keras.layers.Dense(4, name="head")(case.make()(inputs))
    return keras.Model(inputs, outputs, name="case")


def _data(case: Case, output_shape: tuple[int, ...], samples: int):
    rng = np.random.default_rng(0)
    if case.integer_inputs:
        x = rng.integers(0, 16, size=(samples,) + case.input_shape).astype("int32")
    else:
        x = rng.normal(size=(samples,) + case.input_shape).astype("float32")
    return x, rng.normal(size=(samples,) + output_shape).astype("float32")


def _parameters():
    for case in CASES:
        for shape in case.meshes:
            yield pytest.param(case, shape, id=f"{case.id}-{shape[0]}x{shape[1]}")


@pytest.mark.parametrize("case,shape", list(_parameters()))
def test_layer_matches_single_device(case, shape):
    keras.utils.set_random_seed(1)
    samples = case.samples(shape)
    x, y = _data(case, tuple(_model(case).output.shape[1:]), samples)
    layout = (lambda device_mesh: "auto") if case.layout == "auto" else rules(case.layout)
    model = assert_parity(
        lambda: _model(case), layout, x, y, mesh_shape=shape, steps=-(-samples // BATCH_SIZE), batch_size=BATCH_SIZE,
        zero_gradient=case.zero_gradient,
    )
    if case.layout and case.layout != "auto" and shape[1] > 1:
        split = [v.path for v in model.variables if "model" in v.value.layout.sharding_specs]
        assert split, f"no variable of {case.layer} was split over 'model'"
    if case.layout == "auto":
        assert any(not v.value.layout.is_fully_replicated() for v in model.variables)


def render_page() -> str:
    lines = [
        "# Supported layers",
        "",
        f"Each row is a Keras layer in a tiny model, trained with Adam for {STEPS} steps (3 on 1x8)",
        "on one device and on the mesh from the same weights: per-step losses,",
        "final weights and predictions agree to 1e-5. Generated from",
        "`tests/test_supported_layers.py`, whose tests are these rows; a row is",
        "listed only while its test passes (CI runs them all).",
        "",
        "\"auto\" is `layout_map=\"auto\"` on a custom layer the planner opens.",
        "Random layers draw exactly one device's values for the whole tensor.",
        "",
        f"Every row trains on {N} samples in batches of {BATCH_SIZE} on the 2x4 mesh, and",
        f"predicts them so: the last batch, of {N % BATCH_SIZE} rows, does not divide by its",
        f"batch axis (2); on 1x8 no batch can (its batch axis has size 1: {N - N % BATCH_SIZE}",
        "samples). tfmp runs such a batch whole on every device of that axis,",
        "in a step Keras traces again with an unknown batch size; there tfmp's",
        "rewritten ops (convolutions, image warps, tfmp's layers) keep the batch",
        "whole too, while batches of the first size keep their own step, split.",
        "",
        "The image warps (`RandomRotation`, `RandomZoom`, `RandomTranslation`,",
        "`RandomShear`, `RandomPerspective`) run TensorFlow's own",
        "`ImageProjectiveTransformV3`, which DTensor has no layout rule for,",
        "replicated (the images gathered; `tfmp/lowering/replicated.py`); each row",
        "takes another interpolation and fill mode, and",
        "`tests/test_lowering_image.py` checks values and gradients on the mesh,",
        "and trains RandomCrop and RandomRotation after a Dense on an 8x1 mesh.",
        "`RandomCrop` crops at an offset drawn in the step, which tfmp",
        "reads as a gather. Its row pools after the crop: under any",
        "`tf.distribute` strategy, Keras builds the model at the start of `fit` by",
        "calling it with `training=False`, where Keras' RandomCrop keeps its",
        "input's size, so layers whose shapes depend on the crop (`Flatten`, then",
        "`Dense`) fail that build with Keras' own error, on one device too.",
        "",
        "Max pooling layers run Keras' own `max_pool` on their input split over",
        "the batch only (channels gathered where a conv split them), 3-D ones a",
        "maximum over the window's taps (`tfmp/lowering/pooling.py`); average pooling",
        "layers run TensorFlow's own, replicated, on their input gathered whole",
        "(`tfmp/lowering/replicated.py`): DTensor has no rule for the gradient of",
        "average pooling, and pools channels split by a conv's filters in neither",
        "form. Every Keras",
        "`mean` on a mesh (`GlobalAveragePooling*`, losses) has a broadcast",
        "gradient (`tfmp/lowering/reduction.py`): DTensor mis-expands the `Tile`",
        "of TensorFlow's when the kept dimensions are split.",
        "",
        "Keras' random draws of `categorical`, `gamma`, `binomial` and `beta`",
        "(AugMix, MixUp and CutMix draw with the last three) have ops DTensor has",
        "no layout rule for; it runs them replicated (the switch",
        "`DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.<OP>`, which tfmp sets as it",
        "is imported: `tfmp/_env.py`), and they draw one device's numbers",
        "(`tests/test_lowering_random.py`). In a pipeline with more than one",
        "micro-batch, `categorical` stops with a `ValueError` naming the layer (a",
        "micro-batch holds only its rows of the logits).",
        "",
        "Not supported on a mesh: `RandomElasticTransform` (it draws with",
        "TensorFlow's random ops directly, which DTensor draws shard by shard). The",
        "first step stops with a `ValueError` that names the layer and says to",
        "apply it in the `tf.data` pipeline. In a pipeline with more than one",
        "micro-batch, random layers draw per micro-batch, not one device's values.",
        "",
        "## TensorFlow ops in your own code",
        "",
        "Layers and `train_step`s written before Keras 3 call TensorFlow directly.",
        "DTensor refuses TensorFlow's stateful random ops; on a mesh tfmp draws them",
        "from stateless Philox ops (`tfmp/lowering/random.py`), whole on every device:",
        "",
        "- `tf.random.normal`, `tf.random.uniform` (float and integer),",
        "  `tf.random.truncated_normal` and `tf.keras.backend.random_normal` with",
        "  a seed of their own (`tf.random.set_seed`, or",
        "  `keras.utils.set_random_seed`, and an op `seed`) draw bitwise one device's",
        "  numbers, step after step and across a last batch that does not divide the",
        "  batch axis. A recompiled model, or a second model in the same strategy,",
        "  continues the draws where one device starts them again.",
        "  With only a global seed, an op's seed is its place among the traced",
        "  function's unseeded random ops, the same on a mesh: its draws are one",
        "  device's too (measured for draws in `strategy.run`).",
        "- Without any seed one device seeds each kernel at random; the mesh picks",
        "  random seeds too, and matches one device in distribution only. A",
        "  multi-client run refuses unseeded draws (each client would draw its own).",
        "- `tf.random.gamma` draws one device's numbers too (from the stateless",
        "  gamma op, which samples as the kernel does), as the normal draws do.",
        "- The stateless draws (`tf.random.stateless_normal`, `stateless_uniform`,",
        "  `stateless_truncated_normal`, `stateless_categorical`, `stateless_gamma`,",
        "  `stateless_poisson`, `stateless_binomial`,",
        "  `stateless_parameterized_truncated_normal`) draw one device's numbers:",
        "  DTensor runs those it has no layout rule for replicated, the whole draw",
        "  on every device (by the same switch).",
        "- `tf.random.shuffle` (a uniform permutation) and `tf.random.categorical`",
        "  (Gumbel-max sampling) match one device in distribution only: no stateless",
        "  op reproduces their kernels. `tf.random.poisson` runs TensorFlow's own",
        "  kernel on every device with the same seeds: the same numbers on every",
        "  device, one device's in distribution (its kernel starts again in each",
        "  traced function, and tfmp traces one more for a last batch that does not",
        "  divide the batch axis).",
        "- A `tf.random.Generator` made in the strategy's scope keeps its state",
        "  replicated and draws MirroredStrategy's numbers: under any tf.distribute",
        "  strategy TensorFlow folds the replica's id into its key, so they are not",
        "  the numbers it draws outside a strategy.",
        "",
        "Every device does the whole draw's work and holds it whole, as with",
        "Keras' own random layers.",
        "",
        "`tests/test_user_tf_ops.py` trains a layer of each of these families between",
        "a column- and a row-parallel Dense on 2x4 like one device: `tf.shape`,",
        "`tf.reshape`, `tf.concat`, `tf.stack`, `tf.reduce_*`, elementwise math,",
        "`tf.gather`, `tf.one_hot`, `tf.argmax`, `tf.where`, `tf.cond`, `tf.cast`",
        "(`tf.one_hot` in a layer runs as `keras.ops.one_hot` does on a mesh:",
        "`tfmp/lowering/indexing.py`).",
        "",
        "Models with their own `train_step` and no `call()` (Keras' VAE and GAN",
        "examples) train with rules and with `layout_map=\"auto\"`, which plans",
        "their sub-models (`tests/test_own_train_step.py`).",
        "",
        "## Layers",
        "",
        "| layer | split | meshes (batch x model) | result |",
        "|---|---|---|---|",
    ]
    for case in CASES:
        meshes = ", ".join(f"{b}x{m}" for b, m in case.meshes)
        lines.append(f"| `{case.layer}` | {case.split} | {meshes} | same numbers as one device |")
    return "\n".join(lines) + "\n"


def test_supported_layers_page_is_current():
    with open(PAGE) as page:
        assert page.read() == render_page(), "run: python tests/test_supported_layers.py"


if __name__ == "__main__":
    with open(PAGE, "w") as page:
        page.write(render_page())
    sys.exit(0)
