"""Files written whole or not at all: `atomic_write(path)` (the converter's output, the inspection figures, the
LiteRT report) and `write_json(path, value)` (a training backup's config, keras-vit-masked-digits' records)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[str]:
    """Yields a hidden path beside `path`, with its ending (`.keras`, `.weights.h5`, `.png`: what writers read the
    format from), to write to. It is moved to `path` when the block ends, and removed if the block raises (Ctrl-C
    too): `path` is never half-written, and an older file there stays whole until the new one replaces it."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    ending = name[name.index("."):] if "." in name else ""
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=f".partial{ending}")
    os.close(handle)
    try:
        yield partial
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def write_json(path: str | os.PathLike, value) -> None:
    """Writes `value` as indented JSON to `path`, whole or not at all (`atomic_write`)."""
    with atomic_write(path) as partial, open(partial, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
