"""The table of lowerings, and installing them once per process."""

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
    `"keras.src.backend.tensorflow.nn"`), its name, the
    `"package.module:function"` that takes the same arguments and runs
    instead while a forward pass is traced on a mesh, and what DTensor
    refuses in Keras' own version; `since` names the first release that has
    the function when the oldest tested one lacks it.

    Examples:
        >>> from tfmp.lowering import Lowering
        >>> lowering = Lowering(
        ...     "keras.src.backend.tensorflow.numpy",
        ...     "flip",
        ...     "tfmp.lowering.rnn:flip",
        ...     "ReverseV2 has no DTensor layout propagation",
        ... )
        >>> lowering.kind, lowering.package
        ('lowering', 'keras')
    """

    kind: str = "lowering"

    def apply(self) -> None:
        """Wraps the target: tfmp's version while a forward pass is traced
        on a mesh, Keras' own otherwise."""
        setattr(self.owner(), self.attribute, _on_mesh_only(self.original(), self.wrapper_function()))


# Each module holds the lowerings of one op family, as a tuple `LOWERINGS`.
_FAMILIES = (
    "tfmp.lowering.conv",
    "tfmp.lowering.rnn",
    "tfmp.lowering.random",
    "tfmp.lowering.indexing",
    "tfmp.lowering.image",
    "tfmp.lowering.pooling",
    "tfmp.lowering.reduction",
    "tfmp.lowering.elementwise",
    "tfmp.lowering.arrays",
    "tfmp.lowering.loops",
    "tfmp.lowering.replicated",
)


def families() -> list[Any]:
    """The family modules, each with its `LOWERINGS`."""
    return [importlib.import_module(family) for family in _FAMILIES]


def lowerings() -> tuple[Lowering, ...]:
    """Every lowering, family by family."""
    return tuple(lowering for family in families() for lowering in family.LOWERINGS)

_installed = False


def install() -> None:
    """Applies every lowering of the installed libraries, once."""
    global _installed
    if _installed:
        return
    _installed = True
    for lowering in filter(Lowering.in_installed_library, lowerings()):
        lowering.apply()


def keras_original(module: str, name: str) -> Callable:
    """Keras' own function behind a lowered one (for the argument
    combinations a replacement hands back to Keras)."""
    function = getattr(importlib.import_module(module), name)
    return getattr(function, "__wrapped_keras__", function)


def _on_mesh_only(original: Callable, replacement: Callable) -> Callable:
    @functools.wraps(original)
    def lowered(*args: Any, **kwargs: Any) -> Any:
        if forward_mesh() is None:
            return original(*args, **kwargs)
        return replacement(*args, **kwargs)

    lowered.__wrapped_keras__ = original
    return lowered
