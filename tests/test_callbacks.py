"""tfmp.callbacks: per-device memory and gradient synchronization."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfmp
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map

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
        assert f"mem/CPU_{i}/peak_bytes" not in history.history  # CPU: not measurable
    assert history.history["mem/process/max_rss_bytes"][-1] > 0
    tags = set()
    for path in glob.glob(str(tmp_path / "train" / "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags |= {value.tag for value in event.summary.value}
    assert "epoch_mem/CPU_0/param_bytes" in tags


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
    with strategy.scope():
        model = build_mlp()
        model.compile(optimizer="adam", loss="mse")
    monitor = tfmp.callbacks.GradientSyncMonitor(on_mismatch="stop")
    x, y = mlp_data(32)
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
    for source, name in ((history, "history.png"), (str(tmp_path / "logs"), "logdir.png")):
        path = tfmp.plot_memory(source, str(tmp_path / name))
        with open(path, "rb") as png:
            assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="DeviceMemoryMonitor"):
        tfmp.plot_memory({"loss": [1.0]}, str(tmp_path / "none.png"))
