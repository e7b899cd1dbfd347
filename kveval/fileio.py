"""Crash-safe file primitives shared by every module that writes: atomic replacement and the JSONL log reader.

    atomic_write_json(run / "metrics.json", metrics)       # readers see the old file or the new one, never half
    with atomic_path(scales_path) as tmp:                  # any writer that wants a path (safetensors, numpy...)
        save_file(tensors, str(tmp))
    with atomic_path(entry, folder=True) as tmp: ...       # a whole folder, renamed into place when complete
    records = read_jsonl(run / "records.jsonl")            # an append-only log, minus a torn last line

The temporary file or folder is a hidden sibling of the target (``.<name>.<random>``, same file system, so the
final ``os.replace`` is atomic); it is removed when the block raises. Files are created by
:func:`tempfile.mkstemp`, so they keep its mode (0600). Standard library only, in the lowest layer: the data and
model caches, scales files, run folders and plan files all write through it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _unlink_quietly(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | Path, *, folder: bool = False, suffix: str = "",
                replace: Callable[[Path, Path], None] | None = None) -> Iterator[Path]:
    """A fresh temporary sibling of ``path`` to write (an empty file, or with ``folder`` an empty folder); when the
    block ends without an error it takes the place of ``path``, otherwise it is deleted.

    ``suffix``: the temporary name's ending (for writers that add or expect one, such as ``.npy``).
    ``replace(tmp, path)``: how it takes the place of ``path`` (default :func:`os.replace`); a caller that may lose
    a race to another process (a folder cannot replace a non-empty folder) passes its own. Whatever is left at the
    temporary path afterwards is deleted. The parent folder is created when missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        (replace or os.replace)(tmp, path)
    finally:
        if os.path.lexists(tmp):
            _unlink_quietly(tmp)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (the platform's default encoding, as :func:`open` does) so that readers see the old or the
    new content, never a half-written file (flushed and fsync'ed before the rename)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())


def atomic_write_json(path: str | Path, data: Any) -> None:
    """``data`` as indented JSON (keys in insertion order, NaN and infinities allowed) plus a final newline,
    written with :func:`atomic_write_text`."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, allow_nan=True) + "\n")


def read_jsonl(path: str | Path) -> list[Any]:
    """The objects of an append-only JSONL log (one JSON document per line), in file order; ``[]`` when the file
    does not exist.

    A last line without its newline (a write cut short by a killed process) is skipped. A line that is not valid
    JSON, an empty line included, ends the reading: that line and every line after it are ignored (no error), as
    if the log ended there.
    """
    path = Path(path)
    out: list[Any] = []
    if not path.exists():
        return out
    with open(path) as fh:
        for line in fh:
            if not line.endswith("\n"):
                break  # torn write at the end of the file
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


__all__ = ["atomic_path", "atomic_write_json", "atomic_write_text", "read_jsonl"]
