"""`keras.callbacks.BackupAndRestore` with its weights and metadata as one unit.

Keras writes `latest.weights.h5`, then `training_metadata.json` (the epoch to
resume at), each over the previous one: a kill between the two resumes at
the old epoch with the new weights, and a kill inside the first leaves no
loadable backup. Under tfmp each backup is a directory of its own,
`backup_dir/ckpt-<n>/`, holding Keras' two files (written by Keras' own code)
and, written last, a `commit` marker, as Orbax and PyTorch's distributed
checkpoints do. A restart loads the newest committed directory and removes
uncommitted and older ones; after each commit older directories are removed, keeping
the newest one (two with `double_checkpoint=True`: a newest that fails to
load, by its checksum or as HDF5, falls back to the one before, with a
warning). Keras' own resume epoch, `save_freq` ("epoch" or every N batches)
and `delete_checkpoint` behave as in Keras; a backup directory Keras wrote
itself (no `ckpt-<n>`) is still restored, and Keras' own files in
`backup_dir` are kept the newest committed backup's, so the program without
tfmp resumes from it too.

In a multi-client run every client runs the save (its gathers are
collectives) and only client 0 writes into `backup_dir`.

A backup taken in the middle of an epoch (`save_freq=N` batches, or a
preemption notice: `tfmp.strategy.preemption`) also records how many of the
epoch's batches were done and the totals of the model's metrics; a restart
resumes after those batches with those totals, so its losses, metrics and
weights are an uninterrupted run's (Keras restarts the epoch from its first
batch, with the weights of its middle). The epoch Keras records for such a
backup is the one it was taken in, also in a run that was itself resumed
(Keras counts from 0 again there).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from typing import Any, Callable, Iterator

import numpy as np

from tfmp import distributed
from tfmp.state import BackupState, state_of
from tfmp.strategy import atomic_files, epoch_iterator
from tfmp.strategy.extended import extended_of
from tfmp.strategy.preemption import PREEMPTED_EXIT_CODE, notice

_VERSION = re.compile(r"ckpt-(\d+)$")
COMMIT_MARKER = "commit"
# The key of tfmp's part of Keras' training_metadata.json.
PROGRESS_KEY = "tfmp"


def versioned_save(save_model: Callable) -> Callable:
    """`BackupAndRestore._save_model`: Keras writes into a new `ckpt-<n>`,
    then tfmp commits it and removes older ones."""

    @functools.wraps(save_model)
    def wrapper(self):
        if not _is_local(self.backup_dir):
            return save_model(self)
        # Read in every client, as every value a save reads.
        progress = _progress(self)
        # Keras checks, then creates, `backup_dir`: with the chief creating it
        # meanwhile, another client's makedirs raised FileExistsError.
        os.makedirs(self.backup_dir, exist_ok=True)
        if not _is_chief():
            with tempfile.TemporaryDirectory() as scratch, _files_in(self, scratch):
                return save_model(self)
        directory = version_directory(self.backup_dir, max(_versions(self.backup_dir), default=0) + 1)
        os.makedirs(directory)
        with _files_in(self, directory):
            save_model(self)
        _record_progress(progress, os.path.join(directory, os.path.basename(self._training_metadata_path)))
        files = sorted(os.listdir(directory))
        for name in files:
            atomic_files.fsync_file(os.path.join(directory, name))
        atomic_files.write_text(os.path.join(directory, COMMIT_MARKER), json.dumps({"files": files}))
        atomic_files.fsync_directory(self.backup_dir)
        _mirror_for_keras(self, directory)
        _remove_all_but(self.backup_dir, keep=2 if self.double_checkpoint else 1)

    return wrapper


def newest_complete_load(load_model: Callable) -> Callable:
    """`BackupAndRestore._load_model`: restores the newest committed
    `ckpt-<n>` (Keras' own code reads it), after removing uncommitted ones."""

    @functools.wraps(load_model)
    def wrapper(self):
        state_of(self, BackupState).resume = None
        if not _is_local(self.backup_dir) or not os.path.isdir(self.backup_dir):
            return load_model(self)
        if _is_chief():
            for number in set(_versions(self.backup_dir)) - set(committed_versions(self.backup_dir)):
                _remove_version(version_directory(self.backup_dir, number))
        committed = committed_versions(self.backup_dir)
        if not committed:
            return load_model(self)
        failures = []
        for number in committed:
            directory = version_directory(self.backup_dir, number)
            try:
                with _files_in(self, directory):
                    load_model(self)
            except (OSError, atomic_files.ChecksumMismatchError) as error:
                failures.append((directory, error))
                continue
            _restore_progress(self, os.path.join(directory, os.path.basename(self._training_metadata_path)))
            if _is_chief():
                # A kill after a commit, before the older backups were removed,
                # leaves them: the next save would remove them too.
                older = [n for n in committed if n < number]
                for stale in older[1 if self.double_checkpoint else 0 :]:
                    _remove_version(version_directory(self.backup_dir, stale))
            if failures:
                warnings.warn(
                    f"tfmp: BackupAndRestore could not load {failures[0][0]} ({failures[0][1]}); "
                    f"resumed from the earlier backup {directory} instead.",
                    stacklevel=2,
                )
            return None
        raise failures[-1][1]

    return wrapper


def armed_for_preemption(on_train_begin: Callable) -> Callable:
    """`BackupAndRestore.on_train_begin`: restores as Keras does, then arms
    the SIGTERM handler, and a backup taken mid-epoch skips the batches it
    had done."""

    @functools.wraps(on_train_begin)
    def wrapper(self, logs=None):
        on_train_begin(self, logs)
        resume = state_of(self, BackupState).resume
        if resume is not None:
            _check_same_batches(resume, (self.params or {}).get("steps"), self.backup_dir)
        epoch_iterator.skip_in_next_epoch(resume["batches_done"] if resume else 0)
        notice.arm()

    return wrapper


def disarmed(on_train_end: Callable) -> Callable:
    """`BackupAndRestore.on_train_end`: the SIGTERM handler goes, and only
    client 0, which wrote the backups, deletes them: clients sharing the
    directory would otherwise remove the same files at once and fail."""

    @functools.wraps(on_train_end)
    def wrapper(self, logs=None):
        notice.disarm()
        epoch_iterator.skip_in_next_epoch(0)
        if not _is_chief():
            return None
        return on_train_end(self, logs)

    return wrapper


def resumed_epoch_begin(on_epoch_begin: Callable) -> Callable:
    """`BackupAndRestore.on_epoch_begin`: knows the epoch it is in (Keras'
    own counts from 0 in a resumed run), and the epoch a backup taken
    mid-epoch resumes gets back its metric totals (`fit` reset them just
    before)."""

    @functools.wraps(on_epoch_begin)
    def wrapper(self, epoch, logs=None):
        self._current_epoch = epoch
        state = state_of(self, BackupState)
        resume = state.resume
        if resume is not None:
            state.resume = None
            _assign_metrics(self.model, resume["metrics"])
        return on_epoch_begin(self, epoch, logs)

    return wrapper


def saved_on_preemption(on_train_batch_end: Callable) -> Callable:
    """`BackupAndRestore.on_train_batch_end`: after a SIGTERM (in any client),
    saves a backup of this batch and exits with `PREEMPTED_EXIT_CODE`."""

    @functools.wraps(on_train_batch_end)
    def wrapper(self, batch, logs=None):
        state = state_of(self, BackupState)
        state.batches_done = batch + 1
        try:
            if notice.agreed(_mesh_of(self.model)):
                self._save_model()
                _exit_preempted(self, batch)
            return on_train_batch_end(self, batch, logs)
        finally:
            state.batches_done = None

    return wrapper


def _exit_preempted(callback: Any, batch: int) -> None:
    print(
        f"tfmp: preempted: saved a backup in {callback.backup_dir} after batch {batch + 1} "
        f"of epoch {callback._current_epoch + 1} (as Keras counts them); exiting with "
        f"status {PREEMPTED_EXIT_CODE}. Run the same command again to resume there.",
        file=sys.stderr,
        flush=True,
    )
    notice.disarm()
    sys.exit(PREEMPTED_EXIT_CODE)


def _mesh_of(model: Any) -> Any:
    extended = extended_of(getattr(model, "distribute_strategy", None))
    return None if extended is None else extended.home_mesh.dtensor_mesh


def _progress(callback: Any) -> dict[str, Any] | None:
    """How far into the epoch a backup taken at a batch end is, and the
    metric totals there; None at an epoch end."""
    batches_done = state_of(callback, BackupState).batches_done
    if batches_done is None:
        return None
    return {
        "batches_done": batches_done,
        "batches_per_epoch": (callback.params or {}).get("steps"),
        "metrics": {v.path: np.asarray(v).tolist() for v in callback.model.metrics_variables},
    }


def _record_progress(progress: dict[str, Any] | None, metadata_path: str) -> None:
    """Adds `progress` to the metadata Keras wrote."""
    if progress is None or not os.path.exists(metadata_path):
        return
    with open(metadata_path) as file:
        metadata = json.load(file)
    metadata[PROGRESS_KEY] = progress
    atomic_files.write_text(metadata_path, json.dumps(metadata))


def _restore_progress(callback: Any, metadata_path: str) -> None:
    if not os.path.exists(metadata_path):
        return
    with open(metadata_path) as file:
        progress = json.load(file).get(PROGRESS_KEY)
    if progress is None:
        return
    state_of(callback, BackupState).resume = progress
    # Keras counts batches since its last backup from here.
    callback._last_batch_seen = progress["batches_done"] - 1
    callback._batches_seen_since_last_saving = 0


def _check_same_batches(progress: dict[str, Any], batches_per_epoch: int | None, backup_dir: str) -> None:
    """A mid-epoch resume skips batches by count: they must be the same batches."""
    recorded = progress.get("batches_per_epoch")
    if recorded and batches_per_epoch and recorded != batches_per_epoch:
        raise ValueError(
            f"BackupAndRestore: the backup in {backup_dir} was taken after batch "
            f"{progress['batches_done']} of an epoch of {recorded} batches, but this fit's "
            f"epochs have {batches_per_epoch}: resume with the data, batch_size and "
            "steps_per_epoch it was trained with, or delete the backup to start over."
        )


def _assign_metrics(model: Any, values: dict[str, Any]) -> None:
    variables = {v.path: v for v in model.metrics_variables}
    if set(variables) != set(values):
        raise ValueError(
            "BackupAndRestore: the backup was taken in the middle of an epoch with the "
            f"metric variables {sorted(values)}, but the model has {sorted(variables)}: "
            "compile the model with the metrics it was trained with to resume it."
        )
    for path, value in values.items():
        variables[path].assign(np.asarray(value, dtype=variables[path].dtype))


def _mirror_for_keras(callback: Any, directory: str) -> None:
    """Keras' own two files in `backup_dir` become the committed backup's
    (hard links, each put in place by a rename): the same program without
    tfmp resumes from it as from a backup Keras wrote. tfmp itself reads
    the `ckpt-<n>` directories."""
    for path in (callback._weights_path, callback._training_metadata_path):  # noqa: SLF001
        committed = os.path.join(directory, os.path.basename(path))
        staged = f"{path}.tfmp-staged"
        with contextlib.suppress(FileNotFoundError):
            os.remove(staged)
        try:
            os.link(committed, staged)
        except OSError:  # a file system without hard links
            shutil.copyfile(committed, staged)
        os.replace(staged, path)
    atomic_files.fsync_directory(callback.backup_dir)


def version_directory(backup_dir: str, number: int) -> str:
    return os.path.join(backup_dir, f"ckpt-{number}")


def committed_versions(backup_dir: str) -> list[int]:
    """Numbers of the backups whose commit marker is written, newest first."""
    return sorted(
        (n for n in _versions(backup_dir) if os.path.exists(os.path.join(version_directory(backup_dir, n), COMMIT_MARKER))),
        reverse=True,
    )


def _versions(backup_dir: str) -> list[int]:
    return [int(match.group(1)) for entry in os.listdir(backup_dir) if (match := _VERSION.match(entry))]


def _remove_all_but(backup_dir: str, keep: int) -> None:
    kept = set(committed_versions(backup_dir)[:keep])
    for number in _versions(backup_dir):
        if number not in kept:
            _remove_version(version_directory(backup_dir, number))


def _remove_version(directory: str) -> None:
    """The marker goes first, so a kill midway leaves an uncommitted
    directory, never a committed one with files missing."""
    marker = os.path.join(directory, COMMIT_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
        atomic_files.fsync_directory(directory)
    shutil.rmtree(directory)


@contextlib.contextmanager
def _files_in(callback: Any, directory: str) -> Iterator[None]:
    """Points Keras' BackupAndRestore at its files inside `directory`."""
    names = ("_weights_path", "_training_metadata_path", "_prev_weights_path", "_prev_training_metadata_path")
    saved = {name: getattr(callback, name) for name in names}
    for name, path in saved.items():
        setattr(callback, name, os.path.join(directory, os.path.basename(path)))
    try:
        yield
    finally:
        for name, path in saved.items():
            setattr(callback, name, path)


def _is_chief() -> bool:
    cluster = distributed.cluster()
    return cluster is None or cluster.is_chief


def _is_local(path: Any) -> bool:
    return "://" not in str(path)
