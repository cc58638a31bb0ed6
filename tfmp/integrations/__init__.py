"""Every place tfmp changes Keras, tf_keras, Orbit, KerasHub or TensorFlow,
as data.

tfmp trains ordinary Keras models, so it meets those libraries at a few of
their entry points: `Layer.__call__`, the trainer's `fit`, tf_keras' step
functions, Orbit's loops, KerasHub's attention, DTensor's Relayout
gradient. Each such change is a `Patch`, naming what it replaces, the tfmp
function that wraps the original, why, and since which release. The layer of tfmp that owns a wrapper declares
its patches with `declare()` (the strategy in `tfmp.strategy.patches`, the
pipeline, a callback, a layer, each lowering family), so no module here
names a higher layer; this package's modules hold one library each: its
distribution's name and the versions tfmp was tested with. The Keras
backend functions that tfmp rewrites on a mesh (`tfmp.lowering`) are
`Patch`es too, of `kind="lowering"`. `tfmp.integrations.table` lists every
declaration and writes the tables of the docs from them.

`install(holder)` applies the declarations when the first
`ModelParallelStrategy` is made, and `uninstall()` takes them back when the
last one is gone: importing tfmp changes nothing but `keras.distribution`
(below), and Keras runs its own code again once no tfmp strategy is left.
`tests/test_integrations.py` checks that every target still exists with the
parameters its wrapper relies on, so an upgrade of Keras or TensorFlow fails
one clear test; on an untested version tfmp warns once with the tested range.

Patches of one object's attribute at use (`kind="instance"`, such as an
optimizer's gradient all-reduce that `GradientSyncMonitor` records) are
declared too, and applied by the feature that needs them.

The exception are declarations `on_import`, applied by
`install_on_import()` as tfmp is imported and never taken back: the entry
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
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable

# The integration modules: each names PACKAGE (its distribution's name),
# MODULE (the import name it needs) and TESTED ((lowest, highest)
# "major.minor" versions).
_LIBRARIES = (
    "tfmp.integrations.tensorflow",
    "tfmp.integrations.keras",
    "tfmp.integrations.tf_keras",
    "tfmp.integrations.orbit",
    "tfmp.integrations.keras_hub",
)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One attribute of another library that tfmp wraps.

    Attributes:
        target: `"module:Class"` or `"module"` that holds the attribute.
        attribute: The attribute's name (for `kind="gradient"`, the op type
            whose registered gradient is wrapped).
        wrapper: The tfmp function that takes the original and returns its
            replacement (for `kind="addition"` and `kind="lowering"`, the
            function that is set or run instead; for `kind="instance"`, the
            class that replaces the attribute on single objects).
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
        >>> def verified(load_weights):
        ...     return load_weights
        >>> patch = Patch(
        ...     "keras.src.models.model:Model",
        ...     "load_weights",
        ...     verified,
        ...     "A damaged file loads silently.",
        ...     parameters=("filepath",),
        ... )
        >>> patch.package, library_of(patch).PACKAGE
        ('keras', 'keras')
    """

    target: str
    attribute: str
    wrapper: Callable
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

    def original(self) -> Any:
        """What the patch wraps, as the library defines it (None for an
        addition)."""
        owner = self.owner()
        if self.kind == "gradient":
            return owner._registry[self.attribute]["type"]  # noqa: SLF001
        return getattr(owner, self.attribute, None)

    def replacement(self, original: Any) -> Any:
        """What stands in the original's place while the patch is in."""
        return self.wrapper if self.kind == "addition" else self.wrapper(original)

    def apply(self) -> Callable[[], None]:
        """Puts the replacement in place; returns the function that takes it
        back out."""
        owner = self.owner()
        if self.kind == "gradient":
            entry = owner._registry[self.attribute]  # noqa: SLF001
            original = entry["type"]
            entry["type"] = self.replacement(original)
            return lambda: entry.__setitem__("type", original)
        # An attribute a class inherits is set on the class; taking it back
        # deletes it there, so the base class's shows through again.
        own = self.attribute in vars(owner)
        original = vars(owner)[self.attribute] if own else None
        setattr(owner, self.attribute, self.replacement(self.original()))
        if own:
            return lambda: setattr(owner, self.attribute, original)
        return lambda: delattr(owner, self.attribute)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A `Patch` and the tfmp module that declared it.

    Attributes:
        patch: The patch.
        module: The declaring module's name.
        on_import: Whether it is applied as tfmp is imported.
    """

    patch: Patch
    module: str
    on_import: bool = False


_declarations: list[Declaration] = []


def declare(module: str, patches: Iterable[Patch], *, on_import: bool = False) -> None:
    """Declares the patches of `module` (pass `__name__`), the layer of tfmp
    that owns their wrappers.

    Args:
        module: The declaring module's name.
        patches: Its patches.
        on_import: Apply them as tfmp is imported (`install_on_import`),
            not with the first strategy.

    Raises:
        ValueError: If an attribute is already patched by another declaration.
    """
    taken = {(d.patch.target, d.patch.attribute): d.module for d in _declarations}
    for patch in patches:
        if (patch.target, patch.attribute) in taken:
            raise ValueError(
                f"{patch.target}.{patch.attribute} is patched by {taken[patch.target, patch.attribute]} "
                f"already, and {module} declares it again: wrap it in one place."
            )
        library_of(patch)
        _declarations.append(Declaration(patch, module, on_import))
        taken[patch.target, patch.attribute] = module


def declarations() -> list[Declaration]:
    """Every declaration, in the order tfmp's modules made them."""
    return list(_declarations)


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


# What holds the patches in: live objects (strategies), and the functions
# that take each applied patch back out, by library.
_lock = threading.RLock()
_holders = 0
_removals: dict[str, list[Callable[[], None]]] = {}
_warned: set[str] = set()


def install(holder: Any = None) -> None:
    """Applies the declarations of every library that is imported and not
    yet patched. With a `holder` (a strategy being made), the patches stay
    until every holder is garbage collected, then `uninstall()` runs.
    Without one (a step traced or data distributed by a strategy that
    exists), it adds the patches of libraries imported since (tf_keras,
    Orbit and KerasHub may be imported after the strategy)."""
    global _holders
    with _lock:
        if holder is not None:
            _holders += 1
            # At exit nothing runs Keras any more: no need to take patches back.
            weakref.finalize(holder, _release).atexit = False
        for library in libraries():
            if library.MODULE in _removals or library.MODULE not in sys.modules:
                continue
            _warn_if_untested(library)
            _removals[library.MODULE] = [patch.apply() for patch in _to_apply(library, on_import=False)]


def uninstall() -> None:
    """Takes every patch `install()` applied back out, the last first."""
    with _lock:
        for module in reversed(list(_removals)):
            for remove in reversed(_removals.pop(module)):
                remove()


def _release() -> None:
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0:
            uninstall()


_installed_on_import: set[str] = set()


def install_on_import() -> None:
    """Applies the `on_import` declarations of every imported library, once."""
    for library in libraries():
        if library.MODULE in _installed_on_import or library.MODULE not in sys.modules:
            continue
        _installed_on_import.add(library.MODULE)
        for patch in _to_apply(library, on_import=True):
            patch.apply()


def _to_apply(library: Any, on_import: bool) -> list[Patch]:
    """The declared patches of `library` that are applied as tfmp is
    imported (or with the strategy), in the installed release."""
    return [
        d.patch
        for d in _declarations
        if d.on_import == on_import
        and d.patch.package == library.MODULE
        and d.patch.kind != "instance"
        and d.patch.in_installed_library()
    ]


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
    if version is None or is_tested(version, library.TESTED) or library.MODULE in _warned:
        return
    _warned.add(library.MODULE)
    low, high = library.TESTED
    warnings.warn(
        f"tfmp was tested with {library.PACKAGE} {low} to {high}, and {version} is "
        f"installed: tfmp changes {_changed_entry_points(library)} of its entry points "
        "(`python -m tfmp.integrations.table --markdown` lists them). If training "
        f"misbehaves, install a tested version (pip install '{library.PACKAGE}>={low},"
        f"<{_next_minor(high)}') or run `pytest tests/test_integrations.py`.",
        stacklevel=3,
    )


def _next_minor(version: str) -> str:
    major, minor = _major_minor(version)
    return f"{major}.{minor + 1}"


def _changed_entry_points(library: Any) -> int:
    return sum(d.patch.package == library.MODULE for d in _declarations)
