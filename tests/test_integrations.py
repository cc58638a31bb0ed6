"""Every patch and lowering tfmp declares still fits the installed Keras,
tf_keras, Orbit and TensorFlow, importing tfmp patches nothing, and the docs'
tables are the declarations'."""

import inspect
import pathlib
import subprocess
import sys
import types
import warnings

import pytest

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
    assert callable(patch.wrapper_function()), patch.wrapper
    owner = patch.owner()
    if not patch.in_installed_library():
        assert not hasattr(owner, patch.attribute), f"{patch.target}.{patch.attribute} exists before its `since`"
        return
    if patch.kind == "addition":
        # Once the library defines it, tfmp's stand-in would hide its own.
        assert getattr(owner, patch.attribute, None) in (None, patch.wrapper_function()), (
            f"{patch.target} now defines {patch.attribute!r}: drop tfmp's ({patch.why})"
        )
        return
    if patch.kind == "instance":
        assert _sets_attribute(owner, patch.attribute), (
            f"{patch.target} no longer sets {patch.attribute!r}: {patch.why}"
        )
        return
    original = patch.original()
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
        PATCHES=(),
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
        "tfmp.ModelParallelStrategy(tfmp.DeviceMesh((1,), ('batch',)))\n"
        "assert keras.layers.Layer.__call__ is not call, 'not installed with the strategy'\n"
    )
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]


def test_each_library_module_declares_changes_of_its_own_library():
    """The tested versions an entry is held to are its own library's."""
    for entry in ENTRIES:
        if entry.declared_in.startswith("tfmp.integrations."):
            assert entry.declared_in == entry.library.__name__, (
                f"{entry.patch.target}.{entry.patch.attribute} is declared in "
                f"{entry.declared_in} but changes {entry.library.PACKAGE}: declare it in "
                f"{entry.library.__name__}"
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
