"""A mesh axis that splits nothing is named at the first step, with what
would use it: its devices compute copies of the same step, and the numbers
say nothing. The demo LM, 16 rows at batch 8."""

import warnings

import pytest

import tfmp
from helpers import compile_lm, mesh
from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data


def idle_axis_warnings(shape, axes, layout_map, **options) -> list[str]:
    device_mesh = mesh(shape, axes)
    strategy = tfmp.ModelParallelStrategy(
        device_mesh, layout_map(device_mesh) if callable(layout_map) else layout_map, **options
    )
    with strategy.scope():
        model = compile_lm(build_transformer_lm(seq_len=8))
    x, y = next_token_data(16, 8, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return [str(w.message) for w in caught if "splits nothing" in str(w.message)]


def test_a_sequence_axis_left_unused_proposes_context_parallelism():
    (message,) = idle_axis_warnings((2, 2, 2), ("batch", "sequence", "model"), megatron_layout_map)
    assert message.startswith("tfmp: mesh axis 'sequence' (size 2) splits nothing in ['transformer_lm']")
    assert "the 2 devices along it compute the same step" in message
    assert "pass context_parallel='sequence' to split sequences over it" in message


def test_a_model_axis_without_a_layout_map_proposes_one():
    (message,) = idle_axis_warnings((2, 4), ("batch", "model"), None)
    assert "mesh axis 'model' (size 4) splits nothing" in message
    assert "pass a LayoutMap that splits weights over it (layout_map='auto' plans one)" in message


@pytest.mark.parametrize(
    "shape, axes, layout_map, options",
    [
        ((2, 2, 2), ("batch", "sequence", "model"), "auto", {"context_parallel": True}),
        ((2, 2, 2), ("batch", "sequence", "model"), "auto", {}),  # "auto" turns it on
        ((2, 4), ("batch", "model"), "auto", {}),
        ((8,), ("batch",), None, {}),
    ],
    ids=["context-parallel", "auto-context-parallel", "tensor-parallel", "data-parallel"],
)
def test_no_warning_when_every_axis_splits_something(shape, axes, layout_map, options):
    assert idle_axis_warnings(shape, axes, layout_map, **options) == []
