"""The table of lowerings: every target exists in the installed Keras, and every
replacement takes the arguments Keras' own function takes."""

import importlib
import inspect

import pytest

from tfmp.lowering import lowerings
from tfmp.lowering.registry import keras_original


@pytest.mark.parametrize("lowering", lowerings(), ids=lambda lowering: f"{lowering.target}.{lowering.attribute}")
def test_replacement_takes_keras_arguments(lowering):
    if not lowering.in_installed_library():
        module = importlib.import_module(lowering.target)
        assert not hasattr(module, lowering.attribute), f"{lowering} exists before its `since`"
        return
    keras_function = keras_original(lowering.target, lowering.attribute)  # fails if Keras moved it
    replacement = lowering.wrapper
    replacement_parameters = inspect.signature(replacement).parameters
    if any(p.kind is p.VAR_POSITIONAL for p in replacement_parameters.values()):
        return  # declines whatever it is given
    keras_parameters = inspect.signature(keras_function).parameters
    assert len(replacement_parameters) == len(keras_parameters), lowering
    for (name, ours), theirs in zip(replacement_parameters.items(), keras_parameters.values()):
        assert ours.default == theirs.default, (lowering, name)
