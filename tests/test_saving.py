"""Saving on one mesh and loading on another (or on none) is bit-exact."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map

WEIGHTS = initial_weights(build_mlp)


def strategy_on(shape):
    device_mesh = mesh(shape)
    return tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))


@pytest.fixture(scope="module")
def trained():
    """An MLP trained for a few steps on a 2x4 mesh, with its optimizer state."""
    model = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    x, y = mlp_data(64)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model


def assert_same_state(expected, actual):
    for want, got in zip(expected.get_weights(), actual.get_weights()):
        np.testing.assert_array_equal(got, want)
    want_opt = [v.numpy() for v in expected.optimizer.variables]
    got_opt = [v.numpy() for v in actual.optimizer.variables]
    assert len(want_opt) == len(got_opt)
    for want, got in zip(want_opt, got_opt):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target", [(4, 2), (1, 8), None], ids=["4x2", "1x8", "plain"])
def test_keras_file_loads_onto_other_mesh_and_plain_model(trained, tmp_path, target):
    path = str(tmp_path / "model.keras")
    trained.save(path)
    if target is None:
        loaded = keras.models.load_model(path)
    else:
        with strategy_on(target).scope():
            loaded = keras.models.load_model(path)
        kernel = loaded.get_layer("up").kernel.value
        assert kernel.layout.sharding_specs == ["unsharded", "model"]
        assert kernel.layout.mesh.dim_size("model") == target[1]
    assert_same_state(trained, loaded)
    x, _ = mlp_data(16, seed=9)
    # The state is bit-exact; on another mesh the row-parallel layer sums its
    # partial products in another order (up to 2.4e-7 apart here).
    np.testing.assert_allclose(loaded.predict(x, verbose=0), trained.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", [(4, 2), None], ids=["4x2", "plain"])
def test_weights_file_round_trip(trained, tmp_path, target):
    path = str(tmp_path / "model.weights.h5")
    trained.save_weights(path)
    model = build_on(None if target is None else strategy_on(target), "mlp", WEIGHTS)
    model.load_weights(path)
    for want, got in zip(trained.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("target", [(4, 2), None], ids=["4x2", "plain"])
def test_tf_train_checkpoint_round_trip(trained, tmp_path, target):
    prefix = tf.train.Checkpoint(model=trained, optimizer=trained.optimizer).save(
        str(tmp_path / "ckpt")
    )
    strategy = tf.distribute.get_strategy() if target is None else strategy_on(target)
    model = build_on(strategy, "mlp", WEIGHTS)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(prefix).assert_consumed()
    assert_same_state(trained, model)


def test_backup_and_restore_resumes_exactly(tmp_path):
    x, y = mlp_data(64)
    backup = str(tmp_path / "backup")

    class StopAtEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    straight = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    straight.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)

    first = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(
            x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), StopAtEpoch()],
        )
    resumed = build_on(strategy_on((4, 2)), "mlp", WEIGHTS)
    history = resumed.fit(
        x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    assert len(history.history["loss"]) == 2  # epochs 3 and 4 only
    for want, got in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_model_checkpoint_saves_best(tmp_path):
    x, y = mlp_data(64)
    model = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    path = str(tmp_path / "best.keras")
    model.fit(
        x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(path, save_best_only=True)],
    )
    assert os.path.exists(path)
    loaded = keras.models.load_model(path)
    assert len(loaded.get_weights()) == len(model.get_weights())
    for got in loaded.get_weights():
        assert np.all(np.isfinite(got))
