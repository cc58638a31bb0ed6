"""Recurrent layers and sequence reversal on a mesh: parity with one device."""

import functools
import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src import backend
from tensorflow.experimental import dtensor

import tfmp
from helpers import (
    BatchLosses,
    MinimalCell,
    PatchesHeld,
    assert_parity,
    assert_weights_close,
    initial_weights,
    mesh,
    rules,
    strategy_on,
)
from tfmp.forward import forward_on
from tfmp.layout import replicated
from tfmp.lowering import rnn as rnn_lowering
from tfmp.lowering import rnn_loop
from tfmp.lowering import time_steps as time_steps_module
from tfmp.lowering.registry import keras_original

SEQ, FEATURES, BATCH = 3, 3, 12  # 3 training steps of 4 rows

# Gate units (columns) of each recurrent kernel split over "model": Megatron's
# column split of each gate's matmul.
LSTM_GATES = {"lstm_cell/(recurrent_)?kernel": (None, "model"), "lstm_cell/bias": ("model",)}
GRU_GATES = {  # GRU's bias is (input, recurrent) x gate units
    "gru_cell/(recurrent_)?kernel": (None, "model"),
    "gru_cell/bias": (None, "model"),
}
SIMPLE_RNN_UNITS = {
    "simple_rnn_cell/(recurrent_)?kernel": (None, "model"),
    "simple_rnn_cell/bias": ("model",),
}


def sequences(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(BATCH, SEQ, FEATURES)).astype("float32"),
        rng.normal(size=(BATCH, 2)).astype("float32"),
    )


@pytest.mark.parametrize("go_backwards", [False, True], ids=["forward", "backwards"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("zero_output_for_mask", [False, True], ids=["keep", "zero"])
@pytest.mark.parametrize("return_all_outputs", [False, True], ids=["last", "all"])
@pytest.mark.parametrize("time_major", [False, True], ids=["batch_major", "time_major"])
def test_rnn_matches_keras_loop(go_backwards, masked, zero_output_for_mask, return_all_outputs, time_major):
    """Off a mesh, against Keras' while loop, with nested inputs and
    constants: the outputs, and the gradients of the inputs, the initial
    states, the constants and a variable the step reads. In float64, to
    1e-12: the gradients add up each step's part in another order than
    Keras' loop (float32: up to 7e-6 relative apart; float64: 7e-15), and
    TensorFlow's graph optimizer fuses the two loops' ops differently (1 ulp)."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(3, 5, 2)), tf.float64)
    mask = tf.constant([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 0, 1, 1]]) > 0
    kernel = tf.Variable(rng.normal(size=(2, 2)), dtype=tf.float64)
    bias = tf.constant(rng.normal(size=(3, 2)), tf.float64)
    initial_states = [tf.constant(rng.normal(size=(3, 2)), tf.float64), tf.ones((3, 2), tf.float64)]

    def step(inputs, states):
        output = tf.tanh(inputs[0] @ kernel + inputs[1] + states[0] + states[2])
        return output, [output, states[1] * output]

    if time_major:
        x, mask = tf.transpose(x, (1, 0, 2)), tf.transpose(mask)

    @tf.function  # as in a training step: eagerly the recurrence is unrolled
    def run(rnn):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, bias, *initial_states])
            results = rnn(
                step_function=step,
                inputs=(x, 2 * x),
                initial_states=initial_states,
                go_backwards=go_backwards,
                mask=mask if masked else None,
                constants=[bias],
                input_length=5,  # Keras' loop reads it off axis 1 otherwise, even time-major
                time_major=time_major,
                zero_output_for_mask=zero_output_for_mask,
                return_all_outputs=return_all_outputs,
            )
            flat = tf.nest.flatten(results)
            loss = sum(tf.reduce_sum(r * (i + 1.0)) for i, r in enumerate(flat))
        return flat, tape.gradient(loss, [x, bias, kernel, *initial_states])

    want, want_gradients = run(importlib.import_module("keras.src.backend.tensorflow.rnn").rnn)
    got, got_gradients = run(rnn_lowering.rnn)
    for expected, actual in zip(want + want_gradients, got + got_gradients, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.fixture
def block_sizes(monkeypatch) -> list:
    """Loops of any length, whatever their rows' bytes, run in blocks
    (`tfmp.lowering.time_steps`); the block sizes taken, one per loop."""
    sizes = []
    block_size = time_steps_module._block_size
    monkeypatch.setattr(time_steps_module, "_LONGEST_UNBLOCKED", 0)
    monkeypatch.setattr(time_steps_module, "_FEWEST_BYTES_BLOCKED", 0)
    monkeypatch.setattr(time_steps_module, "_block_size", lambda *size: sizes.append(block_size(*size)) or sizes[-1])
    return sizes


@pytest.mark.parametrize("go_backwards", [False, True], ids=["forward", "backwards"])
@pytest.mark.parametrize("time_steps", [5, 8], ids=["whole_blocks", "short_last_block"])
def test_long_recurrences_run_in_blocks_as_keras_loop(time_steps, go_backwards, block_sizes):
    """A long loop runs in blocks of about sqrt(time) steps
    (`tfmp.lowering.time_steps`), here from 5 and 8 time steps on: blocks of
    2 and 3 steps after the first, the last block of 8 steps one step
    short. Masked sequences off a mesh against Keras' loop, outputs and
    gradients, in float64 to 1e-12 as `test_rnn_matches_keras_loop`."""
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(3, time_steps, 2)), tf.float64)
    mask = tf.constant(rng.random((3, time_steps)) > 0.3)
    kernel = tf.Variable(rng.normal(size=(2, 2)), dtype=tf.float64)
    initial_states = [tf.constant(rng.normal(size=(3, 2)), tf.float64)]

    def step(inputs, states):
        output = tf.tanh(inputs @ kernel + states[0])
        return output, [output]

    @tf.function
    def run(rnn):
        with tf.GradientTape() as tape:
            tape.watch([x, *initial_states])
            last, outputs, states = rnn(step, x, initial_states, go_backwards=go_backwards, mask=mask)
            loss = tf.reduce_sum(last) + tf.reduce_sum(outputs * outputs) + 3.0 * tf.reduce_sum(states[0])
        return [last, outputs, *states], tape.gradient(loss, [x, kernel, *initial_states])

    want, want_gradients = run(importlib.import_module("keras.src.backend.tensorflow.rnn").rnn)
    got, got_gradients = run(rnn_lowering.rnn)
    assert block_sizes == [{5: 2, 8: 3}[time_steps]] * 2  # forward and backward
    for expected, actual in zip(want + want_gradients, got + got_gradients, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


def _traced_gradient(rnn, time_steps: int, step) -> tf.Graph:
    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            last, _, _ = rnn(step, x, [tf.zeros((4, 2))])
        return tape.gradient(last, x)

    return tf.function(gradient).get_concrete_function(tf.TensorSpec((4, time_steps, 2))).graph


def _elman(inputs, states):
    output = tf.tanh(inputs + states[0])
    return output, [output]


def _loops(graph: tf.Graph) -> int:
    return sum(op.type in ("While", "StatelessWhile") for op in graph.get_operations())


def test_recurrence_is_one_loop_whatever_its_length(monkeypatch):
    """The traced step and its gradient do not grow with the sequence: two
    loops (forward, and backward in the gradient) of one step each, or, over
    32 time steps (here whatever the rows' bytes), two loops of blocks."""
    monkeypatch.setattr(time_steps_module, "_FEWEST_BYTES_BLOCKED", 0)

    sizes = {
        steps: len(_traced_gradient(rnn_lowering.rnn, steps, _elman).get_operations()) for steps in (4, 32, 128, 512)
    }
    assert sizes[4] == sizes[32] and sizes[128] == sizes[512], sizes
    assert _loops(_traced_gradient(rnn_lowering.rnn, 4, _elman)) == 1  # the gradient's loop is in a function


def test_step_that_draws_random_numbers_is_unrolled():
    """Running it again in the gradient would draw other numbers."""
    generator = keras.random.SeedGenerator(1)

    def step(inputs, states):
        return _elman(inputs + keras.random.normal((4, 2), seed=generator), states)

    graph = _traced_gradient(rnn_lowering.rnn, 4, step)
    assert _loops(graph) == 0
    assert len(graph.get_operations()) < len(_traced_gradient(rnn_lowering.rnn, 8, step).get_operations())


def test_step_reading_a_watched_tensor_is_unrolled_with_its_gradient():
    """A tensor the step reads (not an argument) whose gradient is asked for:
    unrolled, so that the gradient reaches it."""
    x = tf.constant(np.random.default_rng(1).normal(size=(4, 3, 2)), tf.float32)

    @tf.function
    def gradients(rnn, scale):
        with tf.GradientTape() as tape:
            tape.watch(scale)
            last, _, _ = rnn(lambda inputs, states: _elman(scale * inputs, states), x, [tf.zeros((4, 2))])
        return tape.gradient(last, scale)

    want = gradients(importlib.import_module("keras.src.backend.tensorflow.rnn").rnn, tf.constant(1.5))
    np.testing.assert_allclose(gradients(rnn_lowering.rnn, tf.constant(1.5)), want, rtol=1e-6)


def build_recurrent_stack() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((SEQ, FEATURES)),
            keras.layers.LSTM(4, return_sequences=True, name="lstm"),
            keras.layers.GRU(4, return_sequences=True, name="gru"),
            keras.layers.SimpleRNN(4, name="simple_rnn"),
            keras.layers.Dense(2, name="head"),
        ]
    )


def test_lstm_gru_simple_rnn_gates_split():
    assert_parity(
        build_recurrent_stack,
        rules({**LSTM_GATES, **GRU_GATES, **SIMPLE_RNN_UNITS}),
        *sequences(0),
    )


def build_two_layer(layer) -> keras.Model:
    tokens = keras.Input((SEQ * 2,), dtype="int32")
    x = keras.layers.Embedding(10, 4, mask_zero=True, name="embedding")(tokens)
    x = layer(4, return_sequences=True, name="first")(x)
    x = layer(4, name="second")(x)
    return keras.Model(tokens, keras.layers.Dense(2, name="head")(x))


def _batch_collectives_in_loops(model) -> list[str]:
    collectives = tfmp.comm_report(model, print_fn=lambda text: None).collectives
    return [c.op for c in collectives if "while/" in c.op and "batch" in c.axes]


def _gru_with_dropout(units, **kwargs):
    return keras.layers.GRU(units, dropout=0.25, recurrent_dropout=0.25, **kwargs)


@pytest.mark.parametrize(
    "layer,gates,mesh_shape",
    [
        (keras.layers.GRU, GRU_GATES, (8, 1)),
        (keras.layers.GRU, GRU_GATES, (2, 4)),
        (_gru_with_dropout, GRU_GATES, (8, 1)),
        (keras.layers.LSTM, LSTM_GATES, (8, 1)),
        (keras.layers.LSTM, LSTM_GATES, (2, 4)),
        (keras.layers.SimpleRNN, SIMPLE_RNN_UNITS, (8, 1)),
        (keras.layers.SimpleRNN, SIMPLE_RNN_UNITS, (2, 4)),
    ],
    ids=["gru-8x1", "gru-2x4", "gru_dropout-8x1", "lstm-8x1", "lstm-2x4", "simple_rnn-8x1", "simple_rnn-2x4"],
)
def test_weights_gradient_is_reduced_over_the_batch_once_per_step(layer, gates, mesh_shape, monkeypatch):
    """A recurrence's weights gradient sums over time steps and rows. Over a
    split batch, no step of the backward loop all-reduces it over "batch":
    a GRU reads slices of its bias, whose gradient DTensor all-reduces in
    every iteration on 8x1 (shown below with the gradient taken step by step;
    on 2x4, with the bias split over "model", it did not), and takes it over
    all time steps at once after the loop, its dropout masks repeated for
    every step; an LSTM's and a SimpleRNN's stay partial sums through the
    loop. Masked sequences, 25 rows at batch 8 (a last batch of 1, traced
    with an unknown batch and so unrolled: the SimpleRNN's masked steps on 2x4
    stopped there while Grappler rewrote the step with whole kernel shapes,
    tfmp/strategy/grappler.py)."""
    rng = np.random.default_rng(6)
    tokens = rng.integers(1, 10, size=(25, SEQ * 2)).astype("int32")
    tokens[::3, 4:] = 0
    y = rng.normal(size=(25, 2)).astype("float32")

    def fit():
        return assert_parity(
            lambda: build_two_layer(layer), rules(gates), tokens, y, mesh_shape=mesh_shape, steps=4, batch_size=8
        )

    assert not _batch_collectives_in_loops(fit())
    if layer is keras.layers.GRU and mesh_shape == (8, 1):
        monkeypatch.setattr(rnn_lowering, "_row_wise_cells", lambda step_function: None)
        assert _batch_collectives_in_loops(fit())


def build_gate_wise() -> keras.Model:
    """Keras' gate-wise cells (implementation 2) of every kind: a GRU with
    its reset gate after the product and input dropout, one with it before
    the product running backwards, an LSTM with input dropout, a masked
    sequence through all three."""
    tokens = keras.Input((SEQ * 2,), dtype="int32")
    x = keras.layers.Embedding(10, 4, mask_zero=True, name="embedding")(tokens)
    x = keras.layers.GRU(4, dropout=0.25, return_sequences=True, name="gru_after")(x)
    x = keras.layers.GRU(4, reset_after=False, go_backwards=True, return_sequences=True, name="gru_before")(x)
    x = keras.layers.LSTM(4, dropout=0.25, name="lstm")(x)
    return keras.Model(tokens, keras.layers.Dense(2, name="head")(x))


def test_lstm_and_gru_split_on_gate_units_run_gate_by_gate(monkeypatch):
    """With its gate units split over "model" (`layout_map="auto"`), each
    recurrence runs gate by gate (`tfmp.lowering.rnn_gates`): a device
    computes its units of every gate, and a time step gathers the previous
    output once going forward and once again going backward, and reduces
    its gradient once: three collectives a step where the gate-straddling
    cuts of Keras' cells took six (a GRU's). Masked sequences, 25 rows at
    batch 8 on 2x4 (a last batch of 1)."""
    from tfmp.lowering import rnn_gates

    gate_wise = []
    recurrence = rnn_gates.gate_wise_recurrence

    def recorded(step_function, cell, *args):
        gate_wise.append(cell.name)
        return recurrence(step_function, cell, *args)

    monkeypatch.setattr(rnn_lowering, "gate_wise_recurrence", recorded)
    rng = np.random.default_rng(8)
    tokens = rng.integers(1, 10, size=(25, SEQ * 2)).astype("int32")
    tokens[::3, 4:] = 0
    y = rng.normal(size=(25, 2)).astype("float32")
    model = assert_parity(build_gate_wise, lambda mesh: "auto", tokens, y, steps=4, batch_size=8)
    assert set(gate_wise) == {"gru_cell", "lstm_cell"} and len(gate_wise) >= 3
    collectives = tfmp.comm_report(model, print_fn=lambda text: None).collectives
    in_loops = [c for c in collectives if "while/" in c.op]
    assert len(in_loops) == 3 * 3, [c.op for c in in_loops]


@pytest.mark.parametrize(
    "build,layout_map,mesh_shape,collectives_in_loops",
    [
        (lambda: build_two_layer(keras.layers.GRU), rules(GRU_GATES), (8, 1), 0),
        (lambda: build_two_layer(keras.layers.LSTM), rules(LSTM_GATES), (8, 1), 0),
        # The gate-wise steps' 3 per layer, and per layer one gather of the
        # forward loop's carry as each block's loop starts.
        (build_gate_wise, lambda mesh: "auto", (2, 4), 3 * 3 + 3),
    ],
    ids=["gru-8x1", "lstm-8x1", "gate_wise-2x4"],
)
def test_long_sequences_run_in_blocks_as_one_device(build, layout_map, mesh_shape, collectives_in_loops, block_sizes):
    """Loops in blocks on a mesh (`tfmp.lowering.time_steps`, here from 6
    time steps on: two blocks of 3 steps after the first, the second one
    short): GRUs over a split batch, whose backward loop also writes what
    flows into each step for the weights' gradient after it; LSTMs, whose
    backward loop sums that gradient; gate-wise GRUs (one backwards) and an
    LSTM with their gate units split over "model". The weights' gradients
    stay partial sums over "batch" through the blocks (no all-reduce in the
    loops but the gate-wise steps' own, as in
    `test_lstm_and_gru_split_on_gate_units_run_gate_by_gate`): carried into
    a block's loop, DTensor all-reduced an LSTM's in every step. Masked
    sequences, 17 rows at batch 8 (a last batch of 1, traced with an
    unknown batch and so unrolled)."""
    rng = np.random.default_rng(9)
    tokens = rng.integers(1, 10, size=(17, SEQ * 2)).astype("int32")
    tokens[::3, 4:] = 0
    y = rng.normal(size=(17, 2)).astype("float32")
    model = assert_parity(build, layout_map, tokens, y, mesh_shape=mesh_shape, steps=3, batch_size=8)
    assert 3 in block_sizes
    collectives = tfmp.comm_report(model, print_fn=lambda text: None).collectives
    in_loops = [c.op for c in collectives if "while/" in c.op]
    assert len(in_loops) == collectives_in_loops, in_loops


@pytest.mark.parametrize("layer", [keras.layers.GRU, _gru_with_dropout], ids=["gru", "gru_dropout"])
def test_one_device_mesh_takes_the_weights_gradient_in_the_backward_loop(layer, monkeypatch):
    """On a one-device mesh nothing is all-reduced, so a GRU's weights
    gradient is summed in the backward loop: its steps do not run again as
    rows after the loop (which made the zoo GRU's step 1.2x as long).
    Masked sequences, 25 rows at batch 8."""
    rows_runs = []
    as_rows = rnn_loop._as_rows
    monkeypatch.setattr(rnn_loop, "_as_rows", lambda buffer: rows_runs.append(buffer) or as_rows(buffer))
    rng = np.random.default_rng(7)
    tokens = rng.integers(1, 10, size=(25, SEQ * 2)).astype("int32")
    tokens[::3, 4:] = 0
    y = rng.normal(size=(25, 2)).astype("float32")
    assert_parity(lambda: build_two_layer(layer), None, tokens, y, mesh_shape=(1, 1), steps=4, batch_size=8)
    assert not rows_runs
    assert_parity(lambda: build_two_layer(layer), rules(GRU_GATES), tokens, y, mesh_shape=(8, 1), steps=4, batch_size=8)
    assert rows_runs


def test_row_wise_cells_are_keras_own_and_anything_else_is_not():
    """The weights gradient is taken after the loop only for Keras' own
    cells, found in the step Keras' RNN layer passes; a step of any other
    kind (a partial, a plain function, a cell of the user's own) is not."""
    steps = []

    def recorded(step_function, *args, **kwargs):
        steps.append(step_function)
        return keras_original("keras.src.backend.tensorflow.rnn", "rnn")(step_function, *args, **kwargs)

    x = np.zeros((2, 3, 4), "float32")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "rnn", recorded)
        for layer in (keras.layers.GRU(2), keras.layers.RNN(keras.layers.StackedRNNCells([MinimalCell(2)]))):
            layer(x)
    gru, custom = (rnn_lowering._row_wise_cells(step) for step in steps)
    assert [type(cell) for cell in gru] == [keras.layers.GRUCell]
    assert custom is None
    assert rnn_lowering._row_wise_cells(functools.partial(_elman)) is None
    assert rnn_lowering._row_wise_cells(_elman) is None


def build_cells() -> keras.Model:
    cells = [
        MinimalCell(4),
        keras.layers.LSTMCell(4),
        keras.layers.GRUCell(4),
        keras.layers.SimpleRNNCell(4),
    ]
    return keras.Sequential(
        [
            keras.Input((SEQ, FEATURES)),
            keras.layers.RNN(keras.layers.StackedRNNCells(cells), name="stacked"),
            keras.layers.Dense(2, name="head"),
        ]
    )


def test_custom_and_stacked_cells_batch_split_only():
    assert_parity(build_cells, rules({}), *sequences(1))


def build_bidirectional_with_states() -> keras.Model:
    x = keras.Input((SEQ, FEATURES))
    # The backward LSTM runs with go_backwards=True; Bidirectional flips its
    # sequence back (ops.flip).
    outputs, *states = keras.layers.Bidirectional(
        keras.layers.LSTM(4, return_sequences=True, return_state=True), name="bidirectional"
    )(x)
    summary = keras.layers.Concatenate()([keras.layers.Flatten()(outputs), *states])
    return keras.Model(x, keras.layers.Dense(2, name="head")(summary))


def test_bidirectional_go_backwards_and_states_1x8():
    assert_parity(
        build_bidirectional_with_states, rules(LSTM_GATES), *sequences(2), mesh_shape=(1, 8)
    )


def build_masked() -> keras.Model:
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(10, 4, mask_zero=True, name="embedding")(tokens)
    x = keras.layers.Bidirectional(
        keras.layers.LSTM(4, return_sequences=True), name="bidirectional"
    )(x)
    x = keras.layers.GlobalAveragePooling1D()(x)  # over unmasked steps
    return keras.Model(tokens, keras.layers.Dense(2, name="head")(x))


def test_masked_sequences():
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 10, size=(BATCH, SEQ)).astype("int32")
    tokens[::2, 2:] = 0  # right padding
    tokens[1::4, :1] = 0  # left padding
    tokens[3, 1] = 0  # a gap
    y = rng.normal(size=(BATCH, 2)).astype("float32")
    assert_parity(build_masked, rules(LSTM_GATES), tokens, y)


def build_conv_lstm() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((SEQ, 2, 5, 2)),
            # 1x3: few kernel taps (tfmp's convolutions on a mesh are sums over taps).
            keras.layers.ConvLSTM2D(4, (1, 3), padding="same", name="conv_lstm"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2, name="head"),
        ]
    )


def test_conv_lstm_2d_replicated():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(BATCH, SEQ, 2, 5, 2)).astype("float32")
    y = rng.normal(size=(BATCH, 2)).astype("float32")
    assert_parity(build_conv_lstm, rules({}), x, y)


class Doubled(keras.layers.Layer):
    """A layer without `compute_output_shape`: Keras traces its call for shapes."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer

    def call(self, x):
        return 2.0 * self.layer(x)


def build_any_length() -> keras.Model:
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(10, 4, mask_zero=True, name="embedding")(tokens)
    x = Doubled(keras.layers.LSTM(4, return_sequences=True, name="lstm"))(x)
    x = keras.layers.Bidirectional(keras.layers.GRU(4, name="gru"), name="bidirectional")(x)
    return keras.Model(tokens, keras.layers.Dense(2, name="head")(x))


def test_sequences_of_any_length_train_as_one_device():
    """Batches padded to their own longest sequence (`padded_batch`): Keras
    traces the step again with the time dimension unknown, and the
    recurrences run as loops over it. A last, smaller batch would be traced
    with its batch unknown too, which the loop refuses (named error below):
    dropped here."""
    rng = np.random.default_rng(5)
    sequences = [rng.integers(1, 10, size=n) for n in rng.integers(2, 9, size=37)]
    targets = rng.normal(size=(37, 2)).astype("float32")
    dataset = (
        tf.data.Dataset.from_tensor_slices((tf.ragged.constant(sequences), targets))
        .map(lambda tokens, target: (tokens.to_tensor() if hasattr(tokens, "to_tensor") else tokens, target))
        .padded_batch(8, drop_remainder=True)
    )
    weights = initial_weights(build_any_length)
    models = []
    for strategy in (tf.distribute.get_strategy(), strategy_on((2, 4), rules({**LSTM_GATES, **GRU_GATES}))):
        with strategy.scope():
            model = build_any_length()
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        recorder = BatchLosses()
        model.fit(dataset, epochs=2, verbose=0, callbacks=[recorder])
        models.append((model, recorder.losses))
    (reference, want_losses), (model, losses) = models
    assert len(losses) == 8
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_weights_close(reference.get_weights(), model.get_weights())
    np.testing.assert_allclose(model.predict(dataset, verbose=0), reference.predict(dataset, verbose=0), atol=1e-5)


class NoisyCell(keras.layers.Layer):
    """An Elman cell that adds noise to its state at every step."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units, self.state_size = units, units
        self.seed_generator = keras.random.SeedGenerator(3)

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units))

    def call(self, inputs, states):
        noise = keras.random.normal((self.units,), stddev=0.01, seed=self.seed_generator)
        output = keras.ops.tanh(inputs @ self.kernel + states[0] + noise)
        return output, [output]


def test_unknown_number_of_time_steps_is_a_clear_error_for_a_step_that_draws():
    """A step that draws random numbers is unrolled (running it again in the
    gradient would draw others), which needs the number of time steps."""
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)))
    with strategy.scope():  # inferring shapes needs no static time steps
        x = keras.Input((None, FEATURES))
        model = keras.Model(x, Doubled(keras.layers.RNN(NoisyCell(4), name="noisy"))(x))
    rng = np.random.default_rng(5)
    model.predict(rng.normal(size=(8, SEQ, FEATURES)).astype("float32"), verbose=0)
    # A second length makes Keras retrace with the time dimension relaxed to None.
    with pytest.raises(ValueError, match=r"(?s)noisy.*\(8, None, 3\).*draws no random numbers.*fixed sequence length"):
        model.predict(rng.normal(size=(8, SEQ + 2, FEATURES)).astype("float32"), verbose=0)


@pytest.mark.parametrize(
    "op,want",
    [
        (lambda t: keras.ops.flip(t, axis=1), lambda a: np.flip(a, 1)),
        (lambda t: keras.ops.flip(t, axis=(0, -1)), lambda a: np.flip(a, (0, -1))),
        (keras.ops.flip, np.flip),
        (keras.ops.fliplr, np.fliplr),
        (keras.ops.flipud, np.flipud),
        (lambda t: keras.ops.split(t, 4, axis=2), lambda a: np.split(a, 4, axis=2)),
        (lambda t: keras.ops.split(t, [3, 5], axis=-1), lambda a: np.split(a, [3, 5], axis=-1)),
        (lambda t: keras.ops.split(t, [2], axis=1), lambda a: np.split(a, [2], axis=1)),
        (lambda t: keras.ops.split(t, 2, axis=0), lambda a: np.split(a, 2, axis=0)),
    ],
    ids=[
        "flip-time",
        "flip-batch-and-last",
        "flip-all",
        "fliplr",
        "flipud",
        "split-model-axis",
        "split-model-axis-at",
        "split-time-axis-at",
        "split-batch-axis",
    ],
)
def test_reordering_ops_on_a_mesh(op, want):
    """Values and gradients, on a (batch, time, model)-split tensor."""
    held = PatchesHeld()  # noqa: F841
    device_mesh = mesh((2, 4)).dtensor_mesh
    x = np.arange(4 * 5 * 8, dtype="float32").reshape(4, 5, 8)
    split = dtensor.Layout(["batch", dtensor.UNSHARDED, "model"], device_mesh)
    rng = np.random.default_rng(6)
    weights = [rng.normal(size=part.shape).astype("float32") for part in _parts(want(x))]

    @tf.function
    def op_and_gradient(t):
        t = dtensor.relayout(t, split)
        with tf.GradientTape() as tape:
            tape.watch(t)
            with forward_on(device_mesh):
                parts = _parts(op(t))
            loss = sum(tf.reduce_sum(part * w) for part, w in zip(parts, weights))
        return [replicated(v, device_mesh) for v in [*parts, tape.gradient(loss, t)]]

    *parts, gradient = op_and_gradient(
        dtensor.copy_to_mesh(tf.constant(x), dtensor.Layout.replicated(device_mesh, 3))
    )
    for got, expected in zip(parts, _parts(want(x)), strict=True):
        np.testing.assert_array_equal(got, expected)
    # Each weight's gradient goes back to the entry op took it from.
    expected = np.zeros(x.size, "float32")
    positions = _parts(want(np.arange(x.size).reshape(x.shape)))
    for where, w in zip(positions, weights):
        expected[where.ravel()] += w.ravel()
    np.testing.assert_array_equal(gradient, expected.reshape(x.shape))


def _parts(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def test_cudnn_kernels_are_declined_on_a_mesh(monkeypatch):
    """Where Keras would run cuDNN (a GPU), a mesh takes the generic loop."""
    held = PatchesHeld()  # noqa: F841
    monkeypatch.setattr(
        importlib.import_module("keras.src.backend.tensorflow.rnn"),
        "_is_gpu_available",
        lambda: True,
    )
    gates = keras.activations.tanh, keras.activations.sigmoid
    with tf.Graph().as_default():
        x, h = tf.zeros((2, SEQ, FEATURES)), tf.zeros((2, 4))
        lstm_args = (x, h, h, None, tf.zeros((3, 16)), tf.zeros((4, 16)), tf.zeros((16,)), *gates)
        gru_args = (x, h, None, tf.zeros((3, 12)), tf.zeros((4, 12)), tf.zeros((2, 12)), *gates)
        backend.lstm(*lstm_args)  # Keras' cuDNN graph, off a mesh
        backend.gru(*gru_args)
        with forward_on(mesh((2, 4)).dtensor_mesh):
            with pytest.raises(NotImplementedError):
                backend.lstm(*lstm_args)
            with pytest.raises(NotImplementedError):
                backend.gru(*gru_args)


class PythonLoopScan(keras.layers.Layer):
    """A running sum written into a TensorArray in a Python loop (RWKV-7's
    time mix does the same), then stacked."""

    def build(self, input_shape):
        self.mix = self.add_weight(shape=(input_shape[-1], 8), name="mix")

    def call(self, x):
        mixed = keras.ops.matmul(x, self.mix)
        state, out = tf.zeros_like(mixed[:, 0]), tf.TensorArray("float32", size=x.shape[1])
        for t in range(x.shape[1]):
            state = 0.5 * state + mixed[:, t]
            out = out.write(t, state)
        return tf.transpose(out.stack(), [1, 0, 2])


def test_tensor_array_filled_in_a_python_loop_matches_one_device():
    def build():
        inputs = keras.Input((5, 4))
        hidden = PythonLoopScan(name="scan")(inputs)
        return keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 5, 4)).astype("float32"), rng.normal(size=(12, 5, 2)).astype("float32")
    # A batch split alone: TensorList ops have no DTensor layout rule at all.
    assert_parity(build, None, x, y)
