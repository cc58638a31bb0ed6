"""A kill during any save leaves the previous file or the new one, whole;
damaged files are named on load; a failed load changes nothing.

The kill tests run `tests/programs/save_loop.py` (saves on a 2x4 mesh, over
and over, alternating two sets of weights) and SIGKILL it at a random moment
(fixed seeds); the file on disk must then load and hold one of the two sets
exactly. TFMP_SAVE_KILLS (default 2) sets the kills per save path (half as
many for ModelCheckpoint); with 6, 30 of 30 kills over the five paths of
`save_loop.py` left a loadable file, against 2 of 12 before tfmp wrote
files whole.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import tfmp
from helpers import build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map
from tfmp.strategy import atomic_files, backups

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
KILLS = int(os.environ.get("TFMP_SAVE_KILLS", "2"))
WEIGHTS = initial_weights(build_mlp)
SHIFTED = [w + 1 for w in WEIGHTS]


def strategy_on(shape):
    device_mesh = mesh(shape)
    return tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))


@pytest.fixture(autouse=True, scope="module")
def installed():
    """tfmp's patches are in, as in any program that made a strategy: the
    plain models here load (and save) through them too. The strategy is
    held: tfmp takes its patches back once no strategy is left."""
    yield strategy_on((2, 4))


@pytest.fixture(scope="module")
def model():
    """An MLP on a 2x4 mesh with its optimizer state."""
    model = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    model.fit(*mlp_data(37), batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def which_weights(weights):
    """0 or 1: which of the two sets the save loop writes `weights` is."""
    for index, candidate in enumerate((WEIGHTS, SHIFTED)):
        if len(weights) == len(candidate) and all(np.array_equal(w, c) for w, c in zip(weights, candidate)):
            return index
    raise AssertionError("the loaded weights are neither the old nor the new ones")


def loaded_weights(work, kind):
    """The weights the save loop's file holds, and for a backup, the epoch
    it resumes at; as a user loads them (a plain model)."""
    if kind in ("keras", "checkpoint"):
        name = "model.keras" if kind == "keras" else "checkpoint.keras"
        return keras.models.load_model(os.path.join(work, name)).get_weights(), None
    if kind == "h5":
        return keras.models.load_model(os.path.join(work, "model.h5"), compile=False).get_weights(), None
    model = build_on(None, "mlp", WEIGHTS)
    if kind == "weights":
        model.load_weights(os.path.join(work, "model.weights.h5"))
        return model.get_weights(), None
    backup = keras.callbacks.BackupAndRestore(os.path.join(work, "backup"))
    backup.set_model(model)
    backup.on_train_begin()
    return model.get_weights(), model._initial_epoch  # noqa: SLF001


def save_again(work, kind):
    """Saves to the killed loop's path once more: what the killed save left
    is removed."""
    model = build_on(None, "mlp", WEIGHTS)
    name = {"keras": "model.keras", "checkpoint": "checkpoint.keras", "h5": "model.h5"}.get(kind)
    if name is None:
        model.save_weights(os.path.join(work, "model.weights.h5"))
    else:
        model.save(os.path.join(work, name))


def partial_files(work):
    return [os.path.join(root, name) for root, _, names in os.walk(work) for name in names if name.startswith(".tfmp-partial-")]


def run_until_killed(work, kind, rng):
    loop = subprocess.Popen([sys.executable, os.path.join(PROGRAMS, "save_loop.py"), work, kind], stderr=subprocess.PIPE, text=True)
    ready = os.path.join(work, "ready")
    deadline = time.time() + 180
    first_save = None
    while first_save is None:
        assert loop.poll() is None, loop.stderr.read()[-3000:]
        assert time.time() < deadline, "the save loop did not finish its first save"
        time.sleep(0.05)
        if os.path.exists(ready):
            with open(ready) as file:
                text = file.read()
            first_save = float(text) if text else None
    # Over the next few saves (later ones are faster than the first).
    time.sleep(rng.uniform(0, 2 * first_save))
    loop.send_signal(signal.SIGKILL)
    loop.wait(timeout=60)
    loop.stderr.close()


@pytest.mark.parametrize("kind", ["keras", "weights", "checkpoint", "backup"])
def test_a_kill_during_a_save_leaves_the_old_or_the_new_file(tmp_path, kind):
    rng = random.Random(f"{kind}-kills")
    # ModelCheckpoint saves through model.save, whose kills `keras` covers.
    for kill in range(KILLS if kind != "checkpoint" else max(1, KILLS // 2)):
        work = str(tmp_path / f"kill{kill}")
        os.makedirs(work)
        run_until_killed(work, kind, rng)
        weights, epoch = loaded_weights(work, kind)
        index = which_weights(weights)
        if kind == "backup":
            # Save i holds weights i % 2 and resumes at epoch i + 1: one unit.
            assert (epoch - 1) % 2 == index, (epoch, index)
            # The restore removed any uncommitted backup.
            backup_dir = os.path.join(work, "backup")
            leftovers = [d for d in os.listdir(backup_dir) if d.startswith("ckpt-")]
            assert leftovers == [f"ckpt-{backups.committed_versions(backup_dir)[0]}"], leftovers
        else:
            save_again(work, kind)
        assert not partial_files(work), partial_files(work)


def test_a_later_save_removes_what_a_killed_save_left(model, tmp_path):
    path = str(tmp_path / "model.keras")
    model.save(path)
    stale = str(tmp_path / ".tfmp-partial-0123456789ab.model.keras")
    shutil.copy(path, stale)
    with open(stale, "r+b") as file:
        file.truncate(100)
    model.save(path)
    assert sorted(os.listdir(tmp_path)) == ["model.keras", "model.keras.sha256"]
    keras.models.load_model(path)


@pytest.mark.parametrize("name", ["model.keras", "model.h5", "model.weights.h5"])
def test_the_disk_at_every_step_of_a_save_holds_a_loadable_file(model, tmp_path, monkeypatch, name):
    """What a kill between any two file operations of a save would leave:
    the directory is copied before and after each rename, flush and
    checksum write of the second of two saves, and each copy must load
    the old or the new weights, matching its checksum."""
    path = str(tmp_path / "saves" / name)
    os.makedirs(os.path.dirname(path))
    plain = build_on(None, "mlp", WEIGHTS)
    save = plain.save_weights if name.endswith(".weights.h5") else plain.save
    save(path)
    images = []

    def imaged(function):
        def wrapper(*args, **kwargs):
            images.append(shutil.copytree(os.path.dirname(path), str(tmp_path / f"image{len(images)}")))
            result = function(*args, **kwargs)
            images.append(shutil.copytree(os.path.dirname(path), str(tmp_path / f"image{len(images)}")))
            return result

        return wrapper

    for function in ("replace", "fsync"):
        monkeypatch.setattr(atomic_files.os, function, imaged(getattr(os, function)))
    plain.set_weights(SHIFTED)
    save(path)
    monkeypatch.undo()
    assert len(images) >= 8
    held = []
    for image in images:
        copy = os.path.join(image, name)
        if name.endswith(".weights.h5"):
            loader = build_on(None, "mlp", WEIGHTS)
            loader.load_weights(copy)
            held.append(which_weights(loader.get_weights()))
        else:
            held.append(which_weights(keras.models.load_model(copy, compile=False).get_weights()))
    assert held[0] == 0 and held[-1] == 1 and held == sorted(held), held


def test_a_flipped_byte_is_named_on_load_and_changes_nothing(model, tmp_path):
    weights_path = str(tmp_path / "model.weights.h5")
    model.save_weights(weights_path)
    keras_path = str(tmp_path / "model.keras")
    model.save(keras_path)
    before = model.get_weights()
    for path in (weights_path, keras_path):
        with open(path, "r+b") as file:
            file.seek(os.path.getsize(path) // 2)
            byte = file.read(1)
            file.seek(-1, os.SEEK_CUR)
            file.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match=f"{weights_path} does not match the SHA-256"):
        model.load_weights(weights_path)
    with pytest.raises(ValueError, match=f"{keras_path} does not match the SHA-256"):
        keras.models.load_model(keras_path)
    for want, got in zip(before, model.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_files_without_a_checksum_load_as_keras_wrote_them(model, tmp_path):
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    os.remove(atomic_files.checksum_path(path))
    loader = build_on(strategy_on((4, 2)), "mlp", SHIFTED)
    loader.load_weights(path)
    for want, got in zip(model.get_weights(), loader.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_a_truncated_keras_file_is_named_as_truncated(model, tmp_path):
    path = str(tmp_path / "model.keras")
    model.save(path)
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=f"{path} is not a whole .keras file.*cut short"):
        keras.models.load_model(path)


def test_a_failed_load_leaves_the_model_and_its_optimizer_as_they_were(model, tmp_path):
    path = str(tmp_path / "extra_layer.weights.h5")
    extra = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, name="up"), keras.layers.Dense(32, name="extra"), keras.layers.Dense(8, name="down")]
    )
    extra.save_weights(path)
    before = [v.numpy() for v in model.weights + model.optimizer.variables]
    with pytest.raises(ValueError, match="could not be loaded"):
        model.load_weights(path)
    after = [v.numpy() for v in model.weights + model.optimizer.variables]
    for want, got in zip(before, after):
        np.testing.assert_array_equal(got, want)
    # Keras' own load overwrites `up` before it fails: the case is a real one.
    plain = build_on(None, "mlp", WEIGHTS)
    with pytest.raises(ValueError, match="could not be loaded"):
        type(plain).load_weights.__wrapped__(plain, path)
    assert not np.array_equal(plain.get_layer("up").kernel.numpy(), WEIGHTS[0])


def test_a_kill_between_the_backup_weights_and_its_epoch_resumes_exactly(tmp_path):
    backup = str(tmp_path / "backup")
    killed = subprocess.run(
        [sys.executable, os.path.join(PROGRAMS, "backup_killed_mid_save.py"), backup],
        capture_output=True, text=True, timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    x, y = mlp_data(37)
    straight = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    straight.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0)
    resumed = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    history = resumed.fit(
        x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    # Killed inside epoch index 2's backup: the one after epoch index 1
    # holds, so epochs 3 and 4 run again.
    assert len(history.history["loss"]) == 2
    for want, got in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert not os.path.exists(backup)  # delete_checkpoint=True, as in Keras


def test_backup_every_n_batches_resumes_at_the_epoch_keras_records(tmp_path):
    """save_freq=3 batches over 5 batches an epoch, stopped after batch 4 of
    epoch index 1: the last backup (after batch 3) holds that moment's
    weights and Keras' resume epoch 1."""
    x, y = mlp_data(37)
    backup = str(tmp_path / "backup")

    class StopInEpochOne(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch == 3:
                self.at_last_backup = self.model.get_weights()
            if self.epoch == 1 and batch == 4:
                raise RuntimeError("interrupted")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    stop = StopInEpochOne()
    first = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=3), stop])
    class AtStart(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.weights = self.model.get_weights()

    resumed = build_on(strategy_on((4, 2)), "mlp", WEIGHTS)
    start = AtStart()
    history = resumed.fit(
        x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=3, delete_checkpoint=False), start],
    )
    assert len(history.history["loss"]) == 2  # resumed at epoch index 1
    for want, got in zip(stop.at_last_backup, start.weights):
        np.testing.assert_array_equal(got, want)
    assert [d for d in os.listdir(backup) if d.startswith("ckpt-")] == [f"ckpt-{backups.committed_versions(backup)[0]}"]


def test_plain_keras_resumes_from_a_backup_tfmp_wrote(tmp_path):
    """The same program without tfmp (Keras' own restore) reads the newest
    committed backup through Keras' files in backup_dir."""
    x, y = mlp_data(37)
    backup = str(tmp_path / "backup")

    class StopAtEpochTwo(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                self.after_two = self.model.get_weights()
                raise RuntimeError("interrupted")

    stop = StopAtEpochTwo()
    on_mesh = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    with pytest.raises(RuntimeError, match="interrupted"):
        on_mesh.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup), stop])
    assert sorted(os.listdir(backup))[-2:] == ["latest.weights.h5", "training_metadata.json"]

    plain = build_on(None, "mlp", WEIGHTS)
    restore = keras.callbacks.BackupAndRestore(backup)
    restore.set_model(plain)
    keras.callbacks.BackupAndRestore._load_model.__wrapped__(restore)  # Keras' own, without tfmp
    assert plain._initial_epoch == 2
    for want, got in zip(stop.after_two, plain.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_a_clients_backup_does_not_race_the_chief_creating_the_directory(tmp_path, monkeypatch):
    """Keras' backup checks, then creates, `backup_dir`. A client other than
    the chief writes its files elsewhere, but Keras' check still ran; here
    the chief creates the directory right after that check says it is
    missing, as it did in a two-client run (FileExistsError)."""
    from keras.src.callbacks import backup_and_restore

    backup = str(tmp_path / "backup")
    exists = backup_and_restore.file_utils.exists

    def chief_creates_it_meanwhile(path):
        found = exists(path)
        if path == backup and not found:
            os.makedirs(backup)
        return found

    monkeypatch.setattr(backup_and_restore.file_utils, "exists", chief_creates_it_meanwhile)
    monkeypatch.setattr(backups, "_is_chief", lambda: False)
    model = build_on(strategy_on((2, 4)), "mlp", WEIGHTS)
    model.fit(*mlp_data(16), batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    assert os.listdir(backup) == []  # this client's files went to its scratch directory
