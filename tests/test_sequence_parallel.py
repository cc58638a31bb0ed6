"""Sequence parallelism: norms' and dropouts' (batch, sequence, features)
outputs split over the sequence on the tensor-parallel axis, with one
device's numbers.

Each program trains from one device's initial weights on a 2x4
("batch", "model") mesh; the batches (37 rows at 8, or 13 at 4) end with
one the batch axis does not divide.
"""

import keras
import pytest

import tfmp
from helpers import assert_parity, demo_lm_like_one_device, strategy_on
from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data

N, BATCH, SEQUENCE = 37, 8, 8
SPLIT = ("batch", "model", None)


def compile_lm(model):
    model.compile(
        keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def lm_on_sequence_parallel_mesh():
    return strategy_on((2, 4), megatron_layout_map, sequence_parallel=True)


def test_megatron_lm_with_sequence_parallelism_matches_one_device():
    model = demo_lm_like_one_device(lm_on_sequence_parallel_mesh(), compile_lm, N, BATCH, SEQUENCE)
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert laid_out == {
        "transformer_lm/attention_norm": ("sequence_parallel='model'", SPLIT),
        "transformer_lm/ffn_norm": ("sequence_parallel='model'", SPLIT),
    }
    assert "transformer_lm/ffn_norm/output" in tfmp.summary(model, print_fn=lambda text: None)


def test_the_norms_hold_a_quarter_of_the_sequence_and_the_blocks_gather_it():
    """Each norm's output is gathered over "model" (whole: 4 rows x 8 tokens x
    32 features x 4 bytes per device) where the next tensor-parallel block
    reads it; without sequence parallelism no activation is gathered."""

    def forward_gathers(**strategy_kwargs):
        strategy = strategy_on((2, 4), megatron_layout_map, **strategy_kwargs)
        with strategy.scope():
            model = compile_lm(build_transformer_lm(seq_len=SEQUENCE))
        x, y = next_token_data(32, SEQUENCE, 64)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        report = tfmp.comm_report(model, print_fn=lambda text: None)
        return [
            c.bytes for c in report.collectives
            if (c.category, c.phase, c.kind, c.axes) == ("activations", "forward", "all-gather", ("model",))
        ]

    assert forward_gathers() == []
    gathered = forward_gathers(sequence_parallel=True)
    assert len(gathered) >= 2 and set(gathered) == {4 * SEQUENCE * 32 * 4}


@pytest.mark.parametrize("name", ["GPT2Backbone", "LlamaBackbone"])
def test_keras_hub_backbone_with_sequence_parallelism_matches_one_device(name):
    """GPT-2 keeps its dropout (0.1) and LayerNormalization; Llama has its
    own LlamaLayerNorm class."""
    from hub_backbones import pooled_classifier, pooled_classifier_data

    x, y = pooled_classifier_data()
    model = assert_parity(
        lambda: pooled_classifier(name),
        x=x,
        y=y,
        strategy=strategy_on((2, 4), lambda mesh: "auto", sequence_parallel=True),
        batch_size=4,
        steps=4,
    )
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert laid_out and all(axes == SPLIT for _, axes in laid_out.values())
    kinds = {type(layer).__name__ for layer in model._flatten_layers() if any(
        path.endswith("/" + layer.name) for path in laid_out)}
    assert kinds & {"LayerNormalization", "LlamaLayerNorm"}, kinds


def bert_like(tokens):
    """Embedding, LayerNormalization, Dropout (0.1), two Dense, as the BERT
    family begins: in the last batch DTensor's own gradient of the
    dropout's relayout failed its layout check."""
    x = keras.layers.Embedding(50, 16)(tokens)
    x = keras.layers.Dropout(0.1, name="dropout")(keras.layers.LayerNormalization(name="norm")(x))
    return keras.layers.Dense(16)(keras.layers.Dense(32, activation="relu")(x))


def opt_like(tokens):
    """Token and position embeddings (the positions a slice of a learned
    table, whose gradient is a `Pad`) into a pre-norm TransformerDecoder, as
    OPT begins: the `Pad` failed where layout propagation split it."""
    import keras_hub

    x = keras_hub.layers.TokenAndPositionEmbedding(50, 5 * SEQUENCE, 16)(tokens)
    return keras_hub.layers.TransformerDecoder(32, 2, normalize_first=True, name="decoder")(x)


def albert_like(tokens):
    """Embedding of 8 features, LayerNormalization, Dropout, a Dense
    projection to 16 features, a TransformerEncoder, as ALBERT begins (it
    factorizes its embedding): DTensor's own gradient of the attention
    input's gather failed its layout check at the first step."""
    import keras_hub

    x = keras.layers.LayerNormalization(name="norm")(keras.layers.Embedding(50, 8)(tokens))
    x = keras.layers.Dense(16, name="projection")(keras.layers.Dropout(0.1, name="dropout")(x))
    return keras_hub.layers.TransformerEncoder(32, 2, name="encoder")(x)


def shifted_by_one(tokens):
    """Embedding, LayerNormalization, then each position plus the one before
    it (`keras.ops.pad` and a slice), as RWKV-7 mixes tokens: the `Pad` of
    the norm's split output failed."""

    class ShiftByOne(keras.layers.Layer):
        def call(self, x):
            return x + keras.ops.pad(x, [[0, 0], [1, 0], [0, 0]])[:, :-1, :]

    x = keras.layers.LayerNormalization(name="norm")(keras.layers.Embedding(50, 16)(tokens))
    return keras.layers.Dense(16)(ShiftByOne()(x))


@pytest.mark.parametrize("body", [bert_like, opt_like, albert_like, shifted_by_one], ids=lambda body: body.__name__)
def test_the_first_layers_of_bert_opt_albert_and_rwkv_match_one_device(body):
    """Each begins a plain Keras model that mean-pools into Dense(1); 13 rows
    at batch 4: the last batch of 1 row runs whole over the batch axis. Held to the float64 yardstick: with tensor parallelism alone too,
    one weight of the decoder's attention output kernel ends 5e-5 from one
    device (float order, which Adam's steps carry), and its key's bias has
    a zero gradient in theory."""
    import numpy as np

    def build():
        tokens = keras.Input((SEQUENCE,), dtype="int32")
        pooled = keras.layers.GlobalAveragePooling1D()(body(tokens))
        return keras.Model(tokens, keras.layers.Dense(1)(pooled), name=body.__name__)

    rng = np.random.default_rng(0)
    model = assert_parity(
        build,
        x=rng.integers(0, 50, (13, SEQUENCE)).astype("int32"),
        y=rng.normal(size=(13, 1)).astype("float32"),
        strategy=strategy_on((2, 4), lambda mesh: "auto", sequence_parallel=True),
        batch_size=4,
        steps=4,
        zero_gradient=r"/key/bias$",
        noise_yardstick=True,
    )
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert laid_out and all(axes == ("sequence_parallel='model'", SPLIT) for axes in laid_out.values())
    if body is bert_like:
        assert set(laid_out) == {"bert_like/norm", "bert_like/dropout"}


def test_a_sequence_that_does_not_divide_is_a_named_error():
    strategy = lm_on_sequence_parallel_mesh()
    with strategy.scope():
        model = compile_lm(build_transformer_lm(seq_len=6))
    x, y = next_token_data(16, 6, 64)
    with pytest.raises(ValueError, match=r"layer 'attention_norm', shaped \(8, 6, 32\), over mesh axis 'model' of size 4, and 6 does not divide by 4"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("batch", ValueError, r"names the batch axis 'batch'"),
        ("sequence", ValueError, r"'sequence'"),
        ("yes", ValueError, r"'yes'"),
        (1, TypeError, r"True, False or a mesh axis name, got 1"),
    ],
)
def test_bad_sequence_parallel_arguments_are_named(value, error, match):
    with pytest.raises(error, match=match):
        strategy_on((2, 4), sequence_parallel=value)
