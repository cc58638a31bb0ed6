"""`Lowering`, the declaration of one rewritten Keras backend function."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

from tfmp import integrations
from tfmp.forward import forward_mesh


@dataclasses.dataclass(frozen=True)
class Lowering(integrations.Patch):
    """One Keras backend function that runs `wrapper` on a tfmp mesh: a
    `tfmp.integrations.Patch` of `kind="lowering"`.

    Declared positionally as `Lowering(target, attribute, wrapper, why)`:
    the module that holds the function (e.g.
    `"keras.src.backend.tensorflow.nn"`), its name, the tfmp function that
    takes the same arguments and runs instead while a forward pass is traced
    on a mesh, and what DTensor
    refuses in Keras' own version; `since` names the first release that has
    the function when the oldest tested one lacks it. With
    `outside_layers=True` the wrapper runs wherever it is called (a loss
    computed by the step, outside any layer) and hands back to Keras' own
    (`keras_original`) where it does not apply.

    Examples:
        >>> from tfmp.lowering import Lowering, rnn
        >>> lowering = Lowering(
        ...     "keras.src.backend.tensorflow.numpy",
        ...     "split",
        ...     rnn.split,
        ...     "ReverseV2 has no DTensor layout propagation",
        ... )
        >>> lowering.kind, lowering.package
        ('lowering', 'keras')
    """

    kind: str = "lowering"
    outside_layers: bool = False

    def replacement(self, original: Callable) -> Callable:
        """tfmp's version while a forward pass is traced on a mesh (or
        always, `outside_layers`), Keras' own otherwise."""
        return _on_mesh_only(original, self.wrapper, self.outside_layers)


def keras_original(module: str, name: str) -> Callable:
    """Keras' own function behind a lowered one (for the argument
    combinations a replacement hands back to Keras)."""
    function = getattr(importlib.import_module(module), name)
    return getattr(function, "__wrapped_keras__", function)


def _on_mesh_only(original: Callable, replacement: Callable, outside_layers: bool = False) -> Callable:
    @functools.wraps(original)
    def lowered(*args: Any, **kwargs: Any) -> Any:
        if forward_mesh() is None and not outside_layers:
            return original(*args, **kwargs)
        return replacement(*args, **kwargs)

    lowered.__wrapped_keras__ = original
    return lowered
