"""The first `fit` step and the mean later step of a compiled model, for the
benchmarks that compare two ways of running one model side by side.

Shared by the scripts in bench/ (they run as `python bench/<script>.py`, so
this folder is on `sys.path`: `import step_times`).
"""

from __future__ import annotations

import time

import keras
import numpy as np


def first_and_later_step(model: keras.Model, x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[float, float]:
    """Seconds of the first step (trace, layout, first run: one `fit` of one
    batch), then the mean seconds per step of a `fit` over all of `x`."""
    start = time.perf_counter()
    model.fit(x[:batch_size], y[:batch_size], batch_size=batch_size, verbose=0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, verbose=0)
    return first, (time.perf_counter() - start) / (len(x) // batch_size)
