"""Where tfmp meets Keras' saving and loading: files written whole, loads
verified and all-or-nothing.

- `Model.save` and `Model.save_weights` (and so `ModelCheckpoint`): in a
  multi-client run every client gathers the values (the gathers are
  collectives) and only client 0 writes; the file is written under a
  temporary name, renamed into place and its SHA-256 recorded beside it
  (`tfmp.strategy.atomic_files`), so a kill mid-save leaves the previous
  file loadable.
- `Model.load_weights`: the file is checked against its checksum first, and
  a load that fails partway (a file with an extra layer) puts back the
  values the model and its optimizer had.
- `keras.models.load_model` / `keras.saving.load_model`: the checksum is
  checked, and a cut-short `.keras` file is named as such (Keras says
  "File not found").

Which Keras attribute each wrapper replaces is declared in
`tfmp.strategy.patches`.
"""

from __future__ import annotations

import functools
import inspect
import os
import tempfile
import zipfile
from typing import Any, Callable

from tfmp import distributed
from tfmp.integrations.internals import keras_io_utils as io_utils
from tfmp.strategy import atomic_files

# The endings Keras writes as one local file (".weights.h5" among them).
_ONE_FILE_ENDINGS = (".keras", ".h5", ".hdf5")


def chief_writes(save: Callable) -> Callable:
    """`Model.save` / `Model.save_weights`: client 0 writes, whole.

    Paths Keras does not write as one local file (`zipped=False`
    directories, sharded weights, remote or Hugging Face paths, file
    objects) go to Keras as given, as do paths into a missing directory.
    """
    signature = inspect.signature(save)

    @functools.wraps(save)
    def wrapper(self, filepath, *args, **kwargs):
        cluster = distributed.cluster()
        if cluster is not None and not cluster.is_chief:
            with tempfile.TemporaryDirectory() as scratch:
                return save(self, os.path.join(scratch, os.path.basename(str(filepath))), *args, **kwargs)
        bound = signature.bind(self, filepath, *args, **kwargs)
        if not _is_one_local_file(bound.arguments):
            return save(self, filepath, *args, **kwargs)
        path = os.fspath(filepath)
        if not bound.arguments.get("overwrite", True) and os.path.exists(path):
            if not io_utils.ask_to_proceed_with_overwrite(path):
                return None
        bound.arguments["overwrite"] = True
        with atomic_files.replacing(path) as partial:
            bound.arguments["filepath"] = partial
            return save(*bound.args, **bound.kwargs)

    return wrapper


def _is_one_local_file(arguments: dict[str, Any]) -> bool:
    filepath = arguments["filepath"]
    if not isinstance(filepath, (str, os.PathLike)):
        return False
    path = os.fspath(filepath)
    if "://" in path or arguments.get("zipped") is False or arguments.get("max_shard_size") is not None:
        return False
    # Into a directory that is missing, Keras' own error names the path.
    return path.endswith(_ONE_FILE_ENDINGS) and os.path.isdir(os.path.dirname(os.path.abspath(path)))


def verified_load_weights(load_weights: Callable) -> Callable:
    """`Model.load_weights`: checksum first, and a failed load changes nothing."""

    @functools.wraps(load_weights)
    def wrapper(self, filepath, *args, **kwargs):
        if isinstance(filepath, (str, os.PathLike)):
            _check_whole(os.fspath(filepath))
        variables = _loadable_variables(self)
        before = [variable.numpy() for variable in variables]
        try:
            return load_weights(self, filepath, *args, **kwargs)
        except BaseException:
            for variable, value in zip(variables, before):
                variable.assign(value)
            raise

    return wrapper


def _loadable_variables(model: Any) -> list[Any]:
    """The model's variables and its built optimizer's, each once."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        variables += optimizer.variables
    return list({id(variable): variable for variable in variables}.values())


def verified_load_model(load_model: Callable) -> Callable:
    """`keras.models.load_model`: checksum first; a cut-short `.keras` file
    is named as such."""

    @functools.wraps(load_model)
    def wrapper(filepath, *args, **kwargs):
        if isinstance(filepath, (str, os.PathLike)):
            _check_whole(os.fspath(filepath))
        return load_model(filepath, *args, **kwargs)

    return wrapper


def _check_whole(path: str) -> None:
    if not os.path.isfile(path):
        return
    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        raise ValueError(
            f"tfmp: {path} is not a whole .keras file: its {os.path.getsize(path)} bytes "
            "end without the zip directory a .keras archive ends with, so it was cut "
            "short (a save killed before it finished, or an incomplete copy). Load an "
            "earlier copy; a save through tfmp replaces a file only once it is written whole."
        )
    atomic_files.verify(path)
