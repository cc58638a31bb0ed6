"""Files replaced whole, with a checksum beside them.

A writer that truncates its target first (Keras' `.keras`, `.h5` and
`.weights.h5` writers all do) loses the previous file when the process dies
mid-write. Here the new file is written under a temporary name in the same
directory, flushed to disk, and renamed over the target (`os.replace` is
atomic within a file system), so a kill leaves the old file or the new one.

Beside it, `<file>.sha256` holds its SHA-256 in `sha256sum` format. While a
replacement is in flight the checksum file lists the old digest and the new
one, so whichever file a kill leaves matches; afterwards only the new one.
A file without a checksum file (written by plain Keras) loads unverified.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from typing import Iterator

CHECKSUM_SUFFIX = ".sha256"
_PARTIAL_PREFIX = ".tfmp-partial-"
_TOKEN_CHARACTERS = 12
_CHUNK = 1 << 20


class ChecksumMismatchError(ValueError):
    """A file's SHA-256 is not the one recorded when it was written."""


def checksum_path(path: str) -> str:
    return path + CHECKSUM_SUFFIX


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
    """Yields a temporary path beside `path`; once the block has written it,
    it replaces `path` whole and its checksum is recorded.

    The temporary name keeps `path`'s whole name as its ending (Keras picks
    its format by `.keras`, `.weights.h5`, `.h5`). Temporary files an earlier
    killed save of `path` left are removed first; if the block raises, its
    own is removed and `path` is untouched.
    """
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    _remove_partials_of(directory, name)
    _remove_partials_of(directory, name + CHECKSUM_SUFFIX)
    partial = _partial_path(directory, name)
    try:
        yield partial
        fsync_file(partial)
        digest = sha256_of(partial)
        recorded = recorded_digests(path)
        if recorded is not None:
            # Old and new both match while the rename is in flight.
            write_text(checksum_path(path), _checksum_text([*recorded, digest], name))
        os.replace(partial, path)
        fsync_directory(directory)
        write_text(checksum_path(path), _checksum_text([digest], name))
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def write_text(path: str, text: str) -> None:
    """Writes `text` to `path` under a temporary name, flushed, then renamed
    into place."""
    directory, name = os.path.split(os.path.abspath(path))
    partial = _partial_path(directory, name)
    try:
        with open(partial, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
        fsync_directory(directory)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def recorded_digests(path: str) -> list[str] | None:
    """The digests `path`'s checksum file accepts, or None without one."""
    try:
        with open(checksum_path(path)) as file:
            lines = file.read().splitlines()
    except FileNotFoundError:
        return None
    return [line.split()[0] for line in lines if line.strip()]


def verify(path: str) -> None:
    """Raises ChecksumMismatchError if `path` does not match its checksum
    file; a file without one passes."""
    recorded = recorded_digests(path)
    if recorded is None or not os.path.isfile(path):
        return
    actual = sha256_of(path)
    if actual not in recorded:
        raise ChecksumMismatchError(
            f"tfmp: {path} does not match the SHA-256 recorded beside it when it was "
            f"saved ({checksum_path(path)}: {recorded[-1]}; the file's is {actual}): it "
            "was changed or damaged after it was written. Load another copy (an "
            "earlier checkpoint), or delete the .sha256 file to load it unverified."
        )


def fsync_directory(directory: str) -> None:
    """Makes a rename or a new entry in `directory` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_file(path: str) -> None:
    """Flushes a closed file's data to disk."""
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _checksum_text(digests: list[str], name: str) -> str:
    unique = list(dict.fromkeys(digests))
    return "".join(f"{digest}  {name}\n" for digest in unique)


def _partial_path(directory: str, name: str) -> str:
    return os.path.join(directory, f"{_PARTIAL_PREFIX}{secrets.token_hex(_TOKEN_CHARACTERS // 2)}.{name}")


def _remove_partials_of(directory: str, name: str) -> None:
    pattern = re.compile(re.escape(_PARTIAL_PREFIX) + f"[0-9a-f]{{{_TOKEN_CHARACTERS}}}\\." + re.escape(name) + "$")
    for entry in os.listdir(directory):
        if pattern.match(entry):
            os.remove(os.path.join(directory, entry))
