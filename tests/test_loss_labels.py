"""A label outside the classes stops the step on every mesh, as on one device.

TensorFlow's CPU kernel of `SparseSoftmaxCrossEntropyWithLogits` refuses
such a label. On a mesh whose vocabulary-parallel head splits the classes,
DTensor's expansion of it trained on the label without a word (2x4 below,
before `tfmp.lowering.losses`); with the batch split, the device holding
the label failed and the error the step raised was another device's
cancellation, explained as a layout problem. The step now checks every
label over the whole batch before any device computes its loss, so no
device applies the step's update. Which device's error arrives first stays
a race: the label's own error, or tfmp's cancellation error saying where
TensorFlow logged it. Each case runs `programs/bad_label.py` in a process of
its own: TensorFlow keeps the collectives of a failed step aborted for the
rest of the process.
"""

import json
import os
import subprocess
import sys

import pytest

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "bad_label.py")


@pytest.mark.parametrize(
    "mesh, label",
    [("2x4", 64), ("2x4", -1), ("8x1", 64), ("2x2x2", 64)],
    ids=["vocabulary-split-past-the-end", "vocabulary-split-negative", "batch-split", "context-parallel"],
)
def test_a_label_outside_the_vocabulary_stops_the_step(mesh, label):
    finished = subprocess.run(
        [sys.executable, PROGRAM, mesh, str(label)], capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    if result["error"] == "CancelledError":
        assert "another of its devices failed" in result["message"], result
        assert "Local rendezvous is aborting with status:" in result["message"], result
    else:
        assert result["error"] == "InvalidArgumentError", result
        assert "label value" in result["message"], result
        assert "outside the valid range of [0, 64)" in result["message"], result
    assert result["weights_kept"], result
