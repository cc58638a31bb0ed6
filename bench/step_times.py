"""The first `fit` step and the median later step of a compiled model, for
the benchmarks that compare two ways of running one model side by side.

Shared by the scripts in bench/ (they run as `python bench/<script>.py`, so
this folder is on `sys.path`: `import step_times`).
"""

from __future__ import annotations

import time
from typing import Callable

import keras
import numpy as np


class _BatchEnds(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.times.append(time.perf_counter())


def first_and_later_step(model: keras.Model, x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[float, float]:
    """Seconds of the first step (trace, layout, first run: one `fit` of one
    batch), then the median seconds between the ends of consecutive steps
    of a `fit` over all of `x` (Keras reads each step's logs at its end,
    which waits for the step). The gaps leave out what `fit` does before its
    first step and after its last (opening and closing the data, callbacks),
    which the seconds of the whole `fit` would spread over its steps."""
    start = time.perf_counter()
    model.fit(x[:batch_size], y[:batch_size], batch_size=batch_size, verbose=0)
    first = time.perf_counter() - start
    batch_ends = _BatchEnds()
    model.fit(x, y, batch_size=batch_size, verbose=0, callbacks=[batch_ends])
    return first, float(np.median(np.diff(batch_ends.times)))


# The order a benchmark of a lowering's two ways runs them: the native way
# first and last, bracketing the machine's drift.
WAYS = ("native", "taps", "native again")


def compare_ways(
    measure: str,
    case: str,
    use_way: Callable[[str], None],
    build: Callable[[], keras.Model],
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    describe: Callable[[keras.Model], str] | None = None,
) -> dict[str, tuple[float, float]]:
    """Times a fresh `build()` for each of `WAYS` (`use_way(way)` switches
    the lowering first), printing each way's steps (and `describe(model)`
    after training), then RESULT lines of the taps' first and later step
    over each native run's. Returns the times by way; the caller restores
    its lowering's setting."""
    times = {}
    for way in WAYS:
        use_way(way)
        model = build()
        times[way] = first_and_later_step(model, x, y, batch_size)
        extra = f", {describe(model)}" if describe else ""
        print(
            f"{case}, {way}: first step {times[way][0]:.2f} s, later steps {times[way][1] * 1000:.1f} ms{extra}",
            flush=True,
        )
    for way in ("native", "native again"):
        for index, step in enumerate(("first step", "later step")):
            print(
                f'RESULT measure="{measure}, {step}: taps / {way}" '
                f"ratio={times['taps'][index] / times[way][index]:.2f}",
                flush=True,
            )
    return times
