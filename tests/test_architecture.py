"""tfmp's layering: no module imports a higher layer, and imports form no cycle.

Every module of the `tfmp` package is parsed with `ast` (nothing is imported,
so the test needs no TensorFlow); every `import` and `from ... import` of a
tfmp module counts, at module level or inside a function, and so does a
string that names one (`"tfmp.lowering.conv"`, `"tfmp.strategy.saving:chief_writes"`):
wiring by string is an import the interpreter does later.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfmp"

# Bottom to top: a module may import its own layer and the ones before it.
LAYERS = (
    (
        "tfmp._env",
        "tfmp.tracing",
        "tfmp.state",
        "tfmp.devices",
        "tfmp.cluster_sources",
        "tfmp.distributed",
        "tfmp.mesh",
        "tfmp.layout",
        "tfmp.layout_decision",
        "tfmp.forward",
        "tfmp.integrations.*",
        "tfmp.auto_layout",
    ),
    ("tfmp.lowering.*",),
    ("tfmp.strategy.*",),
    ("tfmp.layers.*",),
    ("tfmp.pipeline.*",),
    ("tfmp.inspect.*", "tfmp.callbacks.*"),
    # Facades: re-exports and entry points, above everything they gather.
    (
        "tfmp", "tfmp._api", "tfmp.layers", "tfmp.callbacks", "tfmp.cli", "tfmp.demo",
        "tfmp.launch", "tfmp.__main__",
        # Lists the integrations' patches and the lowerings, and writes the docs' tables.
        "tfmp.integrations.table",
    ),
)


def module_files() -> dict[str, pathlib.Path]:
    """Every module of tfmp, by dotted name (a package by its `__init__`)."""
    modules = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def layer_of(module: str) -> int:
    """The index in LAYERS of `module`: an exact name first, then the
    deepest `package.*` that holds it."""
    for index, patterns in enumerate(LAYERS):
        if module in patterns:
            return index
    best = None
    for index, patterns in enumerate(LAYERS):
        for pattern in patterns:
            package = pattern.removesuffix(".*")
            if pattern.endswith(".*") and (module == package or module.startswith(package + ".")):
                if best is None or len(package) > best[0]:
                    best = (len(package), index)
    if best is None:
        raise AssertionError(
            f"Module {module!r} is in no layer of tests/test_architecture.py: add it to LAYERS."
        )
    return best[1]


def imported_modules(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The tfmp modules `module` imports anywhere in its file.

    `from package import name` imports the module `package.name` when there
    is one, else `package` itself (its `__init__`).
    """
    is_package = path.name == "__init__.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                imported.add(submodule if submodule in known else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("tfmp."):
            imported.add(node.value.partition(":")[0])
    return {name for name in imported if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {module: imported_modules(module, path, known) for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_within(graph, group) for group in groups]


def _cycle_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A closed path of imports among the modules of `group`."""
    start = min(group)
    path = [start]
    seen = {start}
    while True:
        following = sorted(t for t in graph[path[-1]] if t in group)
        back = start if start in following else None
        if back is not None:
            return path + [start]
        target = next((t for t in following if t not in seen), following[0])
        if target in seen:
            return path[path.index(target) :] + [target]
        path.append(target)
        seen.add(target)


def test_every_module_has_a_layer():
    layers = {module: layer_of(module) for module in module_files()}
    assert layers and all(0 <= layer < len(LAYERS) for layer in layers.values())


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    upward = sorted(
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )
    assert not upward, "Imports of a higher layer:\n  " + "\n  ".join(upward)


def test_imports_form_no_cycle():
    found = cycles(import_graph())
    assert not found, "Import cycles:\n  " + "\n  ".join(" -> ".join(cycle) for cycle in found)


# Keras' and TensorFlow's private modules: they move between releases.
PRIVATE_PACKAGES = ("keras.src", "tensorflow.python", "tensorflow.compiler", "tensorflow.dtensor.python",
                    "tensorflow.core", "tf_keras.src")
# Where they may be imported: the patches, the rewrites of Keras' backend
# functions, and the one file that hands their names to the rest.
MAY_IMPORT_PRIVATE = ("tfmp.integrations", "tfmp.lowering")


def test_private_keras_and_tensorflow_names_come_from_integrations_internals():
    found = []
    for module, path in module_files().items():
        if module == "tfmp.integrations" or module.startswith(tuple(f"{p}." for p in MAY_IMPORT_PRIVATE)):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [
                f"{module}:{node.lineno} imports {name}"
                for name in names
                if any(name == p or name.startswith(p + ".") for p in PRIVATE_PACKAGES)
            ]
    assert not found, (
        "Private Keras or TensorFlow modules imported outside tfmp.integrations and tfmp.lowering "
        "(take the name from tfmp/integrations/internals.py):\n  " + "\n  ".join(found)
    )
