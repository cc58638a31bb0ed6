"""What tfmp remembers about Keras' objects: one state object each, kept beside it.

tfmp keeps a few facts about the models, layers, variables and callbacks it
works with: whether `layout_map="auto"` has laid a model out, the compiled
function of a layer's eager call on its mesh, a variable's pipeline stage,
how far into its epoch a backup was taken. They are the fields of one state
object per Keras object, of the kinds below, kept in a weak map here and not
set as attributes on the objects: Keras' attribute tracking, `clone_model`
and saving never see them, and every such field is listed in this file.

A state must not hold its object strongly (the map could then never drop
it): where a field needs the object, it holds a `weakref`.

Examples:
    >>> import keras
    >>> from tfmp.state import ModelState, state_of
    >>> layer = keras.layers.Dense(2)
    >>> state_of(layer, ModelState).auto_planned
    False
    >>> state_of(layer, ModelState) is state_of(layer, ModelState)
    True
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, TypeVar


@dataclasses.dataclass
class ModelState:
    """What tfmp keeps about a model or layer.

    Attributes:
        eager_mesh_call: The `tf.function` that runs the layer's eager call
            on its mesh (`tfmp.strategy.keras_hooks`).
        adopted: Weak references to the optimizers and metrics the strategy
            brought onto its mesh, as `compile` last gave them.
        auto_planned: Whether `layout_map="auto"` has laid the model out.
        first_step_graphs: The per-device graphs of its first steps, for
            `tfmp.comm_report` (`tfmp.strategy.graph_capture`).
    """

    eager_mesh_call: Any = None
    adopted: tuple[weakref.ref, ...] = ()
    auto_planned: bool = False
    first_step_graphs: Any = None


@dataclasses.dataclass
class VariableState:
    """What tfmp keeps about a Keras variable.

    Attributes:
        declared_layout: `(layer, axes)` its layer declared, recorded when
            Keras creates the backing variable after the layer's `build`
            (`tfmp.layout.declare_deferred`).
        stage: The pipeline stage it belongs to (`tfmp.pipeline.stages`).
    """

    declared_layout: tuple[str, Any] | None = None
    stage: int | None = None


@dataclasses.dataclass
class BackupState:
    """What tfmp keeps about a `keras.callbacks.BackupAndRestore`.

    Attributes:
        resume: The progress recorded in the backup it restored (batches
            done, metric totals), until the resumed epoch begins.
        batches_done: Batches of the current epoch done, while a batch end
            may take a backup.
    """

    resume: dict[str, Any] | None = None
    batches_done: int | None = None


_State = TypeVar("_State", ModelState, VariableState, BackupState)

# id(object) -> {kind: state}; an entry goes when its object is collected.
# Keyed by id, not by the object: Keras variables are not hashable.
_states: dict[int, dict[type, Any]] = {}
_lock = threading.Lock()


def state_of(obj: Any, kind: type[_State]) -> _State:
    """`obj`'s state of `kind`, made empty the first time it is asked for."""
    key = id(obj)
    with _lock:
        states = _states.get(key)
        if states is None:
            states = _states[key] = {}
            weakref.finalize(obj, _states.pop, key, None).atexit = False
        if kind not in states:
            states[kind] = kind()
        return states[kind]


def known_state(obj: Any, kind: type[_State]) -> _State | None:
    """`obj`'s state of `kind` if tfmp has made one, else None."""
    return _states.get(id(obj), {}).get(kind)
