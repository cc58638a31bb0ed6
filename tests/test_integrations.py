"""Every patch tfmp declares still fits the installed Keras, tf_keras, Orbit
and TensorFlow, and importing tfmp patches nothing."""

import inspect
import subprocess
import sys
import types
import warnings

import pytest

from tfmp import integrations

PATCHES = [
    (library, patch)
    for library in integrations.libraries()
    for patch in (*library.PATCHES, *getattr(library, "ON_IMPORT", ()))
]


def _id(case):
    library, patch = case
    return f"{library.MODULE}:{patch.target.split(':')[-1]}.{patch.attribute}"


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


@pytest.mark.parametrize("case", PATCHES, ids=map(_id, PATCHES))
def test_every_patched_target_exists_with_the_parameters_its_wrapper_uses(case):
    library, patch = case
    __import__(library.MODULE)
    assert callable(patch.wrapper_function()), patch.wrapper
    owner = patch.owner()
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
