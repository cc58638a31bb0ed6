"""`keras.callbacks.BackupAndRestore` with its weights and metadata as one unit.

Keras writes `latest.weights.h5`, then `training_metadata.json` (the epoch to
resume at), each over the previous one: a kill between the two resumes at
the old epoch with the new weights, and a kill inside the first leaves no
loadable backup. Under tfmp each backup is a directory of its own,
`backup_dir/ckpt-<n>/`, holding Keras' two files (written by Keras' own code)
and, written last, a `commit` marker, as Orbax and PyTorch's distributed
checkpoints do. A restart loads the newest committed directory and removes
uncommitted ones; after each commit older directories are removed, keeping
the newest one (two with `double_checkpoint=True`: a newest that fails to
load, by its checksum or as HDF5, falls back to the one before, with a
warning). Keras' own resume epoch, `save_freq` ("epoch" or every N batches)
and `delete_checkpoint` behave as in Keras; a backup directory Keras wrote
itself (no `ckpt-<n>`) is still restored.

In a multi-client run every client runs the save (its gathers are
collectives) and only client 0 writes into `backup_dir`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import tempfile
import warnings
from typing import Any, Callable, Iterator

from tfmp import distributed
from tfmp.strategy import atomic_files

_VERSION = re.compile(r"ckpt-(\d+)$")
COMMIT_MARKER = "commit"


def versioned_save(save_model: Callable) -> Callable:
    """`BackupAndRestore._save_model`: Keras writes into a new `ckpt-<n>`,
    then tfmp commits it and removes older ones."""

    @functools.wraps(save_model)
    def wrapper(self):
        if not _is_local(self.backup_dir):
            return save_model(self)
        if not _is_chief():
            with tempfile.TemporaryDirectory() as scratch, _files_in(self, scratch):
                return save_model(self)
        os.makedirs(self.backup_dir, exist_ok=True)
        directory = version_directory(self.backup_dir, max(_versions(self.backup_dir), default=0) + 1)
        os.makedirs(directory)
        with _files_in(self, directory):
            save_model(self)
        files = sorted(os.listdir(directory))
        for name in files:
            atomic_files.fsync_file(os.path.join(directory, name))
        atomic_files.write_text(os.path.join(directory, COMMIT_MARKER), json.dumps({"files": files}))
        atomic_files.fsync_directory(self.backup_dir)
        _remove_all_but(self.backup_dir, keep=2 if self.double_checkpoint else 1)

    return wrapper


def newest_complete_load(load_model: Callable) -> Callable:
    """`BackupAndRestore._load_model`: restores the newest committed
    `ckpt-<n>` (Keras' own code reads it), after removing uncommitted ones."""

    @functools.wraps(load_model)
    def wrapper(self):
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
            if failures:
                warnings.warn(
                    f"tfmp: BackupAndRestore could not load {failures[0][0]} ({failures[0][1]}); "
                    f"resumed from the earlier backup {directory} instead.",
                    stacklevel=2,
                )
            return None
        raise failures[-1][1]

    return wrapper


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
