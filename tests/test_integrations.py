"""Every patch and lowering tfmp declares still fits the installed Keras,
tf_keras, Orbit and TensorFlow, importing tfmp patches nothing, and the docs'
tables are the declarations'."""

import inspect
import pathlib
import sys
import types
import warnings

import pytest

from helpers import run_in_fresh_process
from tfmp import integrations
from tfmp.integrations import table

ENTRIES = table.entries()
TESTS = pathlib.Path(__file__).resolve().parent


def _id(entry):
    return f"{entry.patch.package}:{entry.patch.target.split(':')[-1]}.{entry.patch.attribute}"


def _sets_attribute(cls, attribute):
    """Whether `cls` or a base class defines `attribute` or assigns it in its code."""
    for base in cls.__mro__:
        if attribute in vars(base):
            return True
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if f"self.{attribute} =" in source:
            return True
    return False


@pytest.mark.parametrize("entry", ENTRIES, ids=map(_id, ENTRIES))
def test_every_patched_target_exists_with_the_parameters_its_wrapper_uses(entry):
    patch = entry.patch
    __import__(entry.library.MODULE)
    assert callable(patch.wrapper), patch.wrapper
    owner = patch.owner()
    if not patch.in_installed_library():
        assert not hasattr(owner, patch.attribute), f"{patch.target}.{patch.attribute} exists before its `since`"
        return
    if patch.kind == "addition":
        # Once the library defines it, tfmp's stand-in would hide its own.
        assert getattr(owner, patch.attribute, None) in (None, patch.wrapper), (
            f"{patch.target} now defines {patch.attribute!r}: drop tfmp's ({patch.why})"
        )
        return
    if patch.kind == "instance":
        assert _sets_attribute(owner, patch.attribute), (
            f"{patch.target} no longer sets {patch.attribute!r}: {patch.why}"
        )
        return
    original = patch.original()
    if isinstance(original, property):
        original = original.fget
    original = getattr(original, "__wrapped__", original)  # installed already in this session
    parameters = inspect.signature(original).parameters
    missing = [name for name in patch.parameters if name not in parameters]
    assert not missing, f"{patch.target}.{patch.attribute} lost parameters {missing}"


def test_the_installed_libraries_are_the_tested_ones():
    untested = {
        library.PACKAGE: (version, library.TESTED)
        for library in integrations.libraries()
        if (version := integrations.installed_version(library.PACKAGE)) is not None
        and not integrations.is_tested(version, library.TESTED)
    }
    assert not untested, f"installed versions outside the tested ranges: {untested}"


def test_an_untested_version_warns_once_with_the_range(monkeypatch):
    assert integrations.is_tested("3.15.1", ("3.12", "3.15"))
    assert integrations.is_tested("3.12.0rc1", ("3.12", "3.15"))
    assert not integrations.is_tested("3.16.0", ("3.12", "3.15"))
    library = types.SimpleNamespace(
        __name__="tfmp.integrations.fake",
        PACKAGE="keras",
        MODULE="fake_keras",
        TESTED=("3.12", "3.13"),
    )
    monkeypatch.setattr(integrations, "libraries", lambda: [library])
    monkeypatch.setitem(sys.modules, "fake_keras", types.ModuleType("fake_keras"))
    monkeypatch.setattr(integrations, "installed_version", lambda package: "3.15.1")
    with pytest.warns(UserWarning, match=r"tested with keras 3.12 to 3.13, and 3.15.1 is installed.*keras>=3.12,<3.14"):
        integrations.install()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integrations.install()


def test_importing_tfmp_patches_only_keras_distribution_and_imports_no_optional_library():
    script = (
        "import sys, keras\n"
        "from keras.src.backend.tensorflow.trainer import TensorFlowTrainer\n"
        "call, fit = keras.layers.Layer.__call__, TensorFlowTrainer.fit\n"
        "set_distribution = keras.distribution.set_distribution\n"
        "import tfmp\n"
        "assert keras.layers.Layer.__call__ is call and TensorFlowTrainer.fit is fit, 'patched at import'\n"
        "assert keras.distribution.set_distribution is not set_distribution, 'ON_IMPORT not applied'\n"
        "loaded = [m for m in ('tf_keras', 'orbit', 'official', 'keras_hub') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "strategy = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((1,), ('batch',)))\n"
        "assert keras.layers.Layer.__call__ is not call, 'not installed with the strategy'\n"
    )
    finished = run_in_fresh_process(script, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]


# Runs in a fresh process: every attribute tfmp patches, read before any
# strategy, must be the very same object again once the last one is gone.
_UNPATCHED_AFTER_THE_LAST_STRATEGY = """
import gc
import numpy as np
import keras
import tfmp
from tfmp import integrations

tfmp.simulate_devices(2)
__import__("tf_keras")
__import__("orbit")
__import__("keras_hub")
patches = [d.patch for d in integrations.declarations() if not d.on_import and d.patch.kind != "instance"]
patches = [p for p in patches if p.in_installed_library()]
MISSING = object()

def state(patch):
    owner = patch.owner()
    if patch.kind == "gradient":
        return owner._registry[patch.attribute]["type"]
    return vars(owner).get(patch.attribute, MISSING)

before = [state(p) for p in patches]
x = np.linspace(0, 1, 24, dtype="float32").reshape(12, 2)
y = x.sum(axis=1, keepdims=True)

def fit(model):
    model.compile(optimizer="sgd", loss="mse")
    return model.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"][0]

def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.Dense(1)])

strategy = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((2,), ("batch",)))
with strategy.scope():
    on_mesh = model()
    mesh_loss = fit(on_mesh)
changed = sum(state(p) is not b for p, b in zip(patches, before))
assert changed == len(patches), f"{changed} of {len(patches)} patched with a strategy"
del strategy, on_mesh
gc.collect()
still = [f"{p.target}.{p.attribute}" for p, b in zip(patches, before) if state(p) is not b]
assert not still, f"still patched after the last strategy: {still}"
assert np.isclose(fit(model()), mesh_loss, rtol=1e-5), "plain Keras after the strategy"
strategy = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((2,), ("batch",)))
assert all(state(p) is not b for p, b in zip(patches, before)), "a new strategy patches again"
with strategy.scope():
    assert np.isclose(fit(model()), mesh_loss, rtol=1e-5), "a new strategy trains as the first did"
print(len(patches))
"""


def test_the_last_strategy_to_go_takes_every_patch_back_and_plain_keras_runs_unpatched():
    finished = run_in_fresh_process(_UNPATCHED_AFTER_THE_LAST_STRATEGY)
    assert finished.returncode == 0, finished.stderr[-3000:]
    # Every patch of Keras, TensorFlow, tf_keras, Orbit and KerasHub applied by the strategy.
    assert int(finished.stdout.split()[-1]) == sum(
        not e.on_import and e.patch.kind != "instance" and e.patch.in_installed_library() for e in ENTRIES
    )


_PATCHED_WHEN_IMPORTED_AFTER_THE_STRATEGY = """
import numpy as np
import keras
import tfmp

tfmp.simulate_devices(2)
strategy = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((2,), ("batch",)))
import keras_hub  # after the strategy, as a notebook may
from keras_hub.src.models.llama.llama_attention import LlamaAttention

original = LlamaAttention._compute_attention
with strategy.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((4, 2), "float32"), np.ones((4, 1), "float32"), batch_size=2, verbose=0)
assert LlamaAttention._compute_attention is not original, "KerasHub not patched by the step"
"""


def test_a_library_imported_after_the_strategy_is_patched_when_a_step_is_traced():
    finished = run_in_fresh_process(_PATCHED_WHEN_IMPORTED_AFTER_THE_STRATEGY)
    assert finished.returncode == 0, finished.stderr[-3000:]


def test_one_attribute_is_patched_in_one_place():
    declared = integrations.declarations()[0]
    with pytest.raises(ValueError, match=r"patched by .* already, and tests.elsewhere declares it again"):
        integrations.declare("tests.elsewhere", [declared.patch])


def test_each_patch_is_declared_by_the_layer_whose_function_it_puts_in():
    """No lower layer wires in a higher one's function; integrations/ only
    describes the libraries."""
    for entry in ENTRIES:
        layer = ".".join(entry.declared_in.split(".")[:2])
        assert layer != "tfmp.integrations" and entry.patch.wrapper.__module__.startswith(layer + "."), (
            f"{entry.patch.target}.{entry.patch.attribute} is declared in {entry.declared_in}, "
            f"but its wrapper is {entry.patch.wrapper.__module__}'s: declare it there"
        )
    assert {entry.patch.kind for entry in ENTRIES} == {"class", "instance", "gradient", "addition", "lowering"}
    assert any(entry.library.MODULE == "tensorflow" and entry.patch.kind == "lowering" for entry in ENTRIES)


def test_the_docs_tables_are_the_generated_ones():
    stale = [
        page
        for page in table.GENERATED
        if table.regenerated(page, (docs := TESTS.parent / "docs" / page).read_text()) != docs.read_text()
    ]
    assert not stale, (
        f"docs/{stale} differ from the declarations: run `python -m tfmp.integrations.table --write`"
    )


def test_a_docs_page_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="must hold one generated block"):
        table.regenerated("layouts.md", "# no generated block\n")
