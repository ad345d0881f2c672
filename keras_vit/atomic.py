"""Files and folders written whole or not at all: `atomic_write(path)` (the converter's output, the inspection
figures, the LiteRT report), `atomic_write(path, folder=True)` (a SavedModel version folder) and `write_json(path,
value)` (a training backup's config, keras-vit-masked-digits' records); `check_room` refuses a write before it starts
where a folder cannot be written (a read-only mount, no permission) or its disk has no room, `variables_bytes`
estimates the room a file of variables takes."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
from typing import Iterable, Iterator

import numpy as np


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, folder: bool = False) -> Iterator[str]:
    """Yields a hidden path beside `path` to write to: a file path with `path`'s ending (`.keras`, `.weights.h5`,
    `.png`: what writers read the format from), or with `folder` an empty folder. It replaces `path` when the block
    ends, and is removed if the block raises (Ctrl-C too): `path` is never half-written, and an older one there
    stays whole until the new one replaces it."""
    parent, name = os.path.split(os.path.abspath(path))
    with _named_if_not_writable(parent, name):
        os.makedirs(parent, exist_ok=True)
        if folder:
            partial = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".partial")
        else:
            ending = name[name.index("."):] if "." in name else ""
            handle, partial = tempfile.mkstemp(dir=parent, prefix=f".{name}.", suffix=f".partial{ending}")
            os.close(handle)
    try:
        yield partial
        if folder and os.path.exists(path):  # a folder cannot be renamed over another: the old one moves aside
            retired = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".old")
            os.rename(path, os.path.join(retired, name))
            os.rename(partial, path)
            shutil.rmtree(retired)
        else:
            os.replace(partial, path)
    finally:
        if os.path.isdir(partial):
            shutil.rmtree(partial, ignore_errors=True)
        elif os.path.exists(partial):
            os.remove(partial)


class DiskSpaceError(OSError):
    """Not enough free space for the files about to be written (errno ENOSPC); nothing was written."""


class NotWritableError(OSError):
    """A folder the files were to be written to cannot be written (errno EROFS: a read-only mount; EACCES or EPERM:
    no permission); nothing was written."""


# What the system says where a folder cannot be written (not a fault of the disk's size).
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _not_writable(folder: str, what: str, code: int) -> NotWritableError:
    return NotWritableError(code, f"Cannot write {what} in {folder}: {os.strerror(code).lower()}. Nothing was "
                                  "written and the files there before are whole: make the folder writable (or choose "
                                  "another) and run the same command again")


@contextlib.contextmanager
def _named_if_not_writable(folder: str, what: str) -> Iterator[None]:
    """Turns the system's "read-only file system: <hidden partial path>" into `NotWritableError` naming `what`."""
    try:
        yield
    except OSError as error:
        if error.errno not in NOT_WRITABLE:
            raise
        raise _not_writable(folder, what, error.errno) from error


def check_room(needs: dict[str, int], what: str) -> None:
    """Raises `NotWritableError` where a folder cannot be written (a read-only mount, no permission: asked of the
    system with `os.access`, which root's writes obey on a read-only mount as well), and `DiskSpaceError` where a
    file system lacks the space for the bytes about to be written to it.

    Args:
        needs: folder -> the bytes about to be written there (folders on one file system are added up; a folder
            that does not exist yet is measured at its nearest existing parent).
        what: what would be written, for the message.
    """
    by_device: dict[int, tuple[str, str, int]] = {}
    for folder, size in needs.items():
        existing = _nearest_existing(folder)
        if not os.access(existing, os.W_OK):
            read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
            raise _not_writable(folder, what, errno.EROFS if read_only else errno.EACCES)
        device = os.stat(existing).st_dev
        first, measured, total = by_device.get(device, (folder, existing, 0))
        by_device[device] = (first, measured, total + size)
    for folder, measured, needed in by_device.values():
        free = shutil.disk_usage(measured).free
        if free < needed:
            raise DiskSpaceError(errno.ENOSPC, f"Not enough free space for {what} in {folder}: about "
                                 f"{_mebibytes(needed)} needed, {_mebibytes(free)} free. Nothing was written and the "
                                 "files there before are whole: free some space and run the same command again")


def variables_bytes(variables: Iterable, per_variable: int = 0) -> int:
    """The bytes of `variables` (anything with a `shape` and a `dtype`: Keras variables), plus `per_variable` bytes
    of a file format's own overhead for each (HDF5: a few KiB)."""
    return sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize + per_variable for v in variables)


def _nearest_existing(folder: str) -> str:
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def _mebibytes(size: int) -> str:
    return f"{size / 2 ** 20:.1f} MiB"


def write_json(path: str | os.PathLike, value) -> None:
    """Writes `value` as indented JSON to `path`, whole or not at all (`atomic_write`)."""
    with atomic_write(path) as partial, open(partial, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
