"""Adding tfmp's own callbacks to the callbacks a user gave a Keras call."""

from __future__ import annotations

from typing import Any, Callable

import keras


def with_callback(callbacks: Any, make: Callable[[], keras.callbacks.Callback], kind: type, first: bool = False) -> Any:
    """`callbacks` (None, a list or a `CallbackList`) with `make()` added,
    first or last, unless a callback of type `kind` is among them already
    (Keras hands `evaluate` the `CallbackList` of the `fit` it runs in)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        if not any(isinstance(callback, kind) for callback in callbacks.callbacks):
            callbacks.callbacks.insert(0 if first else len(callbacks.callbacks), make())
            callbacks._configure_async_dispatch(callbacks.callbacks)  # noqa: SLF001
        return callbacks
    callbacks = list(callbacks or [])
    if not any(isinstance(callback, kind) for callback in callbacks):
        callbacks.insert(0 if first else len(callbacks), make())
    return callbacks
