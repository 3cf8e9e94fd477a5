"""Files and folders that appear whole or not at all: written under a temporary name beside their place, then renamed
over it (`os.replace`, atomic within one file system), so a reader, or a run resumed after a kill, never sees half
of one. A leaf module every package may import."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` (same folder, hidden, named after this process) to write a file or a folder
    at; renamed over `path` when the block ends, removed when it raises. A folder can only replace a missing or
    empty one: remove a stale one first. One writer of `path` at a time per process."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _remove(temporary)  # the leftover of a killed writer
    try:
        yield temporary
    except BaseException:
        _remove(temporary)
        raise
    os.replace(temporary, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (see `atomic_path`); returns `path`."""
    with atomic_path(path) as temporary:
        temporary.write_text(text)
    return Path(path)
