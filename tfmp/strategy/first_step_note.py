"""`fit` on a mesh says that its first step is being laid out, and how long
that took: tracing the step and DTensor's SPMD expansion of it take seconds
to minutes, during which Keras' progress bar shows nothing."""

from __future__ import annotations

import time
from typing import Any

import keras
from tensorflow.experimental import dtensor

from tfmp.devices import is_simulated
from tfmp.integrations.internals import keras_io_utils
from tfmp.strategy.callback_lists import with_callback


class FirstStepNote(keras.callbacks.Callback):
    """Prints a line as the first training step starts and one as it ends,
    where Keras prints its progress bar (stdout, or absl logging after
    `keras.config.disable_interactive_logging()`)."""

    def __init__(self, mesh: dtensor.Mesh):
        super().__init__()
        device_type = mesh.device_type()
        where = f" (simulated on one {device_type})" if is_simulated(device_type) else ""
        self._begin_text = f"Laying out the training step on {mesh.size} {device_type} devices{where}..."
        self._started_at: float | None = None
        self._done = False

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self._started_at is None:
            keras_io_utils.print_msg(self._begin_text)
            self._started_at = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._started_at is not None and not self._done:
            self._done = True
            keras_io_utils.print_msg(f"Laid out in {time.perf_counter() - self._started_at:.1f} s.")


def with_first_step_note(callbacks: Any, model: Any, mesh: dtensor.Mesh, verbose: Any) -> Any:
    """`callbacks` (None, a list or a `CallbackList`) with a `FirstStepNote`
    first when `fit(verbose=...)` shows progress and its step is still to be
    traced; else as they are."""
    if verbose == 0 or getattr(model, "train_function", None) is not None:
        return callbacks
    return with_callback(callbacks, lambda: FirstStepNote(mesh), FirstStepNote, first=True)
