"""DeviceMesh, LayoutMap and summary basics, and the `tfmp demo` command."""

import re

import keras
import numpy as np
import pytest

import tfmp
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_layout_map, table_row
from tfmp import cli
from tfmp.inspect.display import device_ranges, format_bytes
from tfmp.inspect.summary import bytes_per_device
from tfmp.layout import as_layout_map


def test_mesh_shape_axes_and_devices():
    device_mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
    assert device_mesh.shape == (2, 4)
    assert device_mesh.axis_size("model") == 4
    assert device_mesh.devices.shape == (2, 4)
    assert device_mesh.devices[1, 0].endswith("CPU:4")
    assert device_mesh.dtensor_mesh.dim_size("batch") == 2
    assert device_mesh == tfmp.DeviceMesh((2, 4), ("batch", "model"), [f"cpu:{i}" for i in range(8)])


def test_layout_map_matches_like_keras():
    layout_map = tfmp.LayoutMap(mesh((2, 4)))
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["dense_1/bias"] = ("model",)
    assert layout_map["model/dense_3/kernel"] == (None, "model")
    assert layout_map["dense_1/bias"] == ("model",)
    assert layout_map["dense_1/gamma"] is None
    assert layout_map.unmatched_keys() == ["dense.*kernel", "dense_1/bias"]
    assert layout_map.match("model/dense_3/kernel") == ("dense.*kernel", (None, "model"))
    assert layout_map.unmatched_keys() == ["dense_1/bias"]
    assert len(layout_map) == 2 and list(layout_map) == ["dense.*kernel", "dense_1/bias"]


def test_layout_map_refuses_a_duplicate_key_as_keras_does():
    layout_map = tfmp.LayoutMap(mesh((2, 4)))
    layout_map["dense/kernel"] = (None, "model")
    with pytest.raises(ValueError, match=r"already has a rule for 'dense/kernel'.*del layout_map"):
        layout_map["dense/kernel"] = ("model", None)
    del layout_map["dense/kernel"]
    layout_map["dense/kernel"] = ("model", None)
    assert layout_map["dense/kernel"] == ("model", None)


def test_keras_layout_map_matches_by_the_installed_keras_lookup():
    keras_mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), [f"cpu:{i}" for i in range(8)])

    class SearchingLayoutMap(keras.distribution.LayoutMap):
        """The lookup of Keras releases that searched keys anywhere in the path."""

        def __getitem__(self, key):
            if key in self._layout_map:
                return self._layout_map[key]
            found = [pattern for pattern in self._layout_map if re.search(pattern, key)]
            return self._layout_map[found[0]] if len(found) == 1 else None

    for keras_map_type, matches_inside in ((keras.distribution.LayoutMap, False), (SearchingLayoutMap, True)):
        keras_map = keras_map_type(keras_mesh)
        keras_map["up/kernel"] = (None, "model")
        converted = as_layout_map(keras_map, mesh((2, 4)))
        expected = (None, "model") if matches_inside else None
        assert converted["mlp/up/kernel"] == expected
        assert converted["up/kernel"] == (None, "model")


def test_summary_counts_shard_bytes_per_device():
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    model = build_on(strategy, "mlp", initial_weights(build_mlp))
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    text = tfmp.summary(model, print_fn=lambda _: None)
    # up: 16*32/4 + 32/4, down: 32*8/4 + 8 (bias replicated) float32 values.
    parameters = 4 * (16 * 8 + 8 + 8 * 8 + 8)
    totals = bytes_per_device(model)
    assert len(totals) == 8
    for kinds in totals.values():
        assert kinds["parameters"] == parameters
        # Adam: two slots per variable with its layout, plus iteration and lr.
        assert kinds["optimizer"] == 2 * parameters + 8 + 4

    lines = text.splitlines()
    # Plain text for a log or a notebook: no colour codes, no cell cut short.
    assert "\x1b" not in text and "\u2026" not in text
    # Short device names; the full name once, in the first line.
    assert lines[0] == "devices: CPU:0-7, short for /job:localhost/replica:0/task:0/device:CPU:0-7"
    assert text.count("/device:") == 1
    assert table_row(text, "mlp/up/kernel") == ["mlp/up/kernel", "(16, 32)", "(None, 'model')", "(16, 8)", "512 B"]
    assert table_row(text, "mlp/down/bias") == ["mlp/down/bias", "(8,)", "(None,)", "(8,)", "32 B"]
    # No variable is gathered on use: no "read as" column, no column of "same".
    assert "read as" not in text and " same " not in text
    # Every device holds the same: one line, in KiB. The replicated share:
    # down/bias and its two slots, and Adam's two scalars, of the total.
    replicated = 32 * 3 + 8 + 4
    total = 3 * parameters + 12
    assert table_row(text, "devices ") == ["devices", "parameters", "optimizer", "total", "replicated"]
    assert table_row(text, "CPU:0-7 ") == ["CPU:0-7", "832 B", "1.6 KiB", "2.4 KiB", f"{replicated / total:.0%}"]
    prose = " ".join(lines)
    assert (
        f"Replicated on CPU:0-7: {replicated / total:.0%} of each device's bytes, {replicated} B in "
        "1 parameter variable (largest: mlp/down/bias 32 B) and 4 optimizer variables."
    ) in prose
    for column in ("layout:", "shard:", "replicated (held whole by every device"):
        assert column in prose


def test_summary_of_a_plain_model():
    model = build_mlp()
    text = tfmp.summary(model, print_fn=lambda _: None)
    assert "mlp/down/kernel" in text and " - " in text
    assert "no variable is on a mesh" in text.splitlines()[0]
    assert table_row(text, "CPU:0 ") == ["CPU:0", "3.2 KiB", "0 B", "3.2 KiB"]


@pytest.mark.parametrize(
    "size, text",
    [(0, "0 B"), (1023, "1,023 B"), (1024, "1.0 KiB"), (39_852, "38.9 KiB"),
     (5 * 2**20, "5.0 MiB"), (3 * 2**30, "3.0 GiB")],
)
def test_bytes_read_in_binary_units(size, text):
    assert format_bytes(size) == text


def test_devices_named_short_in_ranges():
    assert device_ranges([f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1, 2, 5)]) == "CPU:0-2,5"
    assert device_ranges(["GPU_1", "GPU_0", "task1_GPU_0"]) == "GPU:0-1, task1/GPU:0"


def test_demo_trains_and_prints(capsys):
    assert cli.main(["demo", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "DeviceMesh(batch=2, model=4" in out
    assert "ffn_in/kernel" in out and "(None, 'model')" in out
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0]
    np.testing.assert_array_less(0, losses)
