"""Splits the host CPU into 8 logical devices once for the whole test session,
and keeps Python's garbage collector from rescanning what earlier modules left."""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow turns oneDNN on by itself only on CPUs with AVX-512. Without it,
# its CPU kernels refuse channels-first and dilated convolution gradients, and
# sum matmuls in another order (parity 2.5e-5 off on an AVX2-only machine).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import pytest  # noqa: E402

import tfmp  # noqa: E402

tfmp.simulate_devices(8)


@pytest.fixture(autouse=True, scope="module")
def frozen_heap():
    """Collects, then freezes what survives, before each test module.

    The session traces thousands of functions whose graphs stay alive, and
    each full collection rescans all of them: late in a session, tests that
    trace a lot ran up to 4x slower than alone (the fully sharded LM: 64 s
    against 9 s). Frozen objects are skipped by later collections.
    """
    gc.collect()
    gc.freeze()
    yield
