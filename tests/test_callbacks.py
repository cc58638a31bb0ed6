"""tfmp.callbacks: per-device memory and gradient synchronization."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from tfmp.callbacks.plot import _memory_figure, _memory_series
from helpers import MODELS, build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map, summary_events

WEIGHTS = initial_weights(build_mlp)
# Per device on 2x4: up 16x32/4 + 32/4, down 32x8/4 + 8 (bias replicated).
PARAMETER_BYTES = 4 * (16 * 8 + 8 + 8 * 8 + 8)


def strategy_2x4():
    device_mesh = mesh((2, 4))
    return tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))


def test_memory_monitor_logs_layout_bytes_to_history_and_tensorboard(tmp_path):
    model = build_on(strategy_2x4(), "mlp", WEIGHTS)
    monitor = tfmp.callbacks.DeviceMemoryMonitor(every_n_steps=2)
    board = keras.callbacks.TensorBoard(str(tmp_path))
    history = model.fit(*mlp_data(64), batch_size=16, epochs=2, verbose=0, callbacks=[monitor, board])
    adam_bytes = 2 * PARAMETER_BYTES + 8 + 4  # two slots, iteration and learning rate
    for i in range(8):
        assert history.history[f"mem/CPU_{i}/param_bytes"] == [PARAMETER_BYTES + adam_bytes] * 2
        assert history.history[f"mem/CPU_{i}/optimizer_bytes"] == [adam_bytes] * 2
        assert f"mem/CPU_{i}/peak_bytes" not in history.history  # CPU: not measurable
    assert history.history["mem/process/max_rss_bytes"][-1] > 0
    tags = set()
    for path in glob.glob(str(tmp_path / "train" / "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags |= {value.tag for value in event.summary.value}
    assert "epoch_mem/CPU_0/param_bytes" in tags


def test_tensorboard_histograms_of_split_weights_are_the_one_device_ones(tmp_path):
    """Keras' TensorBoard(histogram_freq=1) histograms every weight, split
    ones too, and logs every batch's loss; 37 rows end on a batch of 5."""
    logs = {}
    for name, strategy in (("one", None), ("mesh", strategy_2x4())):
        model = build_on(strategy, "mlp", WEIGHTS)
        board = keras.callbacks.TensorBoard(str(tmp_path / name), histogram_freq=1, update_freq="batch")
        model.fit(*mlp_data(37), batch_size=8, epochs=2, verbose=0, callbacks=[board])
        logs[name] = summary_events(tmp_path / name)
    assert len(logs["one"]["mlp/up/kernel/histogram"]) == 2 and len(logs["one"]["batch_loss"]) == 10
    assert sorted(logs["mesh"]) == sorted(logs["one"])
    for tag, want in logs["one"].items():
        assert len(logs["mesh"][tag]) == len(want), tag
        for (_, got), (_, expected) in zip(logs["mesh"][tag], want):
            if expected.dtype == object:  # the model's graph
                continue
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=tag)


def test_gradient_sync_traffic_of_a_column_row_mlp():
    model = build_on(strategy_2x4(), "mlp", WEIGHTS)
    monitor = tfmp.callbacks.GradientSyncMonitor()
    history = model.fit(*mlp_data(32), batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
    # Every parameter shard's gradient is all-reduced over "batch" once.
    assert history.history["sync/gradient_bytes"] == [PARAMETER_BYTES]
    assert history.history["sync/batch/bytes"][0] >= PARAMETER_BYTES
    # The row-parallel output: 8 rows per device x 8 outputs x 4 bytes.
    assert history.history["sync/model/bytes"][0] >= 8 * 8 * 4
    assert history.history["sync/mismatched_variables"] == [0.0]


def test_gradient_sync_traffic_counts_inputs_gathered_for_replicated_ops():
    """A depthwise convolution after a filter split gathers its input for
    ops DTensor has no layout rule for: counted, not a KeyError."""
    device_mesh = mesh((2, 4))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["filters/kernel"] = (None, None, None, "model")
    layout_map["filters/bias"] = ("model",)
    with tfmp.ModelParallelStrategy(device_mesh, layout_map).scope():
        model = keras.Sequential(
            [
                keras.Input((6, 6, 2)),
                keras.layers.Conv2D(8, 3, padding="same", name="filters"),
                keras.layers.DepthwiseConv2D(2, padding="same", name="depthwise"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(3),
            ]
        )
        model.compile("adam", "mse")
    monitor = tfmp.callbacks.GradientSyncMonitor()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 6, 6, 2)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    with pytest.warns(UserWarning, match="DepthwiseConv2dNative"):
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    gathered = [c for c in tfmp.comm_report(model, print_fn=lambda _: None).collectives if c.category == "replicated-ops"]
    assert gathered
    assert history.history["sync/replicated_op_bytes"] == [float(sum(c.bytes for c in gathered))]


def corrupt_one_copy(variable, delta=1.0):
    """Adds `delta` to the first element of device 5's copy only."""
    handle = dtensor.unpack(variable.value.handle)[5]
    with tf.device(handle.device):
        copy = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32).numpy()
        copy.flat[0] += delta
        tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(copy))


@pytest.mark.parametrize("layer", ["down", "up"])
def test_corrupted_replica_is_named_and_stops_training(layer):
    model = build_on(strategy_2x4(), "mlp", WEIGHTS)
    x, y = mlp_data(32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    variable = model.get_layer(layer).bias if layer == "down" else model.get_layer(layer).kernel
    corrupt_one_copy(variable)
    monitor = tfmp.callbacks.GradientSyncMonitor(on_mismatch="stop")
    with pytest.warns(UserWarning, match=rf"'mlp/{layer}/(bias|kernel)' differ across devices"):
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[monitor])
    assert len(history.history["loss"]) == 1  # stopped after the first check
    # The drifted copy, then the optimizer slots its different gradients fed.
    assert monitor.mismatches[0][0] == variable.path
    assert 0.5 < monitor.mismatches[0][1] < 1.5


def test_mirrored_strategy_is_supported():
    # Reduction through one device: MirroredStrategy's default collectives would
    # reuse group keys the DTensor tests of this process already hold.
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    model = build_on(strategy, "mlp", WEIGHTS)
    monitor = tfmp.callbacks.GradientSyncMonitor(on_mismatch="stop", grad_norms=True)
    x, y = mlp_data(32)
    history = model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
    for variable, norm in zip(model.trainable_variables, reference_gradient_norms("mlp", x[:16], y[:16])):
        np.testing.assert_allclose(history.history[f"grad_norm/{variable.path}"][0], norm, rtol=1e-5)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
    assert history.history["sync/gradient_bytes"] == [4 * (16 * 32 + 32 + 32 * 8 + 8)]
    assert history.history["sync/mismatched_variables"] == [0.0]
    copies = model.get_layer("down").bias.value.values
    copies[1].assign(copies[1] + 1.0)
    with pytest.warns(UserWarning, match="'mlp/down/bias' differ across devices"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[monitor])


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_mismatch='halt'"):
        tfmp.callbacks.GradientSyncMonitor(on_mismatch="halt")
    with pytest.raises(ValueError, match="every_n_steps=0"):
        tfmp.callbacks.DeviceMemoryMonitor(every_n_steps=0)


def test_plot_memory_writes_a_png_from_history_and_logdir(tmp_path):
    model = build_on(strategy_2x4(), "mlp", WEIGHTS)
    board = keras.callbacks.TensorBoard(str(tmp_path / "logs"))
    history = model.fit(
        *mlp_data(32), batch_size=16, epochs=2, verbose=0,
        callbacks=[tfmp.callbacks.DeviceMemoryMonitor(), board],
    )
    model.fit(
        *mlp_data(32), batch_size=8, epochs=1, verbose=0,
        callbacks=[tfmp.callbacks.DeviceMemoryMonitor(every_n_steps=2, log_dir=tmp_path / "steps")],
    )
    series, x_label = _memory_series(str(tmp_path / "steps"))
    assert x_label == "step"
    assert series["CPU_0", "param"][0] == [0, 2, 4]  # the start, then every 2 of 4 steps
    # TensorBoard's epochs are counted from 1, as in History.
    from_history, from_board = _memory_series(history), _memory_series(str(tmp_path / "logs"))
    assert from_board[1] == "epoch" and from_board[0] == from_history[0]
    sources = ((history, "history.png"), (str(tmp_path / "logs"), "logdir.png"), (str(tmp_path / "steps"), "steps.png"))
    for source, name in sources:
        path = tfmp.plot_memory(source, str(tmp_path / name))
        with open(path, "rb") as png:
            assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="DeviceMemoryMonitor"):
        tfmp.plot_memory({"loss": [1.0]}, str(tmp_path / "none.png"))


def test_plot_memory_draws_units_merged_devices_and_the_even_share():
    """Two groups of four devices holding different bytes, as two pipeline
    stages do, over 3 epochs."""
    history = {"loss": [1.0, 0.9, 0.8], "mem/process/max_rss_bytes": [2.0**30] * 3}
    for i in range(8):
        total, optimizer = (200, 130) if i < 4 else (100, 60)
        history[f"mem/CPU_{i}/param_bytes"] = [total * 1024.0] * 3
        history[f"mem/CPU_{i}/optimizer_bytes"] = [optimizer * 1024.0] * 3
    over_time, per_device = _memory_figure(*_memory_series(history)).axes

    legend = [text.get_text() for text in over_time.get_legend().get_texts()]
    assert legend == [
        "CPU:0-3 (parameters + optimizer)", "CPU:4-7 (parameters + optimizer)",
        "even share (total / 8 devices)",
    ]
    assert over_time.get_ylabel() == "memory (KiB)" and over_time.get_xlabel() == "epoch"
    assert [tick for tick in over_time.get_xticks() if 1 <= tick <= 3] == [1, 2, 3]
    stage_0, stage_1, even_share = (list(line.get_ydata()) for line in over_time.get_lines())
    assert (stage_0, stage_1, even_share) == ([200] * 3, [100] * 3, [150] * 3)

    assert per_device.get_ylabel() == "shard bytes (KiB)"
    parameters, optimizer = per_device.containers
    assert [bar.get_height() for bar in parameters] == [70] * 4 + [40] * 4
    assert [bar.get_height() for bar in optimizer] == [130] * 4 + [60] * 4
    assert [bar.get_y() for bar in optimizer] == [70] * 4 + [40] * 4  # stacked
    assert [label.get_text() for label in per_device.get_xticklabels()] == [f"CPU:{i}" for i in range(8)]
    assert list(per_device.get_lines()[0].get_ydata()) == [150, 150]


def reference_gradient_norms(name, x, y):
    """Norms of one device's gradients at the initial weights, by tape."""
    model = build_on(None, name, initial_weights(MODELS[name][0]))
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    return [float(tf.norm(tf.convert_to_tensor(g))) for g in gradients]


@pytest.mark.parametrize("name", ["mlp", "layers"])
def test_gradient_norms_equal_one_device(name):
    x, y = MODELS[name][3](16)
    expected = reference_gradient_norms(name, x, y)
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)), MODELS[name][1](mesh((2, 4))))
    model = build_on(strategy, name, initial_weights(MODELS[name][0]))
    monitor = tfmp.callbacks.GradientSyncMonitor(grad_norms=True)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
    for variable, norm in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(
            history.history[f"grad_norm/{variable.path}"][0], norm, rtol=1e-5, atol=1e-6
        )
    global_norm = np.sqrt(sum(n * n for n in expected))
    np.testing.assert_allclose(history.history["grad_norm/global"][0], global_norm, rtol=1e-5)


def test_collective_time_from_the_profiler(tmp_path):
    model = build_on(strategy_2x4(), "mlp", WEIGHTS)
    monitor = tfmp.callbacks.GradientSyncMonitor(profile_steps=(2, 3), profile_dir=str(tmp_path))
    history = model.fit(*mlp_data(32), batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    profiled = {key: values[0] for key, values in history.history.items() if key.startswith("sync/")}
    assert glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert 0 < profiled["sync/collective_seconds"] <= profiled["sync/op_seconds"]
    assert profiled["sync/op_seconds"] <= profiled["sync/profiled_step_seconds"]
    assert 0 < profiled["sync/collective_fraction"] <= 1
    with pytest.raises(ValueError, match=r"profile_steps=\(3, 2\)"):
        tfmp.callbacks.GradientSyncMonitor(profile_steps=(3, 2))
