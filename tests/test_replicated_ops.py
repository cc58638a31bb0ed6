"""Keras ops whose TensorFlow op DTensor has no layout rule for run
replicated on a mesh, give one device's numbers, say once that they gather a
split input, and `tfmp.comm_report` shows that gather.

The model: a column-parallel Dense (its output split over "batch" and
"model"), then a layer of `ops.roll` and `ops.flip` (`Roll`, `ReverseV2`:
`tfmp.lowering.replicated`) and `ops.tril` and `ops.triu` (tfmp's rewrite,
no gather), then a Dense. 37 samples in batches of 8 on 2x4: the last batch does not divide the
batch axis.
"""

import re
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import tfmp
from helpers import assert_parity, rules

RNG = np.random.default_rng(0)
X = RNG.normal(size=(37, 8, 6)).astype("float32")
Y = RNG.normal(size=(37, 8, 4)).astype("float32")


class Masks(keras.layers.Layer):
    """Banded scores, and scores shifted and reversed. (Where one split
    tensor feeds several such ops, one gather serves them all, and the note
    names the first.)"""

    def call(self, scores):
        banded = ops.tril(scores, -1) + ops.triu(scores, 2)
        return banded + ops.roll(2.0 * scores, 1, axis=1) - ops.flip(scores + 1.0, axis=2)


def build() -> keras.Model:
    inputs = keras.Input((8, 6))
    scores = keras.layers.Dense(8, name="scores")(inputs)
    masked = Masks(name="masks")(scores)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(masked))


@pytest.fixture(scope="module")
def trained():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = assert_parity(build, rules({"scores/kernel": (None, "model")}), X, Y, steps=5, batch_size=8)
    return model, [str(w.message) for w in caught if "no layout rule" in str(w.message)]


def test_replicated_ops_train_as_one_device_and_are_noted_once(trained):
    model, notes = trained
    assert sorted(notes) == sorted(
        f"tfmp: layer '{model.name}/masks' runs TensorFlow's {op}, which DTensor has no layout rule for, "
        "on every device: its split input is gathered whole each step (tfmp.comm_report(model) "
        "counts it under 'replicated-ops'). To avoid the gather, give the layers before it rules "
        "that leave that input whole."
        for op in ("ReverseV2", "Roll")
    ), notes
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert not [w for w in again if "no layout rule" in str(w.message)]


def test_comm_report_shows_the_gathers(trained):
    model, _ = trained
    report = tfmp.comm_report(model, print_fn=lambda _: None)
    gathers = [c for c in report.collectives if c.category == "replicated-ops"]
    scopes = {part for c in gathers for part in c.op.split("/") if part.startswith("tfmp_replicated_")}
    assert {re.sub(r"_\d+$", "", scope) for scope in scopes} == {
        f"tfmp_replicated_{op}" for op in ("ReverseV2", "Roll")
    }
    # Each op's input, (8, 8, 8) float32 scores of a batch, split (4, 8, 2)
    # per device, gathered over "model" (to 1 KiB), then over "batch" (2 KiB).
    assert sorted((c.axes, c.kind, c.phase, c.bytes) for c in gathers) == 2 * [
        (("batch",), "all-gather", "forward", 2048)
    ] + 2 * [(("model",), "all-gather", "forward", 1024)]
    assert "replicated-ops" in str(report)
