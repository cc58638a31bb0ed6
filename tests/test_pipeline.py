"""Pipelines: LayerGroup stages on their own devices, against one device."""

import functools

import keras
import numpy as np
import pytest

import tfmp
from helpers import assert_weights_close, build_layers_lm, compile_lm, compile_mlp, lm_data, table_row, train
from tfmp.inspect.display import device_ranges, format_bytes
from tfmp.inspect.summary import bytes_per_device

STEPS = 5
BATCH = 16


def build_pipeline_mlp(num_stages: int = 2, recompute: bool = False) -> keras.Model:
    """Dense layers spread over `num_stages` LayerGroups."""
    widths = {2: [[("up", 32), ("mid", 32)], [("down", 8)]],
              4: [[("up", 32)], [("mid", 32)], [("mid_2", 32)], [("down", 8)]]}[num_stages]
    groups = [
        tfmp.layers.LayerGroup(
            [
                keras.layers.Dense(units, activation=None if name == "down" else "relu", name=name)
                for name, units in stage_layers
            ],
            stage=stage,
            recompute=recompute,
            name=f"stage_{stage}",
        )
        for stage, stage_layers in enumerate(widths)
    ]
    return keras.Sequential([keras.Input((16,)), *groups], name="pipeline_mlp")


MLP_RULES = {"up/kernel": (None, "model"), "mid/kernel": ("model", None)}
MLP4_RULES = {**MLP_RULES, "mid_2/kernel": (None, "model")}


def build_pipeline_lm() -> keras.Model:
    """The tensor-parallel Transformer LM of the parity tests, cut after its
    attention block: each stage's layers are split over "model" too."""
    whole = build_layers_lm()
    cut = whole.get_layer("norm_1").output
    first = keras.Model(whole.input, cut, name="attention_stage")
    rest_input = keras.Input(cut.shape[1:])
    x = rest_input
    for name in ("ffn_in", "ffn_out"):
        x = whole.get_layer(name)(x)
    x = whole.get_layer("norm_2")(rest_input + x)
    head = whole.layers[-1]
    second = keras.Model(rest_input, head(x), name="ffn_stage")
    return keras.Sequential(
        [keras.Input((8,), dtype="int32"),
         tfmp.layers.LayerGroup(first, stage=0, name="stage_0"),
         tfmp.layers.LayerGroup(second, stage=1, name="stage_1")],
        name="pipeline_lm",
    )


def mlp_data(n=STEPS * BATCH):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 16)).astype("float32"), rng.normal(size=(n, 8)).astype("float32")


CASES = {
    "mlp2": (functools.partial(build_pipeline_mlp, 2), compile_mlp, mlp_data, (2, 1, 4), MLP_RULES),
    "mlp4": (functools.partial(build_pipeline_mlp, 4), compile_mlp, mlp_data, (4, 1, 2), MLP4_RULES),
    "mlp2_dp": (functools.partial(build_pipeline_mlp, 2), compile_mlp, mlp_data, (2, 2, 2), MLP_RULES),
    "lm2": (build_pipeline_lm, compile_lm, lambda: lm_data(STEPS * BATCH), (2, 1, 4), None),
}


@functools.lru_cache(maxsize=None)
def reference(case: str):
    """Initial weights and the single-device run of a case."""
    build, compile_fn, data, _, _ = CASES[case]
    keras.utils.set_random_seed(7)
    model = compile_fn(build())
    weights = model.get_weights()
    x, y = data()
    losses, history = train(model, x, y, batch_size=BATCH)
    return weights, losses, history.history, model.get_weights(), model.predict(x, verbose=0)


def pipeline_strategy(case: str, num_microbatches: int, schedule: str) -> tfmp.ModelParallelStrategy:
    mesh = tfmp.DeviceMesh(CASES[case][3], ("stage", "batch", "model"))
    return tfmp.ModelParallelStrategy(
        mesh, CASES[case][4], num_microbatches=num_microbatches, schedule=schedule
    )


def build_in(strategy, case, weights, build=None):
    build = build or CASES[case][0]
    with strategy.scope():
        model = build()
        model.set_weights(weights)
        return CASES[case][1](model)


PARITY = [
    ("mlp2", 1, "gpipe"), ("mlp2", 2, "gpipe"), ("mlp2", 4, "gpipe"),
    ("mlp2", 2, "1f1b"), ("mlp2", 4, "1f1b"),
    ("mlp4", 1, "gpipe"), ("mlp4", 2, "gpipe"), ("mlp4", 4, "gpipe"), ("mlp4", 4, "1f1b"),
    ("mlp2_dp", 2, "1f1b"),
    ("lm2", 1, "gpipe"), ("lm2", 2, "gpipe"), ("lm2", 4, "gpipe"),
    ("lm2", 2, "1f1b"), ("lm2", 4, "1f1b"),
]


@pytest.mark.parametrize("case,num_microbatches,schedule", PARITY)
def test_pipeline_matches_one_device(case, num_microbatches, schedule):
    weights, losses, history, final_weights, predictions = reference(case)
    strategy = pipeline_strategy(case, num_microbatches, schedule)
    model = build_in(strategy, case, weights)
    x, y = CASES[case][2]()
    got_losses, got_history = train(model, x, y, batch_size=BATCH)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
    for key, values in history.items():
        np.testing.assert_allclose(got_history.history[key], values, rtol=1e-5)
    assert_weights_close(final_weights, model.get_weights())
    # 1e-5 of the outputs' scale: split stages sum their shards in another
    # order, which moves a logit of about 4 by 1e-5 after 5 Adam steps
    # (measured: 1.1e-5 on a 2x1x4 mesh, 9.5e-7 on 2x1x1 without the split).
    scale = np.abs(predictions).max()
    np.testing.assert_allclose(model.predict(x, verbose=0), predictions, rtol=1e-5, atol=1e-5 * scale)
    assert_stage_placement(model, strategy)


def assert_stage_placement(model, strategy):
    """Each stage's variables and optimizer slots lie on that stage's devices only."""
    stage_devices = [set(mesh.dtensor_mesh.local_devices()) for mesh in strategy.stage_meshes.meshes]
    for group in model.layers:
        devices = stage_devices[group.stage]
        for variable in group.variables:
            assert set(variable.value.layout.mesh.local_devices()) == devices, variable.path
        for variable in group.trainable_variables:
            slots = [s for s in model.optimizer.variables if variable.path.replace("/", "_") in s.path]
            assert len(slots) == 2, variable.path  # Adam's two
            for slot in slots:
                assert set(slot.value.layout.mesh.local_devices()) == devices, slot.path


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recompute_matches_one_device(schedule):
    weights, losses, _, final_weights, _ = reference("mlp2")
    strategy = pipeline_strategy("mlp2", 2, schedule)
    model = build_in(strategy, "mlp2", weights, functools.partial(build_pipeline_mlp, 2, recompute=True))
    got_losses, _ = train(model, *mlp_data(), batch_size=BATCH)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
    assert_weights_close(final_weights, model.get_weights())


def test_tensor_parallel_stage_weights_are_split(tmp_path):
    weights = reference("lm2")[0]
    strategy = pipeline_strategy("lm2", 2, "gpipe")
    model = build_in(strategy, "lm2", weights)
    kernel = model.get_layer("stage_1").group_layers[0].get_layer("ffn_in").kernel
    assert kernel.value.layout.sharding_specs == ["unsharded", "model"]
    text = tfmp.summary(model, print_fn=lambda _: None)
    # A line per group of devices that hold the same: here each stage's four.
    totals = {device_ranges([d]): kinds["total"] for d, kinds in bytes_per_device(model).items()}
    for first, last in ((0, 3), (4, 7)):
        held = {totals[f"CPU:{i}"] for i in range(first, last + 1)}
        assert len(held) == 1
        assert table_row(text, f"CPU:{first}-{last} ")[3] == format_bytes(held.pop())
    stages = [table_row(text, f"stage {k} ")[0] for k in (0, 1)]
    assert stages == ["stage 0", "stage 1"]


def test_save_and_load_round_trip(tmp_path):
    weights = reference("mlp2")[0]
    x, y = mlp_data()
    model = build_in(pipeline_strategy("mlp2", 2, "1f1b"), "mlp2", weights)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    path = str(tmp_path / "pipeline.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    assert_weights_close(model.get_weights(), plain.get_weights(), rtol=0, atol=0)
    with pipeline_strategy("mlp2", 4, "gpipe").scope():
        again = keras.models.load_model(path)
    assert_weights_close(model.get_weights(), again.get_weights(), rtol=0, atol=0)
    np.testing.assert_allclose(again.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    # Training goes on from the loaded optimizer state like from the original.
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    again.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert_weights_close(model.get_weights(), again.get_weights())


def test_balance_and_summary_show_stage_sizes():
    model = build_pipeline_mlp(4)
    layers = [layer for group in model.layers for layer in group.group_layers]
    stages = tfmp.balance(layers, 2)
    assert [[layer.name for layer in stage] for stage in stages] == [["up", "mid"], ["mid_2", "down"]]
    with pytest.raises(ValueError, match="only 4 layers"):
        tfmp.balance(layers, 5)


def test_bad_pipelines_give_clear_errors():
    mesh = tfmp.DeviceMesh((2, 1, 4), ("stage", "batch", "model"))
    with pytest.raises(ValueError, match="no layers"):
        tfmp.layers.LayerGroup([], stage=0)
    with pytest.raises(ValueError, match="1F1B needs at least one micro-batch per stage"):
        tfmp.ModelParallelStrategy(tfmp.DeviceMesh((4, 1, 2), ("stage", "batch", "model")), num_microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match="needs a pipeline"):
        tfmp.ModelParallelStrategy(tfmp.DeviceMesh((2, 4), ("batch", "model")), num_microbatches=2)
    with pytest.raises(ValueError, match="schedule='zigzag'"):
        tfmp.ModelParallelStrategy(mesh, schedule="zigzag")
    strategy = tfmp.ModelParallelStrategy(mesh, num_microbatches=4)
    x, y = mlp_data(40)
    with strategy.scope():
        shared = keras.layers.Dense(16, name="shared")
        with pytest.raises(ValueError, match="can belong to one stage only"):
            keras.Sequential([keras.Input((16,)), tfmp.layers.LayerGroup([shared], stage=0),
                              tfmp.layers.LayerGroup([shared], stage=1)])
        with pytest.raises(ValueError, match="stage 2, but the mesh's 'stage' axis has only 2"):
            keras.Sequential([keras.Input((16,)), tfmp.layers.LayerGroup([keras.layers.Dense(8)], stage=2)])
        with pytest.raises(ValueError, match="recompute=True and random layers"):
            keras.Sequential([keras.Input((16,)), tfmp.layers.LayerGroup(
                [keras.layers.Dense(8), keras.layers.Dropout(0.5)], stage=0, recompute=True)])
        one_stage = compile_mlp(keras.Sequential(
            [keras.Input((16,)), tfmp.layers.LayerGroup([keras.layers.Dense(8)], stage=0)]))
        outside = compile_mlp(keras.Sequential(
            [keras.Input((16,)), tfmp.layers.LayerGroup([keras.layers.Dense(8)], stage=0),
             keras.layers.Dense(8, name="loose")]))
        model = compile_mlp(build_pipeline_mlp(2))
        noisy = compile_mlp(keras.Sequential(
            [keras.Input((16,)), tfmp.layers.LayerGroup([keras.layers.Dense(8), keras.layers.Dropout(0.5)], stage=0),
             tfmp.layers.LayerGroup([keras.layers.Dense(8)], stage=1)]))
    # A mask of shape (1, 8) could be one sample's or shared by the batch.
    with pytest.raises(ValueError, match="micro-batches of 1 rows, and tfmp cannot tell"):
        noisy.fit(x[:4], y[:4], batch_size=4, verbose=0)
    with pytest.raises(ValueError, match=r"stages \[0\], but the mesh has 2 stages"):
        one_stage.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"layers \['loose'\] are in no"):
        outside.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="batch of 10 samples does not split into num_microbatches=4"):
        model.fit(x, y, batch_size=10, verbose=0)
    with strategy.scope():
        model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    with pytest.raises(ValueError, match="without run_eagerly=True"):
        model.fit(x, y, batch_size=8, verbose=0)


# Random layers, masked losses and batches of unknown size: each micro-batch
# must compute its part of what one device computes for the whole batch.


def build_noisy_pipeline() -> keras.Model:
    """Random layers in both stages: draws with one row per sample (Dropout,
    SpatialDropout1D's (batch, 1, channels) mask, GaussianNoise) and one draw
    shared by the batch (a noise shape of 1). Each gets a seed of its own, so
    that both runs start their SeedGenerators alike."""
    first = [keras.layers.Dense(32, activation="relu", name="up"),
             keras.layers.Dropout(0.3, seed=1), keras.layers.SpatialDropout1D(0.3, seed=2)]
    second = [keras.layers.GaussianNoise(0.2, seed=3),
              keras.layers.Dropout(0.3, noise_shape=(1, None, 32), seed=4),
              keras.layers.Dense(8, name="down")]
    return keras.Sequential(
        [keras.Input((3, 16)), tfmp.layers.LayerGroup(first, stage=0, name="stage_0"),
         tfmp.layers.LayerGroup(second, stage=1, name="stage_1")],
        name="noisy_pipeline",
    )


def noisy_data(n=STEPS * BATCH):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3, 16)).astype("float32")
    y = rng.normal(size=(n, 3, 8)).astype("float32")
    return x, y, rng.uniform(0.1, 2.0, size=(n, 1)).astype("float32")  # unequal sample weights


def build_masked_pipeline() -> keras.Model:
    """An Embedding(mask_zero=True) in stage 0 whose mask reaches the loss in stage 1."""
    first = [keras.layers.Embedding(20, 8, mask_zero=True, name="embed"),
             keras.layers.Dense(16, activation="relu", name="up")]
    return keras.Sequential(
        [keras.Input((6,), dtype="int32"), tfmp.layers.LayerGroup(first, stage=0, name="stage_0"),
         tfmp.layers.LayerGroup([keras.layers.Dense(5, name="down")], stage=1, name="stage_1")],
        name="masked_pipeline",
    )


def masked_data(n=STEPS * BATCH):
    """Padded token sequences of random lengths (0 to 6), so micro-batches
    hold different numbers of unmasked tokens, and unequal per-token weights."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, size=(n, 6)).astype("int32")
    lengths = rng.integers(0, 7, size=n)
    tokens[np.arange(6)[None, :] >= lengths[:, None]] = 0
    labels = rng.integers(0, 5, size=(n, 6)).astype("int32")
    return tokens, labels, rng.uniform(0.1, 2.0, size=(n, 6)).astype("float32")


def compile_adam(model, loss):
    metric = "mae" if loss == "mse" else "accuracy"
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=[metric])
    return model


TOKEN_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MICROBATCH_CASES = {
    "noisy": (build_noisy_pipeline, "mse", noisy_data),
    "masked": (build_masked_pipeline, TOKEN_LOSS, masked_data),
}


@functools.lru_cache(maxsize=None)
def microbatch_reference(case: str):
    """Initial weights, the single-device run of a case, and its seed states."""
    build, loss, data = MICROBATCH_CASES[case]
    keras.utils.set_random_seed(7)
    model = compile_adam(build(), loss)
    weights = model.get_weights()
    x, y, sample_weight = data()
    losses, history = train(model, x, y, batch_size=BATCH, sample_weight=sample_weight)
    predictions = model.predict(x, verbose=0)
    return weights, losses, history.history, model.get_weights(), predictions, seed_states(model)


def seed_states(model):
    layers = [layer for group in model.layers for layer in group.group_layers]
    return [keras.ops.convert_to_numpy(layer.seed_generator.state.value)
            for layer in layers if hasattr(layer, "seed_generator")]


def assert_trains_like_one_device(case, mesh_shape, num_microbatches, schedule):
    weights, losses, history, final_weights, predictions, states = microbatch_reference(case)
    build, loss, data = MICROBATCH_CASES[case]
    strategy = tfmp.ModelParallelStrategy(
        tfmp.DeviceMesh(mesh_shape, ("stage", "batch", "model")), {"up/kernel": (None, "model")},
        num_microbatches=num_microbatches, schedule=schedule,
    )
    with strategy.scope():
        model = build()
        model.set_weights(weights)
        compile_adam(model, loss)
    x, y, sample_weight = data()
    got_losses, got_history = train(model, x, y, batch_size=BATCH, sample_weight=sample_weight)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
    for key, values in history.items():
        np.testing.assert_allclose(got_history.history[key], values, rtol=1e-5)
    assert_weights_close(final_weights, model.get_weights())
    np.testing.assert_allclose(model.predict(x, verbose=0), predictions, rtol=1e-5, atol=1e-5)
    # Each SeedGenerator advanced once per step, as on one device.
    for want, got in zip(states, seed_states(model), strict=True):
        np.testing.assert_array_equal(got, want)
    return model


@pytest.mark.parametrize("num_microbatches,schedule", [(2, "gpipe"), (4, "1f1b")])
def test_random_layers_draw_like_one_device(num_microbatches, schedule):
    assert_trains_like_one_device("noisy", (2, 1, 4), num_microbatches, schedule)


@pytest.mark.parametrize(
    "num_microbatches,schedule,mesh_shape", [(2, "gpipe", (2, 1, 4)), (4, "1f1b", (2, 2, 2))]
)
def test_masked_loss_matches_one_device(num_microbatches, schedule, mesh_shape):
    tokens = masked_data()[0][:BATCH]
    unmasked = (tokens != 0).reshape(num_microbatches, -1).sum(axis=1)
    assert len(set(unmasked)) > 1, unmasked  # micro-batches weigh differently
    model = assert_trains_like_one_device("masked", mesh_shape, num_microbatches, schedule)
    if num_microbatches == 2:
        # evaluate runs whole batches through the stages: the mask crosses them too.
        x, y, _ = masked_data()
        reference = compile_adam(build_masked_pipeline(), TOKEN_LOSS)
        reference.set_weights(model.get_weights())
        expected = reference.evaluate(x, y, verbose=0)
        np.testing.assert_allclose(model.evaluate(x, y, verbose=0), expected, rtol=1e-5)


def test_batch_of_unknown_size_splits_at_run_time():
    # 40 samples in batches of 16: Keras traces the step again for the last
    # batch of 8, with the batch dimension unknown (None), and random layers
    # draw for a batch of unknown size.
    weights = microbatch_reference("noisy")[0]
    x, y, _ = noisy_data(40)
    reference = compile_adam(build_noisy_pipeline(), "mse")
    reference.set_weights(weights)
    strategy = tfmp.ModelParallelStrategy(
        tfmp.DeviceMesh((2, 1, 4), ("stage", "batch", "model")), num_microbatches=2, schedule="1f1b")
    with strategy.scope():
        model = compile_adam(build_noisy_pipeline(), "mse")
        model.set_weights(weights)
    losses, _ = train(reference, x, y, batch_size=BATCH)
    got_losses, _ = train(model, x, y, batch_size=BATCH)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
    assert_weights_close(reference.get_weights(), model.get_weights())
    # A batch of 9 does not split into 2 equal micro-batches: the host says so
    # before placing it, also where no callback reads the step's outputs.
    before = model.get_weights()
    indivisible = "batch of 9 samples does not split into num_microbatches=2"
    with pytest.raises(ValueError, match=indivisible):
        model.fit(x[:9], y[:9], batch_size=9, shuffle=False, verbose=0)
    with pytest.raises(ValueError, match=indivisible):
        model.train_on_batch(x[:9], y[:9])
    assert_weights_close(before, model.get_weights(), rtol=0, atol=0)
    # evaluate runs whole batches through the stages: any size works.
    model.evaluate(x[:9], y[:9], batch_size=9, verbose=0)
