"""Canaries: each DTensor bug or missing layout rule tfmp works around is
still there.

`tests/dtensor_canaries.py` reproduces each one on raw DTensor (TensorFlow
ops on a 2x4 mesh, no tfmp) in a fresh process without DTensor's replicated
switches: an op of `tfmp._env.REPLICATED_OPS` that still has no rule, an
error or wrong values that a lowering or an integration patch works around.
When a TensorFlow release fixes one, `test_each_workaround_is_still_needed`
fails, saying what DTensor does now and which workaround to remove; when a
workaround is added without a canary, `test_every_workaround_has_a_canary`
fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tfmp._env import REPLICATED_BY_DEFAULT, REPLICATED_OPS
from tfmp import integrations
from tfmp.lowering import lowerings

PROBES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dtensor_canaries.py")

# Workarounds without a canary here, and why.
WITHOUT_CANARY = {
    "backend.lstm": "cuDNN's CudnnRNNV3 runs on a GPU only",
    "backend.gru": "cuDNN's CudnnRNNV3 runs on a GPU only",
    "random.gamma": "its ops are REPLICATED_OPS entries, each with a canary",
    "random.binomial": "its ops are REPLICATED_OPS entries, each with a canary",
    "random.beta": "its ops are REPLICATED_OPS entries, each with a canary",
    "random.categorical": "its ops are REPLICATED_OPS entries, each with a canary",
    "tf.call_function": "tfmp's step watch, no DTensor behaviour",
    "tf.parse_message": "TensorFlow's own time to parse a long error message, no DTensor "
    "behaviour (tests/test_errors.py holds its results to TensorFlow's)",
    "tf._graph_mode_decorator": "TensorFlow's gradient registry keeping a traced custom gradient, no "
    "DTensor behaviour (tests/test_released_graphs.py fails when TensorFlow releases it)",
    "tf.gather_nd": "it crashes the process (rank-7 indices), no probe for a shared process",
    "tf.gather": "it crashes the process (a negative batch_dims), no probe for a shared process",
    # Not reproduced by a small raw-DTensor program: Keras' models meet them
    # (the lowering's own tests train those).
    "numpy.add": "not reproduced on raw DTensor yet",
    "math.top_k": "not reproduced on raw DTensor yet (2x4, splits of batch and k's dimension)",
    "numpy.mean": "not reproduced on raw DTensor yet (2x4, kept dimensions split)",
    "numpy.clip": "not reproduced on raw DTensor yet (it needs a batch size unknown when traced)",
    "tf.concat": "not reproduced on raw DTensor yet (a row-split matmul after concat(axis=-1))",
    "Size": "not reproduced on raw DTensor yet (a gather's gradient in a step traced with a "
    "time dimension unknown: tests/test_lowering_rnn.py's sequences of any length)",
    "tf.unsorted_segment_sum": "not reproduced on raw DTensor yet (rows known only at run time "
    "summed into a split table, inside an optimizer's sparse update)",
    "numpy.einsum": "not reproduced on raw DTensor yet (Keras' rewrite of Gemma's 5-D score "
    "einsums, with dropout on the scores, under context parallelism)",
}


def workarounds() -> set[str]:
    """Every lowering, integration patch of TensorFlow and replicated op, by
    the names the probes use."""
    lowered = {f"{lowering.target.rsplit('.', 1)[-1]}.{lowering.attribute}" for lowering in lowerings()}
    patches = {
        f"tf.{d.patch.attribute}"
        for d in integrations.declarations()
        if d.patch.package == "tensorflow" and d.patch.kind != "lowering"
    }
    return lowered | patches | set(REPLICATED_OPS)


@pytest.fixture(scope="module")
def canaries() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(REPLICATED_BY_DEFAULT)}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    finished = subprocess.run(
        [sys.executable, PROBES], env=env, capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout)


def test_each_workaround_is_still_needed(canaries):
    fixed = [
        f"{name}: DTensor now {result['saw']}: remove {result['remove']}"
        for name, result in canaries.items()
        if not result["still"]
    ]
    assert not fixed, "\n".join(fixed)


def test_every_workaround_has_a_canary(canaries):
    covered = {name for result in canaries.values() for name in result["covers"]}
    missing = workarounds() - covered - set(WITHOUT_CANARY)
    assert not missing, f"Add a probe to tests/dtensor_canaries.py (or a reason to WITHOUT_CANARY) for: {sorted(missing)}"
    stale = set(WITHOUT_CANARY) - workarounds()
    assert not stale, f"These workarounds are gone: drop them from WITHOUT_CANARY: {sorted(stale)}"
