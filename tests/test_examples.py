"""The example scripts run, in their small modes."""

import os
import subprocess
import sys

from helpers import table_row

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(name, *args, timeout=300):
    finished = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), *args],
        capture_output=True, text=True, timeout=timeout,
    )
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    return finished.stdout


def test_tpu_script_runs_with_dry_run(tmp_path):
    out = run_example(
        "tpu_train.py", "--dry-run", "--epochs", "2", "--steps", "4", "--seq", "16",
        "--width", "64", "--vocab", "128", "--checkpoint-dir", str(tmp_path),
    )
    assert "source='cluster_resolver=TPUClusterResolver, one host'" in out
    assert "mesh: DeviceMesh(batch=2, model=4; 8 x CPU)" in out
    losses = [float(line.split("loss: ")[1].split()[0]) for line in out.splitlines() if " loss: " in line]
    assert len(losses) == 2 and losses[1] < losses[0]


def epoch_losses(out: str) -> list[float]:
    """The losses of the `epoch N: loss X, accuracy Y` lines."""
    return [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("epoch ")]


def line_with(out: str, start: str) -> str:
    """The first line of `out` (stripped) that starts with `start`."""
    return next(line.strip() for line in out.splitlines() if line.strip().startswith(start))


def number(text: str) -> float:
    """`"32,768"` -> 32768.0."""
    return float(text.replace(",", ""))


def in_bytes(size: str) -> float:
    """`"1.5 KiB"` (as tfmp prints sizes) -> 1536.0."""
    value, unit = size.split()
    return number(value) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(unit)


def test_mlp_column_row_trains_split_over_model():
    out = run_example("mlp_column_row.py", "--epochs", "3")
    losses = epoch_losses(out)
    assert len(losses) == 3 and losses[-1] < 0.7 * losses[0]
    # Each device holds a quarter of the hidden units' columns, then rows.
    assert table_row(out, "up_0/kernel ")[1:4] == ["(64, 256)", "(None, 'model')", "(64, 64)"]
    assert table_row(out, "down_0/kernel ")[1:4] == ["(256, 64)", "('model', None)", "(64, 64)"]
    # The 8 devices hold the same: one line, named short.
    assert table_row(out, "CPU:0-7 ")[0] == "CPU:0-7"


def test_gpt_example_logs_monitor_figures_to_history_and_tensorboard(tmp_path):
    out = run_example("gpt_tensor_data_parallel.py", "--epochs", "2", "--log-dir", str(tmp_path))
    losses = epoch_losses(out)
    assert len(losses) == 2 and losses[1] < losses[0]
    param_bytes = {number(line_with(out, f"mem/CPU_{i}/param_bytes:").split(": ")[1]) for i in range(8)}
    assert len(param_bytes) == 1 and param_bytes.pop() > 0  # the same shards on every device
    assert number(line_with(out, "sync/mismatched_variables:").split(": ")[1]) == 0
    for axis in ("batch", "model"):  # gradients over "batch", activations over "model"
        assert number(line_with(out, f"sync/{axis}/bytes:").split(": ")[1]) > 0
    assert list((tmp_path / "train").glob("events.out.tfevents.*"))


def test_cnn_channel_split_learns_the_quadrant():
    out = run_example("cnn_channel_split.py")
    losses = epoch_losses(out)
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0]
    validation_accuracy = float(line_with(out, "validation:").split("accuracy ")[1])
    assert validation_accuracy > 0.7  # chance: 0.25
    assert table_row(out, "block_0_filters/kernel ")[2:4] == ["(None, None, None, 'model')", "(3, 3, 3, 8)"]
    assert table_row(out, "block_0_channels/kernel ")[2:4] == ["(None, None, 'model', None)", "(3, 3, 8, 16)"]


def test_pipeline_example_balances_stages_and_trains_with_1f1b():
    out = run_example("pipeline_two_stage.py", "--schedule", "1f1b", "--epochs", "3")
    assert "schedule: 1f1b, micro-batches: 4" in out
    balanced = [number(line_with(out, f"balance: stage {k} ").split("(")[1].split()[0]) for k in (0, 1)]
    assert max(balanced) < 1.1 * min(balanced)
    losses = epoch_losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0]
    for stage in (0, 1):
        _, whole, fullest_device = table_row(out, f"stage {stage} ")  # tfmp.summary's per-stage table
        # Unsplit, a device would hold the stage's parameters and their two
        # Adam slots, 3x; split over "model", well under half of that.
        assert 0 < in_bytes(fullest_device) < 1.5 * in_bytes(whole)


def test_bigger_model_fits_the_budget_sharded():
    out = run_example("bigger_model.py", "--epochs", "8")
    budget = number(line_with(out, "budget:").split()[1])
    parameters, largest, accuracies = [], [], []
    for label in ("one device", "sharded over 4"):
        parameters.append(number(line_with(out, f"{label}: width").split(", ", 1)[1].split()[0]))
        used, _, of_budget = line_with(out, f"{label}: largest device").partition(" bytes of budget ")
        assert number(of_budget.split()[0]) == budget
        largest.append(number(used.split()[-1]))
        accuracies.append(float(line_with(out, f"{label}: validation").split("accuracy ")[1]))
    assert all(0.9 * budget < used <= budget for used in largest)
    assert parameters[1] >= 3 * parameters[0]
    assert min(accuracies) > 0.5  # ten digits: chance is 0.1
    sharded_devices = line_with(out, "sharded over 4: bytes per device:").split("device: ")[1].split(", ")
    assert len(sharded_devices) == 4
    assert all(number(device.split()[1]) <= budget for device in sharded_devices)
