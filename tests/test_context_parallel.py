"""Context parallelism: the sequence split over a "sequence" mesh axis
through the whole model, keys and values gathered whole in attention, with
one device's numbers.

Each program trains from one device's initial weights on a 2x2x2
("batch", "sequence", "model") mesh; the batches (37 rows at 8, or 13 at 4)
end with one the batch axis does not divide.
"""

import pytest

import tfmp
from helpers import assert_parity, compile_lm, demo_lm_like_one_device, mesh
from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data
from tfmp.strategy.graph_capture import first_step_graphs_of, is_train_step

N, BATCH, SEQUENCE, HEADS = 37, 8, 8, 8
SPLIT = ("batch", "sequence", None)
AXES = ("batch", "sequence", "model")


def context_parallel_strategy(layout_map_fn=megatron_layout_map, **kwargs):
    device_mesh = mesh((2, 2, 2), AXES)
    return tfmp.ModelParallelStrategy(device_mesh, layout_map_fn(device_mesh), **kwargs)


def per_device_scores_shapes(model) -> set:
    """The shapes of the attention scores' softmax on each device, from the
    graphs of the model's first steps."""
    return {
        tuple(dim.size for dim in node.attr["_output_shapes"].list.shape[0].dim)
        for function in filter(is_train_step, first_step_graphs_of(model).function_graphs)
        for partition in function.partition_graphs
        for node in partition.node
        if node.op.endswith("Softmax") and "attention" in node.name and node.attr["_output_shapes"].list.shape
    }


def test_megatron_lm_with_context_parallelism_matches_one_device():
    """The demo LM (causal mask) with Megatron's rules on "model": each
    device computes the scores of its half of the batch's rows, half of the
    heads and half of the queries against all the keys, which it gathers."""
    model = demo_lm_like_one_device(
        context_parallel_strategy(context_parallel=True), compile_lm, N, BATCH, SEQUENCE, num_heads=HEADS
    )
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert laid_out == {
        f"transformer_lm/{name}": ("context_parallel='sequence'", SPLIT)
        for name in ("attention", "attention_norm", "ffn_norm")
    }
    batch_rows, heads = BATCH // 2, HEADS // 2
    assert (batch_rows, heads, SEQUENCE // 2, SEQUENCE) in per_device_scores_shapes(model)
    report = tfmp.comm_report(model, print_fn=lambda text: None)
    gathered = {
        c.op.rpartition("attention_1/")[2]: c.bytes
        for c in report.collectives
        if (c.phase, c.kind, c.axes) == ("forward", "all-gather", ("sequence",))
    }
    # The key and the value of the one attention layer, each (4, 8, 4, 4)
    # float32 per device once gathered: their heads stay split over "model".
    key_bytes = batch_rows * SEQUENCE * heads * 4 * 4
    assert (gathered["key_1/Add"], gathered["value_1/Add"]) == (key_bytes, key_bytes), gathered
    # The loss reads the (batch, sequence, vocabulary) logits where they are:
    # TensorFlow's op would gather their sequence to reshape positions into rows.
    assert not [op for op in gathered if "lm_head" in op or "crossentropy" in op], gathered


@pytest.mark.parametrize("name", ["GPT2Backbone", "LlamaBackbone"])
def test_keras_hub_backbone_with_context_parallelism_matches_one_device(name):
    """Padding masks (every third row padded) and causal masks; GPT-2's own
    dropout and position embedding, Llama's rotary embedding and grouped
    keys and values; `layout_map="auto"` on "model"."""
    from hub_backbones import pooled_classifier, pooled_classifier_data

    x, y = pooled_classifier_data()
    model = assert_parity(
        lambda: pooled_classifier(name),
        x=x,
        y=y,
        strategy=context_parallel_strategy(lambda mesh: "auto", context_parallel="sequence"),
        batch_size=4,
        steps=4,
    )
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert any(path.endswith("self_attention") for path in laid_out), laid_out
    assert all(axes == SPLIT for _, axes in laid_out.values())


def build_softmax_lm(vocabulary: int = 64, width: int = 32) -> "keras.Model":
    """Tokens to next-token probabilities: a softmax output, as Keras'
    text-generation examples end."""
    import keras

    tokens = keras.Input((SEQUENCE,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, width, name="embed")(tokens)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = x + keras.layers.MultiHeadAttention(4, width // 4, name="attention")(x, x, use_causal_mask=True)
    return keras.Model(tokens, keras.layers.Dense(vocabulary, activation="softmax", name="head")(x))


@pytest.mark.parametrize(
    "loss",
    [
        "probabilities",  # the loss takes the softmax's logits back, as Keras does
        "ignore_class",
        "labels_with_a_last_dimension_of_one",
    ],
)
def test_losses_over_split_sequences_match_one_device(loss):
    """The per-position cross-entropy of context parallelism, through Keras'
    loss arguments; 37 rows at 8, with per-position sample weights."""
    import keras
    import numpy as np

    x, y = next_token_data(N, SEQUENCE, 64)
    weights = np.random.default_rng(3).uniform(0.5, 1.5, size=y.shape).astype("float32")
    if loss == "labels_with_a_last_dimension_of_one":
        y = y[..., None]
    keras_loss = keras.losses.SparseCategoricalCrossentropy(ignore_class=0 if loss == "ignore_class" else None)

    def compile_fn(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras_loss, metrics=["accuracy"])
        return model

    assert_parity(
        build_softmax_lm,
        x=x,
        y=y,
        strategy=context_parallel_strategy(megatron_layout_map, context_parallel=True),
        compile_fn=compile_fn,
        batch_size=BATCH,
        steps=-(-N // BATCH),
        zero_gradient=r"attention/key/bias",
        sample_weight=weights,
    )


def test_a_sequence_that_does_not_divide_is_a_named_error():
    strategy = context_parallel_strategy(context_parallel=True)
    with strategy.scope():
        model = compile_lm(build_transformer_lm(seq_len=7))
    x, y = next_token_data(16, 7, 64)
    with pytest.raises(ValueError, match=r"context_parallel splits the sequence of the output of layer "
                       r"'attention', shaped \(8, 7, 32\), over mesh axis 'sequence' of size 2, and 7 does "
                       r"not divide by 2"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"context_parallel": "batch"}, ValueError, r"context_parallel='batch' names the batch axis"),
        ({"context_parallel": "context"}, ValueError, r"'context'"),
        ({"context_parallel": 2}, TypeError, r"context_parallel must be True, False or a mesh axis name, got 2"),
        (
            {"context_parallel": True, "sequence_parallel": True},
            ValueError,
            r"both split the sequence, and DTensor splits a dimension over one mesh axis",
        ),
    ],
)
def test_bad_context_parallel_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        context_parallel_strategy(**kwargs)
