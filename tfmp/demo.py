"""`tfmp demo`: a small Transformer LM trained with `model.fit` on a 2x4 mesh.

The model is ordinary Keras; the parallel plan is the table `megatron_rules`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import tfmp

# Megatron-style tensor parallelism as data: variable-path regex -> mesh axes.
# Attention is split by heads, the FFN column- then row-parallel, and the
# embedding and the vocabulary head by vocabulary.
MEGATRON_RULES = {
    r"token_embedding/embeddings": ("model", None),
    r"(query|key|value)/kernel": (None, "model", None),
    r"(query|key|value)/bias": ("model", None),
    r"attention_output/kernel": ("model", None, None),
    r"ffn_in/kernel": (None, "model"),
    r"ffn_in/bias": ("model",),
    r"ffn_out/kernel": ("model", None),
    r"lm_head/kernel": (None, "model"),
    r"lm_head/bias": ("model",),
}


def build_transformer_lm(
    vocab_size: int = 64,
    seq_len: int = 8,
    d_model: int = 32,
    num_heads: int = 8,
    ffn_dim: int = 64,
    dropout: float = 0.0,
) -> Any:
    """A one-block causal Transformer language model in plain Keras."""
    import keras

    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab_size, d_model, name="token_embedding")(tokens)
    attention = keras.layers.MultiHeadAttention(
        num_heads, d_model // num_heads, dropout=dropout, name="attention"
    )
    x = keras.layers.LayerNormalization(name="attention_norm")(
        x + attention(x, x, use_causal_mask=True)
    )
    h = keras.layers.Dense(ffn_dim, activation="gelu", name="ffn_in")(x)
    h = keras.layers.Dense(d_model, name="ffn_out")(h)
    x = keras.layers.LayerNormalization(name="ffn_norm")(x + h)
    logits = keras.layers.Dense(vocab_size, name="lm_head")(x)
    return keras.Model(tokens, logits, name="transformer_lm")


def megatron_layout_map(mesh: tfmp.DeviceMesh) -> tfmp.LayoutMap:
    """The `MEGATRON_RULES` as a `tfmp.LayoutMap` on `mesh`."""
    layout_map = tfmp.LayoutMap(mesh)
    for rule, axes in MEGATRON_RULES.items():
        layout_map[rule] = axes
    return layout_map


def next_token_data(
    num_sequences: int, seq_len: int, vocab_size: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Sequences that count up modulo the vocabulary from random starts."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab_size, size=(num_sequences, 1))
    tokens = (starts + np.arange(seq_len + 1)) % vocab_size
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")


def run(
    mesh_shape: tuple[int, int] = (2, 4),
    epochs: int = 3,
    print_fn: Any = print,
    verbose: int | str = "auto",
) -> list[float]:
    """Trains the demo LM on a ("batch", "model") mesh; returns epoch losses.

    `verbose` is `model.fit`'s: with it Keras shows its progress bar and tfmp
    how long laying out the first step took."""
    import keras

    import tensorflow as tf

    needed = mesh_shape[0] * mesh_shape[1]
    accelerators = [
        d for kind in ("TPU", "GPU") for d in tf.config.list_physical_devices(kind)
    ]
    devices = None
    if len(accelerators) < needed:
        devices = tfmp.simulate_devices(max(needed, 8))[:needed]
    mesh = tfmp.DeviceMesh(mesh_shape, ("batch", "model"), devices)
    strategy = tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh))
    print_fn(f"mesh: {mesh}")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_transformer_lm()
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = next_token_data(512, seq_len=8, vocab_size=64)
    history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=verbose)
    tfmp.summary(model, print_fn=print_fn)
    for epoch, (loss, accuracy) in enumerate(
        zip(history.history["loss"], history.history["accuracy"]), start=1
    ):
        print_fn(f"epoch {epoch}: loss {loss:.4f}, accuracy {accuracy:.3f}")
    return history.history["loss"]
