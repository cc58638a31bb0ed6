"""The example scripts run, in their small modes."""

import os
import subprocess
import sys

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
    assert "mesh: DeviceMesh(batch=2, model=4; 8 x CPU)" in out
    losses = [float(line.split("loss: ")[1].split()[0]) for line in out.splitlines() if " loss: " in line]
    assert len(losses) == 2 and losses[1] < losses[0]
