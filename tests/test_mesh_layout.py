"""DeviceMesh, LayoutMap and summary basics, and the `tfmp demo` command."""

import re

import keras
import numpy as np
import pytest

import tfmp
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_layout_map
from tfmp import cli
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
    assert "mlp/up/kernel" in text and "(None, 'model')" in text and "(16, 8)" in text
    # up: 16*32/4 + 32/4, down: 32*8/4 + 8 (bias replicated) float32 values.
    parameters = 4 * (16 * 8 + 8 + 8 * 8 + 8)
    totals = bytes_per_device(model)
    assert len(totals) == 8
    for kinds in totals.values():
        assert kinds["parameters"] == parameters
        # Adam: two slots per variable with its layout, plus iteration and lr.
        assert kinds["optimizer"] == 2 * parameters + 8 + 4


def test_summary_of_a_plain_model():
    model = build_mlp()
    text = tfmp.summary(model, print_fn=lambda _: None)
    assert "mlp/down/kernel" in text and " - " in text


def test_demo_trains_and_prints(capsys):
    assert cli.main(["demo", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "DeviceMesh(batch=2, model=4" in out
    assert "ffn_in/kernel" in out and "(None, 'model')" in out
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0]
    np.testing.assert_array_less(0, losses)
