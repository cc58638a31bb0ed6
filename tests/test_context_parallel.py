"""Context parallelism: the sequence split over a "sequence" mesh axis
through the whole model, keys and values gathered whole in attention, with
one device's numbers.

Each program trains from one device's initial weights on a 2x2x2
("batch", "sequence", "model") mesh; the batches (37 rows at 8, or 13 at 4)
end with one the batch axis does not divide.
"""

import re

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


def hub_classifier_like_one_device(name: str):
    """KerasHub's backbone `name` under a pooled classifier, trained under
    context parallelism with `layout_map="auto"` and on one device (4 steps
    at batch 4, a last batch of 1): returns the mesh model."""
    from hub_backbones import pooled_classifier, pooled_classifier_data

    x, y = pooled_classifier_data(name=name)
    return assert_parity(
        lambda: pooled_classifier(name),
        x=x,
        y=y,
        strategy=context_parallel_strategy(lambda mesh: "auto", context_parallel="sequence"),
        batch_size=4,
        steps=4,
    )


def per_device_score_shapes(model, op: str = "Exp") -> set:
    """The shapes of the 4-D outputs of attention's `op` (by default the
    exponentiated scores; "Softmax" for Keras' own), and the 5-D ones of
    grouped heads (Gemma's own `(batch, key heads, groups, queries, keys)`),
    on each device, in the forward and backward passes of the model's first
    steps (the model's own ops, in its name scope: a model trained before
    it in the process may show too)."""
    own = re.compile(rf"(^|/){re.escape(model.name)}(_\d+)?/")
    return {
        shape
        for function in filter(is_train_step, first_step_graphs_of(model).function_graphs)
        for partition in function.partition_graphs
        for node in partition.node
        if node.op.endswith(op) and re.search("attention|attn", node.name) and own.search(node.name)
        and node.attr["_output_shapes"].list.shape
        and len(shape := tuple(dim.size for dim in node.attr["_output_shapes"].list.shape[0].dim)) in (4, 5)
    }


def test_megatron_lm_with_context_parallelism_matches_one_device():
    """The demo LM (causal mask) with Megatron's rules on "model": each
    device computes the scores of its half of the batch's rows, half of the
    heads and half of the queries against each half of the keys in turn
    (attention a block of keys at a time, `tfmp/lowering/attention.py`)."""
    model = demo_lm_like_one_device(
        context_parallel_strategy(context_parallel=True), compile_lm, N, BATCH, SEQUENCE, num_heads=HEADS
    )
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert laid_out == {
        f"transformer_lm/{name}": ("context_parallel='sequence'", SPLIT)
        for name in ("attention", "attention_norm", "ffn_norm")
    }
    batch_rows, heads = BATCH // 2, HEADS // 2
    block = (batch_rows, heads, SEQUENCE // 2, SEQUENCE // 2)
    # Blocks of scores, and the running maximum's rescaling of each query.
    assert per_device_score_shapes(model) == {block, block[:3] + (1,)}
    report = tfmp.comm_report(model, print_fn=lambda text: None)
    gathered = {
        (c.phase, c.op.rpartition("attention_1/")[2]): c.bytes
        for c in report.collectives
        if c.kind == "all-gather" and c.axes == ("sequence",)
    }
    # The key and the value of the one attention layer, each (4, 8, 4, 4)
    # float32 per device once gathered: their heads stay split over "model".
    # The backward pass gathers them again rather than keep them whole.
    key_bytes = batch_rows * SEQUENCE * heads * 4 * 4
    for phase in ("forward", "backward"):
        assert sorted(bytes_ for (p, _), bytes_ in gathered.items() if p == phase and bytes_ == key_bytes) == [
            key_bytes, key_bytes
        ], (phase, gathered)
    # The loss reads the (batch, sequence, vocabulary) logits where they are:
    # TensorFlow's op would gather their sequence to reshape positions into rows.
    assert not [op for _, op in gathered if "lm_head" in op or "crossentropy" in op], gathered


def test_flash_attention_turned_off_keeps_keras_attention():
    """`keras.config.disable_flash_attention()` turns the blockwise attention
    off: each device computes its queries' scores against every key at once
    with Keras' softmax, as one device does."""
    import keras

    keras.config.disable_flash_attention()
    try:
        model = demo_lm_like_one_device(
            context_parallel_strategy(context_parallel=True), compile_lm, N, BATCH, SEQUENCE, num_heads=HEADS
        )
    finally:
        keras.config.enable_flash_attention()  # Keras' default (None: not asked)
    assert (BATCH // 2, HEADS // 2, SEQUENCE // 2, SEQUENCE) in per_device_score_shapes(model, "Softmax")


@pytest.mark.parametrize(
    "name",
    [
        "GPT2Backbone",
        *(f"{name}Backbone" for name in ("Llama", "Mistral", "Phi3", "GPTNeoX", "SmolLM3", "Gemma")),
        *(f"{name}Backbone" for name in ("Qwen2", "QwenMoe", "Qwen3", "Qwen3Moe")),
        "Gemma4Backbone",
    ],
)
def test_keras_hub_backbone_with_context_parallelism_matches_one_device(name):
    """Padding masks (every third row padded) and causal masks; GPT-2's own
    dropout and position embedding, Llama's rotary embedding and grouped
    keys and values, Mistral's sliding window in its mask, Gemma's query
    scaling, Qwen 3's query and key norms and its sliding window (32768
    keys, wider than the sequence), the mixtures of experts, Gemma 4's query
    and key norms, unscaled scores and sliding window (8 keys, the
    sequence's length, in the decoder's mask); `layout_map="auto"` on
    "model". KerasHub's attention layers (`tfmp.lowering.hub_attention`)
    take the keys a block at a time: no device computes a softmax over every
    key. GPT-2's drops out its scores (dropout 0.1), so it keeps Keras'
    softmax."""
    model = hub_classifier_like_one_device(name)
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert any(re.search("attention|attn", path) for path in laid_out), laid_out
    assert all(axes == SPLIT for _, axes in laid_out.values())
    # Each device's queries (half the sequence), against every key or a
    # block of keys at a time (with the running maximum's rescaling).
    every_key = per_device_score_shapes(model, "Softmax")
    if name == "GPT2Backbone":
        assert every_key and {shape[-2:] for shape in every_key} == {(SEQUENCE // 2, SEQUENCE)}, every_key
        return
    assert not every_key, every_key
    blocks = {shape[-2:] for shape in per_device_score_shapes(model)}
    assert blocks == {(SEQUENCE // 2, SEQUENCE // 2), (SEQUENCE // 2, 1)}, blocks


@pytest.mark.parametrize(
    "name, attention",
    [
        ("DebertaV3Backbone", "disentangled_attention_encoder_layer_0/self_attention_layer"),
        ("ESMBackbone", "transformer_layer_0/attention_layer"),
    ],
)
def test_attention_computed_with_its_sequence_whole_matches_one_device(name, attention):
    """Attention that context parallelism cannot split by its queries
    computes with its inputs whole, every device's scores over every query
    (Keras' softmax, or KerasHub's fused path a block of keys at a time),
    and lays its output out split again, with one device's numbers.
    DeBERTa-v3's disentangled attention scores each query against
    embeddings of its distance to each key, gathered by relative position
    over the whole sequence (DTensor's reshapes of them stopped). ESM's has
    no `_compute_attention`; its inputs, laid out whole, keep DTensor's
    gradient (an explicit one made its `RelayoutLike` fail)."""
    model = hub_classifier_like_one_device(name)
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert laid_out[attention][1] == SPLIT, laid_out
    queries = {shape[-2] for op in ("Softmax", "Exp") for shape in per_device_score_shapes(model, op)}
    assert queries == {SEQUENCE}, queries


def token_regression_layouts(middle, path_part: str) -> list:
    """Trains Embedding -> `middle` -> Dense -> mean pooling -> Dense(1) under
    context parallelism ("auto", 2x2x2) like one device, 13 rows at batch 4
    (a last batch of 1 the batch axis does not divide); returns the layouts
    of the laid-out outputs whose path holds `path_part`."""
    import keras
    import numpy as np

    def build():
        tokens = keras.Input((SEQUENCE,), dtype="int32")
        x = middle(keras.layers.Embedding(50, 16)(tokens))
        x = keras.layers.Dense(16, activation="relu")(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(tokens, keras.layers.Dense(1)(x))

    rng = np.random.default_rng(0)
    model = assert_parity(
        build,
        x=rng.integers(0, 50, (13, SEQUENCE)).astype("int32"),
        y=rng.normal(size=(13, 1)).astype("float32"),
        strategy=context_parallel_strategy(lambda mesh: "auto", context_parallel="sequence"),
        batch_size=4,
        steps=4,
    )
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    return [axes for path, axes in laid_out.items() if path_part in path]


def test_a_norm_after_an_embedding_with_context_parallelism_matches_one_device():
    """A plain Keras model: Embedding plus KerasHub's PositionEmbedding (a
    slice of a learned table, whose gradient is a `Pad` DTensor cannot
    expand split: `tfmp/lowering/slicing.py`), LayerNormalization (its
    output split over the sequence, its gradient in that layout, also in
    the last batch of 1 row that runs whole over the batch axis: DTensor's
    own gradient of the relayout failed there), a shift by one position
    (`keras.ops.pad` of the split sequence), Dense, mean pooling."""
    import keras
    import keras_hub

    class ShiftByOne(keras.layers.Layer):
        def call(self, x):
            return x + keras.ops.pad(x, [[0, 0], [1, 0], [0, 0]])[:, :-1, :]

    def middle(x):
        x = x + keras_hub.layers.PositionEmbedding(2 * SEQUENCE)(x)
        return ShiftByOne()(keras.layers.LayerNormalization()(x))

    assert token_regression_layouts(middle, "layer_normalization") == [("context_parallel='sequence'", SPLIT)]


def test_a_time_mixing_recurrence_with_context_parallelism_matches_one_device():
    """A layer whose class name ends in `TimeMix`, as RWKV-7's time mixing,
    runs a recurrence over the time steps and stacks them with a
    TensorArray; context parallelism computes it with the sequence whole
    (DTensor cannot stack time steps of a split sequence) and lays its
    output out split."""
    import keras
    import tensorflow as tf

    class DecayTimeMix(keras.layers.Layer):
        def build(self, shape):
            self.projection = keras.layers.Dense(shape[-1])
            self.decay = self.add_weight(shape=(shape[-1],), initializer="zeros")

        def call(self, x):
            x = self.projection(x)
            decay = keras.ops.sigmoid(self.decay)
            state = keras.ops.zeros_like(x[:, 0])
            steps = tf.TensorArray(x.dtype, size=x.shape[1])
            for t in range(x.shape[1]):
                state = state * decay + x[:, t]
                steps = steps.write(t, state)
            return keras.ops.transpose(steps.stack(), [1, 0, 2])

    def middle(x):
        x = keras.layers.LayerNormalization()(x)
        return x + DecayTimeMix()(x)

    assert token_regression_layouts(middle, "time_mix") == [("context_parallel='sequence'", SPLIT)]


def test_keras_hub_linear_attention_with_context_parallelism_matches_one_device():
    """Qwen 3.5's linear attention (a causal convolution and a recurrence
    over chunks of the sequence, in its first layer) computes with the
    sequence whole and lays its output out split; its full attention layer
    (the second) takes the keys a block at a time."""
    model = hub_classifier_like_one_device("Qwen3_5Backbone")
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert {"transformer_layer_0/linear_attn", "transformer_layer_1/self_attention"} <= set(laid_out), laid_out
    assert all(axes == SPLIT for _, axes in laid_out.values())
    assert not per_device_score_shapes(model, "Softmax")
    full_attention = {shape[-2:] for shape in per_device_score_shapes(model) if shape[-2] == SEQUENCE // 2}
    assert full_attention == {(SEQUENCE // 2, SEQUENCE // 2), (SEQUENCE // 2, 1)}, full_attention


@pytest.mark.parametrize(
    "name, config",
    [
        # Qwen's own path alone applies its window, here narrower than the keys.
        ("Qwen3Backbone", dict(head_dim=4, sliding_window_size=4)),
        # GPT-NeoX's own path drops out its probabilities.
        ("GPTNeoXBackbone", dict(num_heads=4, max_sequence_length=16, rotary_percentage=0.5, dropout=0.1)),
        # Gemma 2's soft cap, which Keras' op takes on JAX's TPUs only.
        ("GemmaBackbone", dict(head_dim=4, attention_logit_soft_cap=50.0)),
        # Gemma's own path drops out its probabilities, with Keras' einsums
        # (`tfmp.lowering.arrays.einsum`) over 5-D scores.
        ("GemmaBackbone", dict(head_dim=4, dropout=0.1)),
    ],
)
def test_keras_hub_attention_keeps_its_own_softmax_where_the_fused_path_differs(name, config):
    """Where KerasHub's fused path would compute something else than its
    own (a sliding window the fused path ignores, dropout on the scores, a
    logit soft cap), the layer keeps its own softmax over every key under
    context parallelism, with one device's numbers."""
    import keras
    import keras_hub
    from hub_backbones import GROUPED, TEXT, pooled_classifier_data

    def build():
        sizes = TEXT if name == "GPTNeoXBackbone" else GROUPED
        backbone = getattr(keras_hub.models, name)(**sizes, **config)
        pooled = keras.layers.GlobalAveragePooling1D()(backbone.output)
        return keras.Model(backbone.input, keras.layers.Dense(4)(pooled), name="own_softmax")

    x, y = pooled_classifier_data()
    model = assert_parity(
        build,
        x=x,
        y=y,
        strategy=context_parallel_strategy(lambda mesh: "auto", context_parallel="sequence"),
        batch_size=4,
        steps=4,
    )
    assert {shape[-2:] for shape in per_device_score_shapes(model, "Softmax")} == {(SEQUENCE // 2, SEQUENCE)}


def test_keras_hub_finds_no_fused_attention_op_on_tensorflow():
    """Canary of `tfmp.lowering.hub_attention`: when KerasHub takes
    `ops.dot_product_attention` on TensorFlow itself, its patches can go."""
    from keras_hub.src.utils.keras_utils import fused_attention_op_available

    assert not fused_attention_op_available()


def test_keras_hub_causal_lm_with_auto_layout_matches_one_device():
    """KerasHub's GPT2CausalLM (its embedding tied as the LM head, its own
    loss and metric, dropout 0.1) from `layout_map="auto"` alone on a
    ("batch", "sequence", "model") mesh, which turns context parallelism on;
    padded positions weighted 0; 13 rows at batch 4."""
    import keras
    import keras_hub
    from hub_backbones import BACKBONES
    from test_keras_interop import token_data

    def compile_fn(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01))
        return model

    x, y, padding_mask = token_data(n=13)
    strategy = tfmp.ModelParallelStrategy(mesh((2, 2, 2), AXES), "auto")
    model = assert_parity(
        lambda: keras_hub.models.GPT2CausalLM(backbone=BACKBONES["GPT2Backbone"](), preprocessor=None),
        x=x,
        y=y,
        strategy=strategy,
        compile_fn=compile_fn,
        batch_size=4,
        steps=4,
        sample_weight=padding_mask,
    )
    assert strategy.context_parallel_axis == "sequence"
    laid_out = model.distribute_strategy.layout_map.laid_out_outputs()
    assert any(path.endswith("self_attention") for path in laid_out), laid_out


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


def build_grouped_query_lm(vocabulary: int = 64, width: int = 32) -> "keras.Model":
    """Tokens to next-token logits through grouped-query attention (4 query
    heads, 2 key and value heads), causal, with the padding mask of token 0."""
    import keras

    tokens = keras.Input((SEQUENCE,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, width, mask_zero=True, name="embed")(tokens)
    attention = keras.layers.GroupQueryAttention(
        head_dim=width // 4, num_query_heads=4, num_key_value_heads=2, name="attention"
    )
    x = keras.layers.LayerNormalization(name="norm")(x + attention(x, x, use_causal_mask=True))
    return keras.Model(tokens, keras.layers.Dense(vocabulary, name="head")(x))


def test_grouped_query_attention_with_padding_matches_one_device():
    """Keras' GroupedQueryAttention a block of keys at a time: its keys and
    values repeated per group, its causal mask and the padding mask of the
    embedding (the rows of a padded query mask every key, and attend to all
    evenly, as Keras' softmax makes them); 37 rows at 8, `layout_map="auto"`."""
    import keras

    x, y = next_token_data(N, SEQUENCE, 64)
    x[::3, -3:] = 0  # padding at the end of every third row
    assert_parity(
        build_grouped_query_lm,
        x=x,
        y=y,
        strategy=context_parallel_strategy(lambda mesh: "auto", context_parallel=True),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        batch_size=BATCH,
        steps=-(-N // BATCH),
        zero_gradient=r"attention/key/bias",
    )


@pytest.mark.parametrize("masks", ["causal", "padding", "causal_and_padding", "none"])
def test_attention_a_block_of_keys_at_a_time_matches_keras(masks):
    """The blockwise attention and its backward pass against Keras' own
    `dot_product_attention` on one device, in float64: queries whose keys
    are all masked included (they attend to every key evenly)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmp.lowering import attention
    from tfmp.lowering.registry import keras_original

    rng = np.random.default_rng(0)
    q, k, v = (tf.constant(rng.normal(size=(2, 8, 3, 4))) for _ in range(3))
    mask = None
    if "padding" in masks:
        keep = rng.uniform(size=(2, 1, 8, 8)) > 0.3
        keep[0, :, 2, :] = False  # a query that sees no key
        mask = tf.constant(keep)
    causal = "causal" in masks
    upstream = tf.constant(rng.normal(size=(2, 8, 3, 4)))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = fn()
        return [out, *tape.gradient(out, [q, k, v], output_gradients=upstream)]

    keras_attention = keras_original("keras.src.backend.tensorflow.nn", "dot_product_attention")
    want = run(lambda: keras_attention(q, k, v, mask=mask, scale=0.5, is_causal=causal))
    got = run(lambda: attention._blockwise_attention(q, k, v, mask, 0.5, causal, blocks=4))
    for name, a, b in zip(("output", "query", "key", "value"), got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-12, err_msg=name)
    assert keras.backend.standardize_dtype(got[0].dtype) == "float64"


@pytest.mark.parametrize(
    "queries, keys, devices, blocks",
    [
        (8, 8, 2, 2),
        (1024, 1024, 2, 2),  # 512 queries x 512 keys per device
        (2048, 2048, 2, 8),  # 1024 x 256
        (4096, 4096, 8, 8),  # 512 x 512
        (1536, 1536, 2, 8),  # 768 x 192
        (12288, 12288, 8, 64),  # 1536 x 192: 96 keys would be narrower than 128
        (1030, 1030, 2, 2),  # 515 x 515: 515 is odd
        (64, 8192, 8, 8),  # 8 x 1024: few queries, wide blocks
    ],
)
def test_a_blocks_scores_stay_within_512_by_512_where_the_keys_divide(queries, keys, devices, blocks):
    """Each device's part of the keys, halved while a block's scores per
    batch row and head exceed 512 x 512, the halves divide and are at least
    128 keys wide."""
    from tfmp.lowering.attention import key_blocks

    assert key_blocks(queries, keys, devices) == blocks


def test_a_sequence_that_does_not_divide_is_a_named_error():
    strategy = context_parallel_strategy(context_parallel=True)
    with strategy.scope():
        model = compile_lm(build_transformer_lm(seq_len=7))
    x, y = next_token_data(16, 7, 64)
    with pytest.raises(ValueError, match=r"context_parallel splits the sequence of the output of layer "
                       r"'attention', shaped \(8, 7, 32\), over mesh axis 'sequence' of size 2, and 7 does "
                       r"not divide by 2"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_a_model_context_parallelism_cannot_split_yet_says_to_turn_it_off():
    """XLNet: DTensor's collectives fail on a reshape (DTensor's own
    "'tf.Reshape' op requires 'output' number of elements to match") at the
    first step (docs/tensor-parallel.md names the models known so). The
    error says what to try first."""
    import numpy as np
    from hub_backbones import pooled_classifier, pooled_classifier_data

    with context_parallel_strategy(lambda mesh: "auto", context_parallel="sequence").scope():
        model = pooled_classifier("XLNetBackbone")
        model.compile(optimizer="adam", loss="mse")
    x, y = pooled_classifier_data()
    x["segment_ids"] = np.zeros_like(x["token_ids"])
    with pytest.raises(
        ValueError, match=r"Reshape(.|\n)*context_parallel splits this model's sequences over mesh axis "
        r"'sequence'(.|\n)*train with context_parallel=False"
    ):
        model.fit(x, y, batch_size=4, verbose=0)


@pytest.mark.parametrize(
    "layout_map, kwargs, axis",
    [
        ("auto", {}, "sequence"),
        ("auto", {"context_parallel": False}, None),
        (megatron_layout_map, {}, None),
        ("auto", {"sequence_parallel": True}, None),
    ],
    ids=["auto", "auto-turned-off", "layout-map", "auto-with-sequence-parallel"],
)
def test_auto_layout_turns_context_parallelism_on_over_a_sequence_axis(layout_map, kwargs, axis):
    """With `layout_map="auto"`, a "sequence" axis (which nothing else
    splits) gets context parallelism unless it is turned off or sequence
    parallelism is on; with the user's own rules it stays as asked."""
    strategy = context_parallel_strategy(layout_map if callable(layout_map) else lambda mesh: layout_map, **kwargs)
    assert strategy.context_parallel_axis == axis


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


@pytest.mark.parametrize("option", ["context_parallel", "sequence_parallel"])
def test_splitting_sequences_inside_a_pipeline_is_a_named_error(option):
    """A pipeline's training step with the sequence split inside its stages
    fails in DTensor (a loss reduction across the stages' meshes): tfmp says
    so when the strategy is made, and `"auto"` leaves context parallelism
    off on a mesh with a stage axis."""
    axes = ("stage", "batch", "sequence", "model")
    device_mesh = mesh((2, 1, 2, 2), axes)
    with pytest.raises(ValueError, match=rf"{option} splits sequences over mesh axis '\w+', and this mesh "
                       r"has the pipeline axis 'stage'.*Pass " + option + "=False"):
        tfmp.ModelParallelStrategy(device_mesh, "auto", **{option: True})
    assert tfmp.ModelParallelStrategy(device_mesh, "auto").context_parallel_axis is None
