"""Errors of a training step on the mesh reach the user.

A step on a DTensor mesh returns before its devices finish; an op that fails
on one device (an id past an Embedding's vocabulary, say) fails the step's
outputs, and only reading them raises. Keras reads them once per step through
`pythonify_logs`, which skips any value it cannot convert: with `verbose=0`
the failed steps were skipped without a word (`loss` 0.0, weights unchanged).
tfmp's `fit` and `evaluate` add `StepErrors`, which reads every step's logs and
lets the error through. The cost is one wait for the step's outputs per step,
which Keras' progress bar (`verbose=1`) pays anyway.
"""

from __future__ import annotations

import numbers
from typing import Any

import keras
import numpy as np

from tfmp.strategy.callback_lists import with_callback


class StepErrors(keras.callbacks.Callback):
    """Reads each step's logs, raising the error of a step that failed."""

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        _read(logs)

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        _read(logs)


def _read(logs: dict | None) -> None:
    for value in (logs or {}).values():
        if not isinstance(value, (numbers.Number, str)):
            np.asarray(value)


def with_step_errors(callbacks: Any) -> Any:
    """`callbacks` (None, a list or a `CallbackList`) with a `StepErrors`."""
    return with_callback(callbacks, StepErrors, StepErrors)
