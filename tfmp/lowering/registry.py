"""The table of lowerings, and installing them once per process."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

from tfmp import integrations
from tfmp.forward import forward_mesh


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One Keras backend function that runs `replacement` on a tfmp mesh.

    Attributes:
        module: Module that holds the function, e.g.
            `"keras.src.backend.tensorflow.nn"`.
        name: The function's name in that module.
        replacement: `"package.module:function"` taking the same arguments.
        why: What DTensor refuses in Keras' own version.
        since: The first Keras release that has the function (older ones
            have nothing to lower).
    """

    module: str
    name: str
    replacement: str
    why: str
    since: str = "3.12"

    def in_installed_keras(self) -> bool:
        """Whether the installed Keras is a release that has the function."""
        return integrations.is_at_least(integrations.installed_version("keras"), self.since)

    def resolve(self) -> tuple[Any, Callable]:
        """The target module and tfmp's replacement function."""
        module_name, function_name = self.replacement.split(":")
        return importlib.import_module(self.module), getattr(
            importlib.import_module(module_name), function_name
        )


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


def lowerings() -> tuple[Lowering, ...]:
    """Every lowering, family by family."""
    return tuple(
        lowering
        for family in _FAMILIES
        for lowering in importlib.import_module(family).LOWERINGS
    )

_installed = False


def install() -> None:
    """Wraps each target once: tfmp's version while a forward pass is
    traced on a mesh, Keras' own otherwise."""
    global _installed
    if _installed:
        return
    _installed = True
    for lowering in filter(Lowering.in_installed_keras, lowerings()):
        module, replacement = lowering.resolve()
        original = getattr(module, lowering.name)
        setattr(module, lowering.name, _on_mesh_only(original, replacement))


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
