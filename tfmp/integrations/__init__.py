"""Every place tfmp changes Keras, tf_keras, Orbit or TensorFlow, as data.

tfmp trains ordinary Keras models, so it meets those libraries at a few of
their entry points: `Layer.__call__`, the trainer's `fit`, tf_keras' step
functions, Orbit's loops, DTensor's Relayout gradient. Each such change is a
`Patch` in one of this package's modules (one per library), naming what it
replaces, the tfmp function that wraps the original, why, and the library
versions it was tested on. The Keras backend functions that tfmp rewrites on
a mesh (`tfmp.lowering`) are `Patch`es too, of `kind="lowering"`, declared
by their op family; `tfmp.integrations.table` lists every declaration and
writes the tables of the docs from them. `install()` applies them once, when the first
`ModelParallelStrategy` is made: importing tfmp changes nothing but
`keras.distribution` (below), and models outside any tfmp strategy run
Keras' own code. `tests/test_integrations.py`
checks that every target still exists with the parameters its wrapper relies
on, so an upgrade of Keras or TensorFlow fails one clear test; on an untested
version tfmp warns once with the tested range.

Patches of one object's attribute at use (`kind="instance"`, such as an
optimizer's gradient all-reduce that `GradientSyncMonitor` records) are
declared here too, and applied by the feature that needs them.

The exception is a library's `ON_IMPORT`
table, applied by `install_on_import()` as tfmp is imported: the entry
points of `keras.distribution`, which a program calls before any strategy
exists (`set_distribution`), and the functions Keras' TensorFlow backend
lacks (`kind="addition"`: `wrapper` is the function itself, and the test
checks that the library still lacks it).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import sys
import warnings
from typing import Any, Callable

# The integration modules: each declares PACKAGE (its distribution's name),
# MODULE (the import name it needs), TESTED ((lowest, highest) "major.minor"
# versions), PATCHES, and optionally AFTER_INSTALL ("module:function"s to
# call once its patches are in).
_LIBRARIES = (
    "tfmp.integrations.tensorflow",
    "tfmp.integrations.keras",
    "tfmp.integrations.tf_keras",
    "tfmp.integrations.orbit",
)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One attribute of another library that tfmp wraps.

    Attributes:
        target: `"module:Class"` or `"module"` that holds the attribute.
        attribute: The attribute's name (for `kind="gradient"`, the op type
            whose registered gradient is wrapped).
        wrapper: `"tfmp.module:function"` that takes the original and returns
            its replacement (for `kind="addition"` and `kind="lowering"`,
            the function that is set or run instead).
        why: What would go wrong under tfmp without it.
        parameters: Parameter names of the original that the wrapper relies on.
        kind: `"class"` (replaced on the class or module when installed),
            `"instance"` (replaced on single objects by the feature that needs
            it; the target class must still set the attribute),
            `"gradient"` (an op's registered gradient function),
            `"addition"` (an attribute the target lacks; `wrapper` is set as is),
            or `"lowering"` (`tfmp.lowering.Lowering`: `wrapper` runs instead
            while a forward pass is traced on a mesh).
        since: The first release of the target's library that has the
            attribute (older ones have nothing to change); None: every
            tested release.

    Examples:
        >>> from tfmp.integrations import Patch, library_of
        >>> patch = Patch(
        ...     "keras.src.models.model:Model",
        ...     "load_weights",
        ...     "tfmp.strategy.saving:verified_load_weights",
        ...     "A damaged file loads silently.",
        ...     parameters=("filepath",),
        ... )
        >>> patch.package, library_of(patch).PACKAGE
        ('keras', 'keras')
    """

    target: str
    attribute: str
    wrapper: str
    why: str
    parameters: tuple[str, ...] = ()
    kind: str = "class"
    since: str | None = None

    @property
    def package(self) -> str:
        """The import name of the library the target belongs to."""
        return self.target.partition(":")[0].split(".")[0]

    def in_installed_library(self) -> bool:
        """Whether the installed library is a release that has the attribute."""
        if self.since is None:
            return True
        version = installed_version(library_of(self).PACKAGE)
        return version is not None and is_at_least(version, self.since)

    def owner(self) -> Any:
        """The module or class that holds the attribute."""
        module_name, _, path = self.target.partition(":")
        owner = importlib.import_module(module_name)
        for name in filter(None, path.split(".")):
            owner = getattr(owner, name)
        return owner

    def wrapper_function(self) -> Callable:
        module_name, function_name = self.wrapper.split(":")
        return getattr(importlib.import_module(module_name), function_name)

    def original(self) -> Any:
        """What the patch wraps, as the library defines it."""
        owner = self.owner()
        if self.kind == "gradient":
            return owner._registry[self.attribute]["type"]  # noqa: SLF001
        return getattr(owner, self.attribute)

    def apply(self) -> None:
        if self.kind == "instance":
            return
        if self.kind == "addition":
            setattr(self.owner(), self.attribute, self.wrapper_function())
            return
        wrapped = self.wrapper_function()(self.original())
        if self.kind == "gradient":
            self.owner()._registry[self.attribute]["type"] = wrapped  # noqa: SLF001
        else:
            setattr(self.owner(), self.attribute, wrapped)


def libraries() -> list[Any]:
    """The integration modules, in the order they are installed."""
    return [importlib.import_module(name) for name in _LIBRARIES]


def library_of(patch: Patch) -> Any:
    """The integration module of the library `patch` changes (its `PACKAGE`
    and `TESTED` versions)."""
    for library in libraries():
        if library.MODULE == patch.package:
            return library
    raise ValueError(
        f"{patch.target!r} belongs to no library tfmp integrates with "
        f"({[library.MODULE for library in libraries()]}): declare the library "
        "in tfmp/integrations/ first."
    )


_installed: set[str] = set()


def install() -> None:
    """Applies the patches of every library that is imported and not yet
    patched. Called when a strategy is made and again as data is distributed
    (tf_keras and Orbit may be imported after the strategy)."""
    for library in libraries():
        if library.MODULE in _installed or library.MODULE not in sys.modules:
            continue
        _installed.add(library.MODULE)
        _warn_if_untested(library)
        for patch in filter(Patch.in_installed_library, library.PATCHES):
            patch.apply()
        for hook in getattr(library, "AFTER_INSTALL", ()):
            module_name, function_name = hook.split(":")
            getattr(importlib.import_module(module_name), function_name)()


_installed_on_import: set[str] = set()


def install_on_import() -> None:
    """Applies the `ON_IMPORT` patches of every imported library, once."""
    for library in libraries():
        if library.MODULE in _installed_on_import or library.MODULE not in sys.modules:
            continue
        _installed_on_import.add(library.MODULE)
        for patch in filter(Patch.in_installed_library, getattr(library, "ON_IMPORT", ())):
            patch.apply()


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_tested(version: str, tested: tuple[str, str]) -> bool:
    """Whether `version`'s major.minor lies in the `tested` range."""
    minor = _major_minor(version)
    return _major_minor(tested[0]) <= minor <= _major_minor(tested[1])


def is_at_least(version: str, lowest: str) -> bool:
    """Whether `version`'s major.minor is `lowest`'s or later."""
    return _major_minor(version) >= _major_minor(lowest)


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _warn_if_untested(library: Any) -> None:
    version = installed_version(library.PACKAGE)
    if version is None or is_tested(version, library.TESTED):
        return
    low, high = library.TESTED
    warnings.warn(
        f"tfmp was tested with {library.PACKAGE} {low} to {high}, and {version} is "
        f"installed: tfmp changes {len(library.PATCHES)} of its entry points "
        f"(tfmp/integrations/{library.__name__.rsplit('.', 1)[1]}.py). If training "
        f"misbehaves, install a tested version (pip install '{library.PACKAGE}>={low},"
        f"<{_next_minor(high)}') or run `pytest tests/test_integrations.py`.",
        stacklevel=3,
    )


def _next_minor(version: str) -> str:
    major, minor = _major_minor(version)
    return f"{major}.{minor + 1}"
