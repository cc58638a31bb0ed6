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
