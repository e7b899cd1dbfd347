"""One owner per folder: the lock that a kveval process holds on a run folder (or a report folder) while it writes.

    with lock_folder("results/int4_g64", command="kveval run configs/int4_g64.yaml") as lock:
        ...                       # a second process asking for the same folder gets a one-line KvevalError
    lock.stale                    # the holder record left by a process that died holding it (taken over), or None

The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<folder>/.kveval.lock`` (:data:`~kveval.results.layout.LOCK_FILE`).
The kernel drops it when its holder exits, however it exits (SIGKILL and crashes included), so a lock file left
behind by a dead process is never an obstacle: the next process takes it over and reports the dead holder as
:attr:`FolderLock.stale`. While held, the file holds one JSON line naming the holder::

    {"pid": 4242, "host": "gpu-07", "command": "kveval run configs/int4_g64.yaml", "started": "2025-...+00:00"}

which is what a refused process prints. On release the file is removed. The folder (and its missing parents) is
created when missing; what this process created and leaves empty (a run refused by a later check) is removed again.

The lock is re-entrant inside one process (``kveval run`` holds its folder and writes its report into it) and not
across processes, forked children included. The lock file is opened with ``O_NOFOLLOW``: a symbolic link there is
refused, never followed. Standard library only; POSIX (on a platform without ``fcntl`` nothing is locked).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kveval.errors import KvevalError
from kveval.fileio import O_NOFOLLOW
from kveval.results.layout import LOCK_FILE

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


@dataclass
class _Held:
    lock: FolderLock
    count: int
    pid: int


#: The folders this process holds, by (device, inode) of the folder: re-entrancy.
_HELD: dict[tuple[int, int], _Held] = {}


def _holder_words(info: dict | None) -> str:
    """``pid 4242 on gpu-07 since 2025-...: kveval run c.yaml`` from a lock file's record (what is known of it)."""
    if not isinstance(info, dict) or not info:
        return "a kveval process that has not yet written its name"
    parts = []
    if info.get("pid") is not None:
        parts.append(f"pid {info['pid']}")
    if info.get("host"):
        parts.append(f"on {info['host']}")
    if info.get("started"):
        parts.append(f"since {info['started']}")
    words = " ".join(parts) or "an unnamed kveval process"
    if info.get("command"):
        words += f": {info['command']}"
    return words


def _read_record(fd: int) -> dict | None:
    """The holder record in an open lock file: a dict, ``{}`` for an empty file, None when unreadable."""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, min(size, 1 << 16), 0) if size else b""
    except OSError:
        return None
    if not data.strip():
        return {}
    try:
        info = json.loads(data.decode("utf-8", "replace"))
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


class FolderLock:
    """The lock of one folder (see the module's docstring). ``acquire`` / ``release``, or use :func:`lock_folder`.

    Attributes: ``folder``; ``path`` (the lock file); ``record`` (what this process wrote in it); ``stale`` (the
    record of a previous holder that died holding the lock, or None); ``created`` (the folders this process
    created for it, deepest first; removed again on release when left empty).
    """

    def __init__(self, folder: str | os.PathLike[str], command: str | None = None, *,
                 hint: str = "set output: to another folder"):
        self.folder = Path(folder)
        self.hint = hint
        self.path = self.folder / LOCK_FILE
        self.record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                       "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self.stale: dict | None = None
        self.created: list[Path] = []
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None

    # --- acquiring ----------------------------------------------------------------------------------------------
    def _make_folder(self) -> None:
        if os.path.lexists(self.folder) and not self.folder.is_dir():
            raise KvevalError(f"{self.folder} is a file, not a folder; {self.hint}")
        if self.folder.is_dir():
            return
        missing, p = [], self.folder
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            self.folder.mkdir(parents=True)
            self.created = missing  # deepest first: what release removes again when it is left empty
        except FileExistsError:
            if not self.folder.is_dir():
                raise KvevalError(f"{self.folder} is a file, not a folder; {self.hint}") from None
        except OSError as exc:
            raise KvevalError(f"cannot create the folder {self.folder}: {exc.strerror or exc}; {self.hint}") from None

    def _open(self) -> int | None:
        """Open (create) the lock file; None when the folder vanished meanwhile (retry)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise KvevalError(f"{self.path} is a symbolic link; kveval never writes through links in a run "
                                  "folder: remove it") from None
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise KvevalError(f"cannot write in {self.folder} ({exc.strerror}); make it writable, or "
                                  f"{self.hint}") from None
            raise KvevalError(f"cannot create the lock file {self.path}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise KvevalError(f"{self.path} is not a regular file; remove it")
        return fd

    def acquire(self) -> FolderLock:
        """Take the lock (creating the folder when missing), or raise a one-line :class:`KvevalError` naming the
        holder. Re-entrant within this process."""
        self._make_folder()
        fst = os.stat(self.folder)
        key = (fst.st_dev, fst.st_ino)
        held = _HELD.get(key)
        if held is not None and held.pid == os.getpid():
            held.count += 1
            self._key = key
            return self
        try:
            fd = self._lock_file()
        except BaseException:
            self._remove_created()
            raise
        fst = os.stat(self.folder)  # the folder may have been made again meanwhile
        key = (fst.st_dev, fst.st_ino)
        previous = _read_record(fd)
        if previous:
            self.stale = previous
        try:
            data = (json.dumps(self.record) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            self._remove_created()
            raise KvevalError(f"cannot write in {self.folder} ({exc.strerror or exc}); make it writable, or "
                              f"{self.hint}") from None
        self._fd = fd
        self._key = key
        _HELD[key] = _Held(self, 1, os.getpid())
        return self

    def _lock_file(self) -> int:
        """Open and flock the lock file (retrying when its previous holder removed it meanwhile); the descriptor."""
        for _ in range(50):
            fd = self._open()
            if fd is None:  # the previous holder removed the folder it had created: make it again
                self._make_folder()
                continue
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    info = _read_record(fd)
                    os.close(fd)
                    if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                        raise KvevalError(f"{self.folder} is in use by another kveval process "
                                          f"({_holder_words(info)}); wait for it to finish, or "
                                          f"{self.hint}") from None
                    raise KvevalError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
            try:  # the file we locked must still be the one at the path (its holder may have removed it)
                now = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)
                continue
            mine = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            return fd
        raise KvevalError(f"cannot lock {self.path}: it keeps being replaced; is another kveval looping on it?")

    def _remove_created(self) -> None:
        """Remove the folders this process created for the lock, deepest first, as far as they are empty."""
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:
                break
        self.created = []

    # --- releasing ----------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Give the lock back: remove the lock file, drop the lock, and remove the folder when this process created
        it and it is empty. A no-op when not held; an inner re-entrant release only counts down."""
        key = self._key
        if key is None:
            return
        self._key = None
        held = _HELD.get(key)
        if held is None or held.pid != os.getpid():
            return
        if held.lock is not self or held.count > 1:
            held.count -= 1
            if held.count == 0:  # pragma: no cover - the outer lock released before an inner one
                held.lock._key = key
                held.lock.release()
            return
        del _HELD[key]
        fd, self._fd = self._fd, None
        if fd is None:  # pragma: no cover
            return
        try:
            try:
                now = os.stat(self.path, follow_symlinks=False)
                mine = os.fstat(fd)
                if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                    os.unlink(self.path)
            except OSError:
                pass
        finally:
            os.close(fd)
        self._remove_created()  # only when empty: a refused run leaves no trace

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def lock_folder(folder: str | os.PathLike[str], command: str | None = None, *,
                hint: str = "set output: to another folder") -> Iterator[FolderLock]:
    """Hold the lock of ``folder`` for the block (see :class:`FolderLock`); released however the block ends.
    ``hint``: what a refused user can do instead, the end of every refusal's line."""
    lock = FolderLock(folder, command, hint=hint).acquire()
    try:
        yield lock
    finally:
        lock.release()


def holder(folder: str | os.PathLike[str]) -> dict | None:
    """The record of the process that holds ``folder``'s lock now, or None when nobody does (a lock file left by a
    dead process is not held). For messages and tests; taking the lock is :func:`lock_folder`."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW)
    except OSError:
        return None
    try:
        if fcntl is None:  # pragma: no cover
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _read_record(fd) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


__all__ = ["FolderLock", "holder", "lock_folder"]
