"""Fully sharded data parallelism (`fully_shard=True`) and how a variable's
layout is resolved: parity with one device, bytes per device, weight gathers."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import (
    MODELS,
    assert_weights_close,
    initial_weights,
    mesh,
    train,
)
from tfmp.demo import megatron_layout_map
from tfmp.inspect.summary import bytes_per_device, placements


def fit_both(name, strategy, epochs=1, predict=True):
    """Trains model `name` on one device and in `strategy`'s scope from the same
    weights; per-step losses, final weights and (with `predict`) predictions
    agree to 1e-5."""
    build, _, compile_fn, data = MODELS[name]
    return fit_both_models(build, compile_fn, data(), strategy, epochs, predict)


def fit_both_models(build, compile_fn, data, strategy, epochs=1, predict=True):
    """`fit_both` for a model `build()` compiled by `compile_fn`, on `data`."""
    weights = initial_weights(build)
    reference = compile_fn(build())
    reference.set_weights(weights)
    with strategy.scope():
        model = compile_fn(build())
        model.set_weights(weights)
    x, y = data
    ref_losses, _ = train(reference, x, y, epochs=epochs)
    losses, _ = train(model, x, y, epochs=epochs)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_weights_close(reference.get_weights(), model.get_weights())
    if not predict:
        return model
    expected = reference.predict(x, verbose=0)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-5 * scale)
    return model


@pytest.fixture(scope="module")
def fully_sharded_lm():
    """The demo Transformer LM, Megatron rules on "model" and every weight and
    Adam slot also split over "batch", trained 4 steps against one device."""
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, megatron_layout_map(device_mesh), fully_shard=True)
    return fit_both("transformer", strategy)


def test_fully_sharded_lm_matches_single_device_and_splits_every_weight(fully_sharded_lm):
    model = fully_sharded_lm
    by_path = {v.path.removeprefix("transformer_lm/"): v.value for v in model.variables}
    # Megatron's "model" split stays; "batch" takes the largest whole dimension.
    assert by_path["ffn_in/kernel"].layout.sharding_specs == ["batch", "model"]
    assert by_path["ffn_out/kernel"].layout.sharding_specs == ["model", "batch"]
    assert by_path["token_embedding/embeddings"].layout.sharding_specs == ["model", "batch"]
    # A layer reads its weights with the batch axis gathered.
    assert by_path["ffn_in/kernel"].compute_layout.sharding_specs == ["unsharded", "model"]
    summary = tfmp.summary(model, print_fn=lambda _: None)
    assert "read as" in summary and "('unsharded', 'model')" not in summary
    assert "(None, 'model')" in summary  # ffn_in/kernel is read as (None, 'model')


def test_fully_sharded_bytes_per_device_are_about_one_eighth(fully_sharded_lm):
    """Every variable with a dimension that divides is split over "batch"; the
    rest are scalars (the step count, the learning rate) and vectors the rules
    split over "model" already (a dimension takes one mesh axis), which hold a
    quarter, not an eighth. In this tiny model (hidden size 32) they make
    parameters + Adam slots per device 1.056 x (their total / 8);
    bench/tensor_parallel.py measures a GPT-sized one."""
    rows = placements(fully_sharded_lm)
    for row in rows:
        if "batch" not in (row.axes or ()):
            assert not row.shape or "model" in row.axes, row
    per_device = bytes_per_device(fully_sharded_lm)
    whole = sum(int(np.prod(row.shape)) * row.itemsize for row in rows)
    ratios = [kinds["total"] / (whole / 8) for kinds in per_device.values()]
    assert len(ratios) == 8
    assert max(ratios) < 1.06, ratios


def test_fully_sharded_gathers_show_in_comm_report(fully_sharded_lm):
    """tfmp sets LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2, so every weight
    gather is a gather collective, half the bytes of DTensor's default (an
    all-reduce of a zero-filled buffer), and the fixture trained and predicted
    exactly with it: each gather takes one mesh axis, the case DTensor lowers
    right. Weights and predictions read to the host gather one axis at a time
    too, since a relayout gathering two axes at once (the ("model", "batch")
    embedding read whole) comes back misplaced with that lowering."""
    assert os.environ["LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"] == "1"
    report = tfmp.comm_report(fully_sharded_lm, print_fn=lambda _: None)
    gathers = [c for c in report.collectives if c.category == "weight-gathers"]
    over_batch = [c for c in gathers if c.axes == ("batch",)]
    assert all(c.phase == "forward" for c in gathers)
    assert {c.lowered_as for c in gathers} == {"all-gather"}
    # Each weight split over "batch" is gathered once, at its size as read
    # (still split over "model" where its rule says so).
    read = {v.path.removeprefix("transformer_lm/"): v.value for v in fully_sharded_lm.variables}
    kernel = read["ffn_in/kernel"]
    gathered_bytes = 32 * 64 // 4 * 4  # (32, 64) float32, "model" still split
    assert kernel.compute_layout.sharding_specs == ["unsharded", "model"]
    assert any(c.op.startswith("transformer_lm") and "ffn_in" in c.op and c.bytes == gathered_bytes for c in over_batch)
    # One gather per weight stored split over "batch", also where a layer
    # reads several (DTensor names them ReadVariableOp_1, ...).
    split = [v for v in fully_sharded_lm.trainable_variables if "batch" in v.value.layout.sharding_specs]
    assert len(over_batch) == len(split)
    assert "weight-gathers" in str(report)


def test_fully_sharded_mlp_on_1x8_and_8x1():
    """On 8x1 every weight is split 8 ways over "batch" (ZeRO-3 alone); on
    1x8 the batch axis has one device and nothing more is split."""
    for shape in [(8, 1), (1, 8)]:
        device_mesh = mesh(shape)
        strategy = tfmp.ModelParallelStrategy(device_mesh, MODELS["mlp"][1](device_mesh), fully_shard=True)
        model = fit_both("mlp", strategy)
        kernel = model.get_layer("up").kernel.value
        if shape == (8, 1):
            # (16, 32): the rule's "model" has size 1, so dimension 1 is
            # stored whole and "batch" takes it, the largest.
            assert kernel.layout.sharding_specs == ["unsharded", "batch"]
        else:
            assert kernel.layout.sharding_specs == ["unsharded", "model"]


def build_embedding_model():
    return keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(256, 16, name="embed"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(8, name="out"),
        ],
        name="embedding_model",
    )


def compile_adam_mse(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def embedding_data():
    """48 rows of 4 ids, some repeated within a batch: a batch of 16 has 64
    ids, fewer than the table's 256 rows."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 256, size=(48, 4)).astype("int32")
    ids[:, 1] = ids[:, 0]
    return ids, rng.normal(size=(48, 8)).astype("float32")


@pytest.mark.parametrize(
    "shape, axes, fully_shard, stored",
    [
        ((2, 4), ("model", None), True, ["model", "batch"]),
        # "model" has size 1: the rows are stored whole, and "batch" takes them.
        ((8, 1), ("model", None), True, ["batch", "unsharded"]),
        ((8, 1), None, True, ["batch", "unsharded"]),
        # Not fully sharded: read as stored. Here a split layout for the rows,
        # pushed back by DTensor, broke the pooling's backward pass.
        ((2, 4), ("model", "batch"), False, ["model", "batch"]),
    ],
)
def test_embedding_adam_sums_its_rows_without_reducing_the_table(shape, axes, fully_shard, stored):
    """Keras' Adam sums an embedding's sparse gradient into its two moments
    (the rows, then their squares: a repeated id adds its squares). The rows
    come split over "batch"; tfmp gathers them before those sums instead of
    letting DTensor all-reduce a table-sized sum for each: the same numbers as
    one device, and nothing table-sized crosses "batch" after the forward
    pass."""
    device_mesh = mesh(shape)
    layout_map = tfmp.LayoutMap(device_mesh)
    if axes:
        layout_map["embed/embeddings"] = axes
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map, fully_shard=fully_shard)
    model = fit_both_models(build_embedding_model, compile_adam_mse, embedding_data(), strategy)
    table = model.get_layer("embed").embeddings.value
    assert table.layout.sharding_specs == stored
    table_bytes = 256 * 16 * 4
    report = tfmp.comm_report(model, print_fn=lambda _: None)
    after_forward = [c for c in report.collectives if c.axes == ("batch",) and c.phase != "forward"]
    assert after_forward and all(c.bytes < table_bytes // 2 for c in after_forward), after_forward


def test_fully_shard_needs_a_batch_axis():
    with pytest.raises(ValueError, match="fully_shard=True shards weights over the batch axis"):
        tfmp.ModelParallelStrategy(mesh((8,), ("model",)), fully_shard=True)
