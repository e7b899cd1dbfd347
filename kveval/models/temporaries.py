"""Temporary folders of processes that died: what a model conversion (and a device map's disk offload) leaves
behind when its process is killed, and how a later load removes it.

A writer names its temporary folder ``.<name>.<random>.pid<N>`` (``kveval.fileio.atomic_path`` with a ``.pid<N>``
suffix) and holds an flock on the file ``<folder>.lock`` beside it while it writes (:func:`holding_lock`); the
kernel drops the lock when the process dies, whatever killed it. :func:`clean_stale_temporaries` removes a folder
whose lock nobody holds at once; a folder without a lock file (an older kveval, an offload folder) when its
process N is gone and nothing in it changed for ``STALE_TEMP_SECONDS``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from kveval.fileio import pid_alive

log = logging.getLogger(__name__)

STALE_TEMP_SECONDS = 600  # a dead process's temporary folder without a lock file, untouched this long, is removed
LEGACY_TEMP_SECONDS = 3600  # a temporary folder of an older kveval (no process id in its name)
LOCK_SUFFIX = ".lock"  # the lock file beside a temporary folder: ``.<name>.<random>.pid<N>.lock``

_TEMP_NAME = re.compile(r"\.(?P<entry>.+-[0-9a-f]{16})\.[A-Za-z0-9_]{8}(?:\.pid(?P<pid>\d+))?")


def _last_change(folder: Path) -> float:
    """The newest modification time of ``folder`` and the files directly in it (a file being written is touched
    continuously)."""
    times = [folder.stat().st_mtime]
    for p in folder.iterdir():
        with contextlib.suppress(OSError):
            times.append(p.stat().st_mtime)
    return max(times)


def _lock_free(lock: Path) -> bool:
    """Whether nobody holds ``lock`` (an flock the kernel dropped when its process died); False when it is held or
    cannot be opened."""
    try:
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


@contextlib.contextmanager
def holding_lock(folder: Path) -> Iterator[None]:
    """Hold the lock file beside the temporary ``folder`` while the block writes it (:func:`clean_stale_temporaries`
    then leaves it alone); the file is removed when the block ends."""
    lock = folder.with_name(folder.name + LOCK_SUFFIX)
    fd = os.open(lock, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def clean_stale_temporaries(models_dir: Path, now: float | None = None) -> list[Path]:
    """Remove the temporary folders that conversions left in ``models_dir`` when their process was killed, and
    return them: ``.<entry>.<random>.pid<N>`` whose lock file (``<name>.lock``) nobody holds, at once; without a
    lock file, when process N is gone and nothing in it changed for ``STALE_TEMP_SECONDS``; a name without
    ``.pid<N>`` (an older kveval) when nothing changed for ``LEGACY_TEMP_SECONDS``. Lock files left without their
    folder are removed too."""
    now = time.time() if now is None else now
    removed = []
    try:
        children = list(models_dir.iterdir())
    except OSError:
        return removed
    for child in children:
        if child.name.endswith(LOCK_SUFFIX) and _TEMP_NAME.fullmatch(child.name[: -len(LOCK_SUFFIX)]):
            if not child.with_name(child.name[: -len(LOCK_SUFFIX)]).exists() and _lock_free(child):
                with contextlib.suppress(FileNotFoundError):
                    child.unlink()
            continue
        m = _TEMP_NAME.fullmatch(child.name)
        if m is None or child.is_symlink() or not child.is_dir():
            continue
        lock = child.with_name(child.name + LOCK_SUFFIX)
        pid = m["pid"]
        try:
            if lock.exists():
                if not _lock_free(lock):
                    continue  # its conversion is still writing it
            elif pid is not None and (pid_alive(int(pid)) or now - _last_change(child) < STALE_TEMP_SECONDS):
                continue
            elif pid is None and now - _last_change(child) < LEGACY_TEMP_SECONDS:
                continue
        except OSError:
            continue  # gone meanwhile
        log.warning("kveval: removing %s, a temporary folder left behind by a process that ended", child)
        shutil.rmtree(child, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        removed.append(child)
    return removed
