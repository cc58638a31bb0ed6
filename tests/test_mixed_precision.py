"""Mixed precision under the strategy: Keras' `mixed_bfloat16` and
`mixed_float16` (with the `LossScaleOptimizer` Keras adds at `compile`) on a
2x4 mesh, against one device with the same policy.

Tolerances. bfloat16 keeps 8 bits of mantissa: every product and sum of the
step rounds at 2**-8 (0.4%) relative, and the mesh sums in another order
than one device (shards, then an all-reduce), so its bf16 numbers move at
that scale, and Adam carries the moves on. Such numbers are held to a
yardstick measured in the test, not to 1e-5: the exact answer is float64
on one device (for float16 with loss scaling, float64 trained on just the
batches float16 applied, since float64 never overflows), and the mesh may
be no further from it than one device under the same policy is, within a
factor of 2. One device runs in two float orders (rows as given, and each
batch's rows reversed) and the further counts: one order alone can land
lucky close (on a CPU with AVX512_BF16 one device's bf16 loss came 0.0011
from float64 as given and 0.0075 reversed, the mesh's 0.0034). float16
losses are also held to one float16 rounding (2**-11 relative) of one
device's, and the loss scale and the steps skipped must be exactly one
device's; its weights by each variable's root-mean-square difference
(the test says why). Variables in bfloat16 (Keras' `"bfloat16"` policy)
get the layouts float32 ones get, from rules, `fully_shard` and `"auto"`.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import (
    build_mlp,
    initial_weights,
    mesh,
    mlp_data,
    mlp_layout_map,
    rows_reversed_within_batches,
    train,
)
from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data

ROWS, BATCH = 37, 8  # the last batch (5 rows) does not divide the batch axis (2)
FLOAT16_ROUNDOFF = 2.0**-11  # float16: the largest relative error of one rounding


@pytest.fixture
def dtype_policy():
    """Sets the global dtype policy; float32 again afterwards."""
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="module")
def lm_weights():
    return initial_weights(build_transformer_lm)


def fit_lm(weights, policy, strategy=None, reverse_rows=False, batches=None, callbacks=()):
    """The demo decoder trained one epoch of Adam under `policy` (on the
    batches numbered `batches` only, if given): its batch losses, its weights
    in float64, and the model."""
    keras.config.set_dtype_policy(policy)
    try:
        with (strategy or tf.distribute.get_strategy()).scope():
            model = build_transformer_lm()
            model.set_weights(weights)
            model.compile(
                optimizer=keras.optimizers.Adam(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
    finally:
        keras.config.set_dtype_policy("float32")
    x, y = next_token_data(ROWS, 8, 64, seed=1)
    if reverse_rows:
        order = rows_reversed_within_batches(ROWS, BATCH)
        x, y = x[order], y[order]
    if batches is not None:
        rows = np.concatenate([np.arange(b * BATCH, min((b + 1) * BATCH, ROWS)) for b in batches])
        x, y = x[rows], y[rows]
    losses, _ = train(model, x, y, batch_size=BATCH, callbacks=list(callbacks))
    return np.array(losses), [np.asarray(w, "float64") for w in model.get_weights()], model


class AppliedSteps(keras.callbacks.Callback):
    """Whether the optimizer applied each training batch: a
    `LossScaleOptimizer` skips a batch whose gradients overflowed, and its
    `iterations` counts applied ones only."""

    def on_train_begin(self, logs=None):
        self.applied = []
        self._count = int(self.model.optimizer.iterations)

    def on_train_batch_end(self, batch, logs=None):
        count = int(self.model.optimizer.iterations)
        self.applied.append(count > self._count)
        self._count = count


def largest_difference(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b, strict=True))


def rms_difference(a, b) -> float:
    """The largest root-mean-square difference of two lists of weights, variable by variable."""
    return max(float(np.sqrt(np.mean((p - q) ** 2))) for p, q in zip(a, b, strict=True))


def distance(run, reference):
    """The largest loss and weight differences of a `(losses, weights)` run from another."""
    (losses, weights), (reference_losses, reference_weights) = run, reference
    return {
        "loss": float(np.max(np.abs(losses - reference_losses))),
        "weights": largest_difference(weights, reference_weights),
    }


def megatron_strategy():
    device_mesh = mesh((2, 4))
    return tfmp.ModelParallelStrategy(device_mesh, megatron_layout_map(device_mesh))


def context_parallel_strategy():
    device_mesh = mesh((2, 2, 2), ("batch", "sequence", "model"))
    return tfmp.ModelParallelStrategy(device_mesh, megatron_layout_map(device_mesh), context_parallel=True)


@pytest.mark.parametrize("strategy", [megatron_strategy, context_parallel_strategy])
def test_mixed_bfloat16_decoder_is_as_close_to_float64_as_one_device(lm_weights, strategy):
    """The mesh's bf16 run differs from one device's bf16 run by rounding
    order only: both are as far from the exact (float64) training. Under
    context parallelism attention runs a block of keys at a time, its sums
    in float32 (tfmp/lowering/attention.py)."""
    exact = fit_lm(lm_weights, "float64")[:2]
    one_device_runs = [fit_lm(lm_weights, "mixed_bfloat16", reverse_rows=r)[:2] for r in (False, True)]
    mesh_losses, mesh_weights, model = fit_lm(lm_weights, "mixed_bfloat16", strategy())

    assert model.dtype_policy.name == "mixed_bfloat16"
    assert model.get_layer("ffn_in").compute_dtype == "bfloat16"
    assert model.get_layer("ffn_in").kernel.dtype == "float32"
    assert list(model.get_layer("ffn_in").kernel.value.layout.sharding_specs) == ["unsharded", "model"]
    one_device = [distance(run, exact) for run in one_device_runs]
    on_mesh = distance((mesh_losses, mesh_weights), exact)
    print(f"to float64: one device {one_device[0]}, rows reversed {one_device[1]}, mesh {on_mesh}")
    assert min(d["weights"] for d in one_device) > 1e-3  # bf16 rounding is what is measured
    for quantity in ("loss", "weights"):
        assert on_mesh[quantity] <= 2 * max(d[quantity] for d in one_device), quantity


def test_mixed_float16_with_loss_scaling_matches_one_device_to_rounding(lm_weights):
    """Keras wraps the optimizer in a `LossScaleOptimizer`; the mesh skips
    the same overflowing steps and ends with the same loss scale."""
    runs = {}
    for name, kwargs in {
        "one device": {},
        "rows reversed": {"reverse_rows": True},
        "mesh": {"strategy": megatron_strategy()},
    }.items():
        applied = AppliedSteps()
        runs[name] = (*fit_lm(lm_weights, "mixed_float16", callbacks=[applied], **kwargs), applied.applied)
    losses, weights, reference, applied = runs["one device"]
    mesh_losses, mesh_weights, model, mesh_applied = runs["mesh"]

    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.get_layer("ffn_in").compute_dtype == "float16"
    assert float(model.optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale)
    assert mesh_applied == runs["rows reversed"][3] == applied
    assert not all(applied)  # some steps were skipped
    # The exact answer: float64 trained on the batches float16 applied.
    exact_weights = fit_lm(lm_weights, "float64", batches=np.flatnonzero(applied))[1]
    # Weights are compared by each variable's root-mean-square difference:
    # where a coordinate's gradient is near zero, float16's rounding picks
    # the sign of Adam's lr-sized step (on a CPU with AVX512_FP16 and AMX,
    # one embedding coordinate of the mesh moved 0.018 the other way from
    # float64's, 0.032 apart, where one device's two orders kept the sign;
    # per variable, the mesh's RMS was 1.04e-3 against one device's 1.07e-3
    # and 1.27e-3), and the largest single coordinate would measure that luck.
    one_device = [rms_difference(runs[name][1], exact_weights) for name in ("one device", "rows reversed")]
    on_mesh = rms_difference(mesh_weights, exact_weights)
    print(f"weights to float64 (RMS): one device {one_device[0]:.2e}, rows reversed {one_device[1]:.2e}, mesh {on_mesh:.2e}")
    # Reversed rows reorder the batch's sums only, not those over features
    # the "model" axis splits: the losses are held to one float16 rounding.
    np.testing.assert_allclose(mesh_losses, losses, rtol=FLOAT16_ROUNDOFF)
    assert on_mesh <= 2 * max(one_device)


def mlp_layouts(policy, layout_map, fully_shard):
    """The dtypes of the MLP's weights, and the storage layout of every
    variable (weights, then Adam's); `"auto"` plans at the first `fit`, run
    on a batch that does not divide the batch axis."""
    device_mesh = mesh((2, 4))
    if layout_map == "rules":
        layout_map = mlp_layout_map(device_mesh)
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map, fully_shard=fully_shard)
    keras.config.set_dtype_policy(policy)
    with strategy.scope():
        model = build_mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    if layout_map == "auto":
        x, y = mlp_data(5)
        losses, _ = train(model, x, y, batch_size=5)
        assert np.all(np.isfinite(losses))
    else:
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)
    variables = model.weights + model.optimizer.variables
    return (
        [v.dtype for v in model.weights],
        [tuple(v.value.layout.sharding_specs) for v in variables],
    )


@pytest.mark.parametrize(
    "layout_map, fully_shard",
    [("rules", True), ("auto", True), ("auto", False)],
    ids=["rules-fully-sharded", "auto-fully-sharded", "auto"],
)
def test_bfloat16_variables_get_the_layouts_of_float32_ones(dtype_policy, layout_map, fully_shard):
    float32_dtypes, float32_layouts = mlp_layouts("float32", layout_map, fully_shard)
    dtypes, layouts = mlp_layouts("bfloat16", layout_map, fully_shard)

    assert set(float32_dtypes) == {"float32"} and set(dtypes) == {"bfloat16"}
    assert layouts == float32_layouts
    up_kernel = layouts[0]
    assert "model" in up_kernel
    if fully_shard:
        assert "batch" in up_kernel
