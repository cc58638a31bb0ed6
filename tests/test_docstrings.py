"""Every `>>>` example in tfmp's docstrings runs on the 8 simulated CPU devices."""

import doctest
import importlib
import pkgutil

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp

# `python -m tfmp` runs the command line on import.
NOT_IMPORTED = {"tfmp.__main__"}


def tfmp_modules():
    names = ["tfmp"] + [
        info.name for info in pkgutil.walk_packages(tfmp.__path__, "tfmp.")
        if info.name not in NOT_IMPORTED
    ]
    return [importlib.import_module(name) for name in names]


def examples():
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {}
    for module in tfmp_modules():
        for test in finder.find(module):
            # A name re-exported by a package is found again there.
            if test.examples and test.name not in found:
                found[test.name] = test
    return sorted(found.values(), key=lambda test: test.name)


@pytest.fixture
def example_globals():
    """What the examples take as given: `model` (the ModelParallelStrategy
    docstring's model, new for each docstring so that none sees another's
    training), its `mesh`, and data `x`, `y` to fit it on."""
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = tfmp.LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense_1/kernel"] = ("model", None)
    with tfmp.ModelParallelStrategy(mesh, layout_map).scope():
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(64, activation="relu", name="dense"),
                keras.layers.Dense(4, name="dense_1"),
            ],
            name="sequential",
        )
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 4)).astype("float32")
    return dict(tfmp=tfmp, keras=keras, np=np, tf=tf, mesh=mesh, model=model, x=x, y=y)


DOCTESTS = examples()


@pytest.mark.parametrize("test", DOCTESTS, ids=[test.name for test in DOCTESTS])
def test_docstring_examples_run(test, example_globals, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    test.globs = dict(example_globals)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    report = []
    failed, attempted = runner.run(test, out=report.append)
    assert attempted > 0
    assert failed == 0, "".join(report)
