"""Training on a mesh gives the numbers of single-device Keras (Adam, 5+ steps)."""

import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfmp
from helpers import (
    MESH_SHAPES,
    MODELS,
    assert_weights_close,
    build_on,
    initial_weights,
    mesh,
    train,
)

_references = {}


def reference(name):
    """Single-device run of model `name`, computed once per session."""
    if name not in _references:
        build, _, _, data = MODELS[name]
        weights = initial_weights(build)
        x, y = data()
        model = build_on(None, name, weights)
        losses, history = train(model, x, y, epochs=2)
        _references[name] = dict(
            weights=weights,
            losses=losses,
            history=history.history,
            final=model.get_weights(),
            evaluation=model.evaluate(x, y, verbose=0, return_dict=True),
            predictions=model.predict(x, verbose=0),
        )
    return _references[name]


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fit_matches_single_device(name, shape):
    ref = reference(name)
    _, layout_map, _, data = MODELS[name]
    device_mesh = mesh(shape)
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map(device_mesh))
    model = build_on(strategy, name, ref["weights"])
    x, y = data()

    losses, history = train(model, x, y, epochs=2)

    assert len(losses) == len(ref["losses"]) >= 5
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    for key, values in ref["history"].items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5)
    assert_weights_close(ref["final"], model.get_weights())
    evaluation = model.evaluate(x, y, verbose=0, return_dict=True)
    assert evaluation.keys() == ref["evaluation"].keys()
    for key, value in ref["evaluation"].items():
        np.testing.assert_allclose(evaluation[key], value, rtol=1e-5)
    predictions = model.predict(x, verbose=0)
    np.testing.assert_allclose(predictions, ref["predictions"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
def test_shards_have_the_layout_shapes(shape):
    """Each device holds exactly its slice of each sharded kernel."""
    device_mesh = mesh(shape)
    strategy = tfmp.ModelParallelStrategy(device_mesh, MODELS["transformer"][1](device_mesh))
    weights = initial_weights(MODELS["transformer"][0])
    model = build_on(strategy, "transformer", weights)
    model_axis = shape[1]
    expected = {
        "token_embedding/embeddings": (64 // model_axis, 32),
        "attention/query/kernel": (32, 8 // model_axis, 4),
        "attention/attention_output/kernel": (8 // model_axis, 4, 32),
        "ffn_in/kernel": (32, 64 // model_axis),
        "ffn_out/kernel": (64 // model_axis, 32),
        "lm_head/kernel": (32, 64 // model_axis),
        "ffn_norm/gamma": (32,),
    }
    by_path = {v.path: v for v in model.variables}
    for path, shard_shape in expected.items():
        variable = by_path[f"transformer_lm/{path}"] if f"transformer_lm/{path}" in by_path else by_path[path]
        shards = dtensor.unpack(variable.value.read_value())
        assert len(shards) == 8
        assert all(tuple(s.shape) == shard_shape for s in shards), path
        full = variable.numpy()
        # Shards along the model axis tile the full value.
        layout = variable.value.layout
        for location, shard in zip(layout.mesh.local_device_locations(), shards):
            index = tuple(
                slice(None)
                if spec == dtensor.UNSHARDED
                else slice(location[spec] * n, (location[spec] + 1) * n)
                for spec, n in zip(layout.sharding_specs, shard.shape)
            )
            np.testing.assert_array_equal(shard.numpy(), full[index])
    # Optimizer slots take their variable's layout.
    model.fit(*MODELS["transformer"][3](), batch_size=16, epochs=1, verbose=0)
    kernel = by_path.get("transformer_lm/ffn_in/kernel") or by_path["ffn_in/kernel"]
    slots = [v for v in model.optimizer.variables if v.shape == kernel.shape]
    assert slots
    for slot in slots:
        assert slot.value.layout.sharding_specs == kernel.value.layout.sharding_specs
