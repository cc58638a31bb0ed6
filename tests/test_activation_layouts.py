"""A layer's output laid out by a `LayoutMap` rule (`"<layer path>/output"`).

Keras' convention, which its JAX backend reads through
`distribution.get_tensor_layout`: tfmp relayouts the output where the rule
says, in training and inference, with one device's numbers. Each program
trains 37 samples at batch 8 (the last batch, 5 rows, divides by no batch
axis) on a 2x4 mesh from one device's initial weights.
"""

import warnings

import keras
import numpy as np
import pytest

import tfmp
from helpers import assert_parity, build_mlp, mlp_data, strategy_on

N, BATCH = 37, 8


def tensor_parallel_mlp(mesh, outputs):
    layout_map = tfmp.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    for key, axes in outputs.items():
        layout_map[key] = axes
    return layout_map


OUTPUTS = {
    # The column-parallel output gathered over "model" before the row-parallel layer.
    "gathered between the pair": {"mlp/up/output": ("batch", None)},
    # Split over "model" where it is whole: the row-parallel layer's output, sequence-parallel style.
    "split after the pair": {"mlp/down/output": ("batch", "model")},
    # A regex key, and the batch axis alone.
    "regex, batch only": {".*/output": ("batch", None)},
}


@pytest.mark.parametrize("case", OUTPUTS)
def test_output_layouts_train_and_predict_like_one_device(case):
    x, y = mlp_data(N)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no key left unmatched
        warnings.filterwarnings("ignore", "tfmp: batch size", UserWarning)
        model = assert_parity(
            build_mlp,
            lambda mesh: tensor_parallel_mlp(mesh, OUTPUTS[case]),
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            steps=2 * -(-N // BATCH),
            evaluate=True,
        )
    layout_map = model.distribute_strategy.layout_map
    assert layout_map.unmatched_keys() == []
    laid_out = {path: axes for path, (_, axes) in layout_map.laid_out_outputs().items()}
    if case == "regex, batch only":
        assert laid_out == {"mlp/up": ("batch", None), "mlp/down": ("batch", None), "mlp": ("batch", None)}
    else:
        assert laid_out == {key.removesuffix("/output"): axes for key, axes in OUTPUTS[case].items()}
    text = tfmp.summary(model, print_fn=lambda text: None)
    for path, axes in laid_out.items():
        assert f"{path}/output" in text and str(axes) in text


def test_an_output_split_over_model_shows_in_comm_report():
    """With the row-parallel output split over "model", the loss reduces its
    features over "model" (forward) and gathers its gradient (backward);
    without the rule neither collective is there. A column-parallel output
    gathered before the row-parallel layer costs nothing: DTensor elides the
    gather its next matmul slices again."""

    def model_axis_collectives(outputs):
        strategy = strategy_on((2, 4), lambda mesh: tensor_parallel_mlp(mesh, outputs))
        with strategy.scope():
            model = build_mlp()
            model.compile(keras.optimizers.Adam(0.01), "mse")
        x, y = mlp_data(32)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        report = tfmp.comm_report(model, print_fn=lambda text: None)
        return sorted(
            (c.op.split("/")[0], c.phase, c.kind, c.bytes)
            for c in report.collectives
            if c.axes == ("model",)
        )

    without_rules = model_axis_collectives({})
    # Per device: 4 rows' feature means (float32) reduced; the 4 x 8 gradient gathered.
    assert model_axis_collectives({"mlp/down/output": ("batch", "model")}) == sorted(
        without_rules + [
            ("compile_loss", "forward", "all-reduce", 4 * 4),
            ("gradient_tape", "backward", "all-gather", 4 * 8 * 4),
        ]
    )
    assert model_axis_collectives({"mlp/up/output": ("batch", None)}) == without_rules


def test_an_output_rule_that_matches_no_layer_warns_after_the_first_step():
    x, y = mlp_data(16)
    strategy = strategy_on((2, 4), lambda mesh: tensor_parallel_mlp(mesh, {"mlp/upp/output": ("batch", None)}))
    with strategy.scope():
        model = build_mlp()
        model.compile("sgd", "mse")
    with pytest.warns(UserWarning, match=r"\['mlp/upp/output'\] matched no variable \(nor layer output\)"):
        for _ in range(2):  # the second epoch checks what the first one traced
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_an_output_rule_of_the_wrong_rank_names_the_layout():
    strategy = strategy_on((2, 4), lambda mesh: tensor_parallel_mlp(mesh, {"mlp/up/output": ("batch",)}))
    with strategy.scope():
        model = build_mlp()
        model.compile("sgd", "mse")
    x, y = mlp_data(16)
    with pytest.raises(ValueError, match=r"layout \('batch',\) has 1 entries for a tensor of rank 2"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    np.testing.assert_equal(len(model.weights), 4)
