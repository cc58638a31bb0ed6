"""tfmp.layers.MixtureOfExperts: routing as one device, experts split over a mesh axis."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import assert_parity, initial_weights, rows_reversed_within_batches, rules, strategy_on, train
from tfmp.inspect.summary import placements

SEQ, FEATURES = 12, 16
# The layers around the experts split over "model", Megatron's pair.
AROUND = rules({"proj/kernel": (None, "model"), "proj/bias": ("model",), "head/kernel": ("model", None)})


def build_moe_model(num_experts=4, top_k=2, axis="batch", capacity_factor=1.0, aux_loss_weight=0.01):
    """A token projection, a mixture of experts with its residual, pooling, a head."""
    tokens = keras.Input((SEQ, FEATURES))
    x = keras.layers.Dense(FEATURES, name="proj")(tokens)
    experts = tfmp.layers.MixtureOfExperts(
        num_experts=num_experts,
        hidden_dim=24,
        top_k=top_k,
        capacity_factor=capacity_factor,
        aux_loss_weight=aux_loss_weight,
        axis=axis,
        name="moe",
    )
    x = keras.layers.Add()([x, experts(x)])
    return keras.Model(tokens, keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(x)))


def data(rows=37, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, SEQ, FEATURES)).astype("float32"), rng.normal(size=(rows, 3)).astype("float32")


def _collectives(model):
    return tfmp.comm_report(model, print_fn=lambda text: None).collectives


def test_routes_by_choice_then_position_and_drops_past_capacity():
    """Every first choice takes a slot before any second one; within a
    choice, earlier tokens first; a token past an expert's capacity gets
    no slot and no weight there; weights renormalize over the chosen two."""
    layer = tfmp.layers.MixtureOfExperts(num_experts=2, hidden_dim=4, top_k=2, capacity_factor=0.75)
    capacity = layer.capacity(4)  # ceil(2 * 4 * 0.75 / 2)
    assert capacity == 3
    probabilities = tf.constant([[[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.4, 0.6]]])
    dispatch, combine, first = (np.asarray(t) for t in layer._routes(probabilities, capacity))
    # Expert 0: first choices of tokens 0, 1, 2 fill its 3 slots; token 3's
    # second choice is dropped. Expert 1: token 3 (first choice), then the
    # second choices of tokens 0 and 1; token 2's is dropped.
    want_slots = {(0, 0): 0, (1, 0): 1, (2, 0): 2, (3, 1): 0, (0, 1): 1, (1, 1): 2}
    want = np.zeros((1, 4, 2, capacity), "float32")
    for (token, expert), slot in want_slots.items():
        want[0, token, expert, slot] = 1.0
    np.testing.assert_array_equal(dispatch, want)
    np.testing.assert_allclose(combine.sum(axis=-1)[0], [[0.9, 0.1], [0.8, 0.2], [0.7, 0.0], [0.0, 0.6]], rtol=1e-6)
    np.testing.assert_array_equal(first[0], [[1, 0], [1, 0], [1, 0], [0, 1]])


def test_experts_split_over_the_batch_axis_exchange_tokens_by_all_to_all():
    """GShard's expert parallelism on 2x4: each "batch" device holds 2 of 4
    experts, its tokens reach them and come back by one all-to-all each
    way, and the banks are never gathered. Top-2 routing with drops
    (capacity factor 1), the load-balancing loss, 37 rows at batch 8 (a
    last batch of 5, traced with an unknown batch), the layers around it
    tensor-parallel over "model"."""
    x, y = data()
    model = assert_parity(build_moe_model, AROUND, x, y, mesh_shape=(2, 4), steps=5, batch_size=8)
    banks = {row.path: (row.axes, row.compute_axes) for row in placements(model) if "expert_" in row.path and not row.is_slot}
    assert banks == {
        "moe/expert_kernel_in": (("batch", None, None),) * 2,
        "moe/expert_bias_in": (("batch", None),) * 2,
        "moe/expert_kernel_out": (("batch", None, None),) * 2,
        "moe/expert_bias_out": (("batch", None),) * 2,
    }
    moe = [c for c in _collectives(model) if "moe" in c.op]
    exchanges = [c for c in moe if c.kind == "all-to-all"]
    assert [c.phase for c in exchanges].count("forward") == 2, moe
    assert [c.phase for c in exchanges].count("backward") == 2, moe
    assert all(c.axes == ("batch",) for c in exchanges)
    # The features come split over "model" from the column-parallel
    # projection and are gathered there; nothing is gathered over "batch".
    assert not [c for c in moe if "batch" in c.axes and c.kind == "all-gather" or c.category == "weight-gathers"]


def test_every_expert_per_token_and_an_eager_call():
    """top_k = num_experts (routing continuous: no choice can flip) trains
    as one device, and the model called eagerly under the strategy (tfmp
    runs the call on the mesh; no strategy step, so DTensor places the
    tokens) gives one device's outputs."""
    x, y = data(seed=8)
    build = lambda: build_moe_model(num_experts=4, top_k=4)  # noqa: E731
    model = assert_parity(build, AROUND, x, y, mesh_shape=(2, 4), steps=5, batch_size=8)
    reference = build()
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(np.asarray(model(x[:8])), reference(x[:8]), rtol=1e-5, atol=1e-6)


def test_one_expert_per_device_with_switch_routing():
    """Top-1 (Switch) routing, 8 experts over 8 devices, no balance loss."""
    x, y = data(seed=1)
    assert_parity(
        lambda: build_moe_model(num_experts=8, top_k=1, capacity_factor=1.5, aux_loss_weight=0.0),
        None, x, y, mesh_shape=(8, 1), steps=5, batch_size=8,
    )


def test_experts_over_their_own_axis_route_the_same_tokens_and_sum():
    """A ("batch", "expert", "model") mesh: tokens split over "batch" only,
    each "expert" device runs its 2 experts on them; no all-to-all, the
    outputs are summed over "expert"."""
    x, y = data(seed=2)
    device_mesh = tfmp.DeviceMesh((2, 2, 2), ("batch", "expert", "model"))
    strategy = tfmp.ModelParallelStrategy(device_mesh, AROUND(device_mesh))
    model = assert_parity(
        lambda: build_moe_model(axis="expert"), None, x, y, steps=5, batch_size=8, strategy=strategy
    )
    moe = [c for c in _collectives(model) if "moe" in c.op]
    assert not [c for c in moe if c.kind == "all-to-all"], moe
    assert any(c.kind == "all-reduce" and c.axes == ("expert",) and c.phase == "forward" for c in moe), moe


def test_experts_with_context_parallelism():
    """A 2x2x2 ("batch", "sequence", "model") mesh with the sequence split
    over "sequence" (`context_parallel`) and the layers around tensor-parallel
    over "model": the capacity still counts each example's whole sequence,
    so the same tokens are kept and dropped."""
    x, y = data(seed=6)
    device_mesh = tfmp.DeviceMesh((2, 2, 2), ("batch", "sequence", "model"))
    strategy = tfmp.ModelParallelStrategy(device_mesh, AROUND(device_mesh), context_parallel="sequence")
    model = assert_parity(build_moe_model, None, x, y, steps=5, batch_size=8, strategy=strategy)
    exchanges = [c for c in _collectives(model) if "moe" in c.op and c.kind == "all-to-all"]
    assert exchanges and all(c.axes == ("batch",) for c in exchanges)


class SwitchExperts(keras.layers.Layer):
    """A Switch Transformer layer as a user writes it with keras.ops: top-1
    routing with a capacity per example, dispatch and combine einsums, and
    the experts' weights in banks of shape (experts, ...). No tfmp in it."""

    def __init__(self, num_experts, hidden_dim, capacity, **kwargs):
        super().__init__(**kwargs)
        self.num_experts, self.hidden_dim, self.capacity = num_experts, hidden_dim, capacity

    def build(self, input_shape):
        features = input_shape[-1]
        self.router = self.add_weight(name="router", shape=(features, self.num_experts))
        self.w_in = self.add_weight(name="w_in", shape=(self.num_experts, features, self.hidden_dim))
        self.w_out = self.add_weight(name="w_out", shape=(self.num_experts, self.hidden_dim, features))

    def call(self, x):
        probabilities = keras.ops.softmax(keras.ops.einsum("gsm,me->gse", x, self.router))
        chosen = keras.ops.one_hot(keras.ops.argmax(probabilities, axis=-1), self.num_experts)
        slot = keras.ops.cumsum(chosen, axis=1) - chosen
        kept = chosen * keras.ops.cast(slot < self.capacity, "float32")
        dispatch = kept[..., None] * keras.ops.one_hot(keras.ops.cast(slot, "int32"), self.capacity)
        combine = dispatch * keras.ops.sum(probabilities * chosen, axis=-1)[:, :, None, None]
        tokens = keras.ops.einsum("gsec,gsm->egcm", dispatch, x)
        hidden = keras.ops.relu(keras.ops.einsum("egcm,emh->egch", tokens, self.w_in))
        return keras.ops.einsum("gsec,egcm->gsm", combine, keras.ops.einsum("egch,ehm->egcm", hidden, self.w_out))


@pytest.mark.parametrize("split_on_use", [True, False], ids=["split_on_use", "gathered"])
def test_banks_of_a_users_own_layer_split_on_use_move_the_tokens(split_on_use):
    """A user's own mixture with its banks over "batch" by LayoutMap rules,
    8 experts on 8x1. Laid out `tfmp.split_on_use`, the banks stay split as
    the layer reads them and DTensor brings the dispatched tokens to them
    (by an all-to-all, or by gathering the tokens: its layout propagation
    chose either in this file, depending on what ran before); by a plain
    rule, tfmp gathers the banks over "batch" as it reads them (fully
    sharded). Both train as one device, 37 rows at batch 8."""

    def build():
        tokens = keras.Input((SEQ, FEATURES))
        x = keras.layers.Dense(FEATURES, name="proj")(tokens)
        x = keras.layers.Add()([x, SwitchExperts(8, 24, capacity=3, name="moe")(x)])
        return keras.Model(tokens, keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(x)))

    mark = tfmp.split_on_use if split_on_use else tuple
    banks = rules({"moe/w_(in|out)": mark(("batch", None, None))})
    x, y = data(seed=7)
    model = assert_parity(build, banks, x, y, mesh_shape=(8, 1), steps=5, batch_size=8)
    gathers = [c for c in _collectives(model) if c.category == "weight-gathers"]
    assert bool(gathers) != split_on_use, gathers


def test_expert_count_that_does_not_divide_is_a_clear_error():
    strategy = strategy_on((2, 4), AROUND)
    with strategy.scope():
        model = build_moe_model(num_experts=3)
        model.compile(optimizer="adam", loss="mse")
    x, y = data(rows=16)
    with pytest.raises(ValueError, match=r"num_experts=3 does not divide by the size of mesh axis 'batch' \(2\)"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_bad_arguments_and_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="top_k=3 must be between 1 and num_experts=2"):
        tfmp.layers.MixtureOfExperts(num_experts=2, hidden_dim=4, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor=0 must be positive"):
        tfmp.layers.MixtureOfExperts(num_experts=2, hidden_dim=4, capacity_factor=0)
    with pytest.raises(ValueError, match=r"known sequence length.*\(None, None, 16\)"):
        tfmp.layers.MixtureOfExperts(num_experts=2, hidden_dim=4)(keras.Input((None, 16)))


def test_config_round_trip_gives_the_same_layer():
    layer = tfmp.layers.MixtureOfExperts(num_experts=4, hidden_dim=8, top_k=1, activation="relu", axis="expert")
    x = np.random.default_rng(3).normal(size=(2, SEQ, FEATURES)).astype("float32")
    want = layer(x)
    copy = tfmp.layers.MixtureOfExperts.from_config(layer.get_config())
    copy(x)
    copy.set_weights(layer.get_weights())
    np.testing.assert_allclose(copy(x), want, rtol=1e-6)
    assert copy.axis == "expert" and copy.top_k == 1


def test_saved_on_one_mesh_loads_on_another(tmp_path):
    """A `.keras` file saved with the experts over 8 devices loads in a 2x4
    scope with them over 2, and predicts the same."""
    x, _ = data(rows=8, seed=4)
    with strategy_on((8, 1)).scope():
        model = build_moe_model(num_experts=8)
    want = model.predict(x, verbose=0)
    model.save(tmp_path / "moe.keras")
    with strategy_on((2, 4), AROUND).scope():
        loaded = keras.models.load_model(tmp_path / "moe.keras")
    bank = loaded.get_layer("moe").expert_kernel_in.value
    assert tuple(bank.layout.sharding_specs) == ("batch", "unsharded", "unsharded")
    assert bank.layout.mesh.dim_size("batch") == 2
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)


def fit_under(policy, weights, strategy=None, reverse_rows=False):
    """The mixture model trained 5 batches of Adam under `policy`: its batch
    losses, its weights in float64, and the model."""
    keras.config.set_dtype_policy(policy)
    try:
        with (strategy or tf.distribute.get_strategy()).scope():
            model = build_moe_model()
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    finally:
        keras.config.set_dtype_policy("float32")
    x, y = data(seed=5)
    if reverse_rows:
        order = rows_reversed_within_batches(len(x), 8)
        x, y = x[order], y[order]
    losses, _ = train(model, x, y, batch_size=8)
    return np.array(losses), [np.asarray(w, "float64") for w in model.get_weights()], model


def distance(run, reference):
    """The largest loss and weight differences of a `(losses, weights)` run from another."""
    (losses, weights), (reference_losses, reference_weights) = run, reference
    return {
        "loss": float(np.max(np.abs(losses - reference_losses))),
        "weights": max(float(np.max(np.abs(p - q))) for p, q in zip(weights, reference_weights, strict=True)),
    }


def test_mixed_precision_routes_in_float32():
    """Under mixed_bfloat16 the experts compute in bfloat16 and the router in
    float32 (its kernel is not autocast). bfloat16 rounds the experts' sums
    in another order on 2x4 than on one device, so the mesh is held to the
    yardstick of tests/test_mixed_precision.py: no further from float64
    training than one device in bfloat16 is (rows as given or reversed
    within each batch; routing is per example, so both orders route alike),
    within a factor of 2."""
    weights = initial_weights(build_moe_model)
    exact = fit_under("float64", weights)[:2]
    one_device = [distance(fit_under("mixed_bfloat16", weights, reverse_rows=r)[:2], exact) for r in (False, True)]
    device_mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
    *run, model = fit_under("mixed_bfloat16", weights, tfmp.ModelParallelStrategy(device_mesh, AROUND(device_mesh)))
    on_mesh = distance(run, exact)
    print(f"to float64: one device {one_device}, mesh {on_mesh}")
    assert min(d["weights"] for d in one_device) > 1e-4  # bf16 rounding is what is measured
    for quantity in ("loss", "weights"):
        assert on_mesh[quantity] <= 2 * max(d[quantity] for d in one_device), quantity
    layer = model.get_layer("moe")
    assert layer.router_kernel.dtype == "float32" and not layer.router_kernel._autocast
    assert layer.expert_kernel_in.dtype == "float32" and layer.compute_dtype == "bfloat16"
