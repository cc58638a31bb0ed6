"""DeviceMesh, LayoutMap and summary basics, and the `tfmp demo` command."""

import argparse
import os
import re
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import tfmp
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_layout_map, table_row
from tfmp import _env, cli
from tfmp.inspect.display import device_ranges, format_bytes
from tfmp.inspect.summary import bytes_per_device
from tfmp.layout import UndividedDimension, as_layout_map
from tfmp.strategy.undivided import undivided_message


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


# What TensorFlow's native libraries log that a user of the command line
# should not read: the absl line format, and the lines the issue met.
TENSORFLOW_NOISE = re.compile(
    r"^([IWEF]\d{4} \d\d:\d\d:|WARNING: All log messages before absl)"
    r"|cuInit|op_level_cost_estimator|cache key lookup missed|oneDNN|cudart_stub|rebuild TensorFlow",
    re.MULTILINE,
)


def run_tfmp(*args, timeout=600):
    """`python -m tfmp ARGS` in a fresh process, with TensorFlow's log level
    left to the command."""
    environment = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tfmp", *args],
        capture_output=True, text=True, timeout=timeout, env=environment,
    )


@pytest.fixture(scope="module")
def demo_run():
    finished = run_tfmp("demo", "--epochs", "2")
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    return finished


def test_demo_trains_and_prints(demo_run):
    out = demo_run.stdout
    assert "DeviceMesh(batch=2, model=4" in out
    assert "ffn_in/kernel" in out and "(None, 'model')" in out
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0]
    np.testing.assert_array_less(0, losses)


def test_demo_shows_progress_and_no_tensorflow_logs(demo_run):
    out = demo_run.stdout
    assert re.search(r"^Laying out the training step on 8 \w+ devices( \(simulated on one \w+\))?\.\.\.$", out, re.M)
    assert re.search(r"^Laid out in \d+\.\d s\.$", out, re.M)
    assert out.count("Laying out") == 1  # the second epoch reuses the step
    assert "Epoch 2/2" in out and "16/16" in out  # Keras' progress bar
    log = [line for line in demo_run.stderr.splitlines() if not line.startswith("import time:")]
    assert not TENSORFLOW_NOISE.search("\n".join(log)), log


@pytest.mark.parametrize(
    "flags, user_level, level",
    [((), None, "3"), (("--verbose",), None, "0"), ((), "1", "1"), (("--verbose",), "1", "0")],
)
def test_log_level_the_clients_get(flags, user_level, level):
    """What TensorFlow logs follows TF_CPP_MIN_LOG_LEVEL (3: nothing but fatal
    errors; 0: everything): the command's quiet default, the user's own
    setting, or --verbose. The clients read it without importing TensorFlow,
    to keep the test fast."""
    environment = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    if user_level is not None:
        environment["TF_CPP_MIN_LOG_LEVEL"] = user_level
    finished = subprocess.run(
        [
            sys.executable, "-m", "tfmp", "launch", *flags, "--num-processes", "1", "--devices-per-process", "1",
            "--", sys.executable, "-c", "import os; print(os.environ['TF_CPP_MIN_LOG_LEVEL'])",
        ],
        capture_output=True, text=True, timeout=120, env=environment,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout == f"[client 0] {level}\n"


@pytest.mark.parametrize("command", [(), ("demo",), ("launch",)])
def test_help_imports_no_tensorflow(command):
    finished = run_tfmp(*command, "--help", timeout=120)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.startswith(f"usage: tfmp {' '.join(command)}".rstrip())
    imported = [line.split("|")[-1].strip() for line in finished.stderr.splitlines() if line.startswith("import time:")]
    assert "tfmp.cli" in imported
    assert not [name for name in imported if name.split(".")[0] in ("tensorflow", "keras", "numpy")]


@pytest.mark.parametrize(
    "argv, orig_argv, expected",
    [
        (["/usr/local/bin/tfmp", "demo"], ["python3", "/usr/local/bin/tfmp", "demo"], True),  # console script
        (["-m", "demo"], ["python", "-W", "ignore", "-m", "tfmp", "demo"], True),  # python -m tfmp, importing tfmp
        (["/home/me/train.py"], ["python", "/home/me/train.py"], False),
        (["-m"], ["python", "-m", "mypackage.train"], False),  # mypackage imports tfmp
    ],
)
def test_only_the_tfmp_command_imports_the_library_lazily(monkeypatch, argv, orig_argv, expected):
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert _env.started_as_command() is expected


def test_every_option_has_help():
    parser = cli.build_parser()
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    for name, command in commands.choices.items():
        for action in command._actions:
            assert action.help, f"tfmp {name} {action.option_strings or action.dest} has no help text"


def test_undivided_dimensions_are_one_warning_with_the_replicated_share(capsys):
    device_mesh = tfmp.DeviceMesh((1, 3), ("batch", "model"))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["up/kernel"] = (None, "model")  # 5 units do not split in 3
    layout_map["up/bias"] = ("model",)
    layout_map["mid/kernel"] = (None, "model")  # 6 do
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(5, name="up"), keras.layers.Dense(6, name="mid")],
            name="odd",
        )
        model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((6, 4), "float32"), np.zeros((6, 6), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=3, epochs=1)
        model.fit(x, y, batch_size=3, epochs=1)
    messages = [str(warning.message) for warning in caught if "kept whole" in str(warning.message)]
    assert messages == [
        "tfmp: layouts split 2 dimensions of 2 variables over mesh axis 'model' of size 3, "
        "which does not divide their sizes, so they are kept whole: odd/up/kernel "
        "dimension 1 of size 5 (LayoutMap rule 'up/kernel'); odd/up/bias dimension 0 "
        "of size 5 (LayoutMap rule 'up/bias'). These variables hold 100 bytes (41% of the "
        "parameters); in all 124 of 244 parameter bytes (51%) are replicated on every device "
        "(optimizer slots follow their variables). Change the rules, or use a mesh axis "
        "'model' of size 5, which divides them all."
    ]
    assert not [w for w in caught if "replicated instead of split" in str(w.message)]
    # fit(verbose=1) says when its step is laid out, once; verbose=0 never.
    out = capsys.readouterr().out
    assert out.count("Laying out the training step on 3 CPU devices (simulated on one CPU)...") == 1
    assert len(re.findall(r"^Laid out in \d+\.\d s\.$", out, re.M)) == 1
    with strategy.scope():
        model.compile(optimizer="adam", loss="mse")  # a new step to lay out
    model.fit(x, y, batch_size=3, epochs=1, verbose=0)
    assert capsys.readouterr().out == ""


def test_undivided_warning_lists_a_few_and_counts_the_rest():
    undivided = [UndividedDimension(f"m/dense_{i}/kernel", 1, 12, "model", 8, "LayoutMap rule 'kernel'") for i in range(8)]
    parameters = {f"m/dense_{i}/kernel": (48, True) for i in range(8)}
    message = undivided_message(undivided, parameters)
    assert "m/dense_5/kernel dimension 1 of size 12" in message and "m/dense_6" not in message
    assert "; and 2 more." in message
    assert "384 of 384 parameter bytes (100%)" in message
    assert message.endswith("use a mesh axis 'model' of size 2, 3, 4 or 6, which divides them all.")
