"""Crash-safe file primitives shared by every module that writes: atomic replacement, appends that never follow a
symbolic link, and the JSONL log reader.

    atomic_write_json(run / "metrics.json", metrics)       # readers see the old file or the new one, never half
    with atomic_path(scales_path) as tmp:                  # any writer that wants a path (safetensors, numpy...)
        save_file(tensors, str(tmp))
    with atomic_path(entry, folder=True) as tmp: ...       # a whole folder, renamed into place when complete
    append_line(run / "records.jsonl", json.dumps(rec))    # one line, flushed to disk, never through a link
    records = read_jsonl(run / "records.jsonl")            # an append-only log, minus its unreadable lines
    with open_regular(user_path) as fh: ...               # a user's file: a FIFO or device refused, never opened

The temporary file or folder is a hidden sibling of the target (``.<name>.<random>``, same file system, so the
final ``os.replace`` is atomic, and it replaces a symbolic link at the target rather than writing through it); it is
removed when the block raises. It is created with the mode an ordinary ``open`` or ``mkdir`` would give (0666 /
0777 minus the umask: 0644 / 0755 under umask 022), never :func:`tempfile.mkstemp`'s 0600. Standard library only,
in the lowest layer: the data and model caches, scales files, run folders and plan files all write through it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

#: ``os.O_NOFOLLOW`` where the platform has it (every POSIX system); 0 elsewhere.
O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK: int = getattr(os, "O_NONBLOCK", 0)


def _unlink_quietly(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` may still be running (a process of another user, or a number that cannot be asked
    about, counts as running: its files are left alone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process (or a number we cannot ask about): leave its folder alone
    return True


def remove_stale_folders(path: Path) -> list[Path]:
    """Delete the temporary folders of ``path`` written with the writer's pid (``.<name>.<random>.pid<PID>``:
    :func:`atomic_path` with ``folder`` and ``suffix=f".pid{os.getpid()}"``) whose writer is no longer running:
    what a writer killed part-way (SIGKILL, power loss) left behind, which no ``finally`` could remove. A folder of
    a live writer (another process writing the same target) stays. Returns the folders deleted."""
    removed: list[Path] = []
    prefix = f".{path.name}."
    try:
        siblings = list(path.parent.iterdir()) if path.parent.is_dir() else []
    except OSError:
        return removed
    for sib in siblings:
        rest = sib.name[len(prefix):] if sib.name.startswith(prefix) else ""
        token, _, pid = rest.partition(".pid")
        if not (pid.isdigit() and len(token) == 8) or sib.is_symlink() or not sib.is_dir():
            continue
        if int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(sib, ignore_errors=True)
            removed.append(sib)
    return removed


def _fresh_sibling(path: Path, suffix: str, folder: bool) -> Path:
    """Create a new hidden sibling ``.<name>.<random><suffix>`` of ``path`` (an empty file, or an empty folder)
    with the ordinary mode (0666 or 0777 minus the umask) and return it."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}{suffix}"
        try:
            if folder:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


@contextmanager
def atomic_path(path: str | Path, *, folder: bool = False, suffix: str = "",
                replace: Callable[[Path, Path], None] | None = None) -> Iterator[Path]:
    """A fresh temporary sibling of ``path`` to write (an empty file, or with ``folder`` an empty folder); when the
    block ends without an error it takes the place of ``path``, otherwise it is deleted.

    ``suffix``: the temporary name's ending (for writers that add or expect one, such as ``.npy``).
    ``replace(tmp, path)``: how it takes the place of ``path`` (default :func:`os.replace`, which replaces a
    symbolic link at ``path`` instead of writing through it); a caller that may lose a race to another process (a
    folder cannot replace a non-empty folder) passes its own. Whatever is left at the temporary path afterwards is
    deleted. The parent folder is created when missing. The file or folder gets the ordinary mode (0666 / 0777
    minus the umask).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_sibling(path, suffix, folder)
    try:
        yield tmp
        (replace or os.replace)(tmp, path)
    finally:
        if os.path.lexists(tmp):
            _unlink_quietly(tmp)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` so that readers see the old or the new content, never a half-written file (flushed and
    fsync'ed before the rename; a symbolic link at ``path`` is replaced, never followed)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (the platform's default encoding, as :func:`open` does) so that readers see the old or the
    new content, never a half-written file (flushed and fsync'ed before the rename; a symbolic link at ``path``
    is replaced, never followed)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())


def atomic_write_json(path: str | Path, data: Any) -> None:
    """``data`` as indented JSON (keys in insertion order, NaN and infinities allowed) plus a final newline,
    written with :func:`atomic_write_text`."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, allow_nan=True) + "\n")


def open_nofollow(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` and anything but a regular file there.

    Raises :class:`OSError`: ``ELOOP`` for a link (whatever it points to), ``EISDIR`` for a folder, ``EINVAL``
    for another kind of file (a FIFO, a device); the descriptor is closed before raising.
    """
    fd = os.open(path, flags | O_NOFOLLOW | _O_NONBLOCK, mode)  # a FIFO must not block the open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
            raise OSError(code, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


#: what :func:`check_regular` and :func:`open_regular` say of a FIFO, a socket or a device (``OSError.strerror``)
NOT_REGULAR = "not a regular file (a FIFO, socket or device)"


def _refuse_special(mode: int, path: str | Path) -> None:
    if not stat.S_ISREG(mode):
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
        raise OSError(errno.EINVAL, NOT_REGULAR, str(path))


def check_regular(path: str | Path) -> None:
    """Refuse, before anything opens it, a ``path`` that is not a regular file (links followed): ``OSError``
    ``EINVAL`` (:data:`NOT_REGULAR`) for a FIFO, socket or device, which would block the open or stream forever,
    ``IsADirectoryError`` for a folder, ``FileNotFoundError`` when absent. For a path handed to another library
    (safetensors, numpy); kveval's own reads go through :func:`open_regular`."""
    _refuse_special(os.stat(path).st_mode, path)


def open_regular(path: str | Path) -> BinaryIO:
    """``open(path, "rb")`` of a user's file (a config, a sweep file, a corpus, a prompt file, a plan file...),
    links followed, for a regular file only: anything else is refused as :func:`check_regular` refuses it, before
    it is opened, and once more on the open descriptor (opened non-blocking: a file swapped for a FIFO in between
    cannot block the open). The one way kveval opens a file a user names."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _refuse_special(os.fstat(fd).st_mode, path)
        if _O_NONBLOCK:
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | Path) -> bytes:
    """The bytes of a user's regular file (:func:`open_regular`: a FIFO, socket, device or folder is refused with
    ``OSError`` before it is read)."""
    with open_regular(path) as fh:
        return fh.read()


def append_line(path: str | Path, line: str) -> None:
    """Append one line (``line`` plus a newline, UTF-8) to ``path``, created when missing (ordinary mode), and
    flush it to disk before returning. Never follows a symbolic link: a link at ``path`` raises ``OSError``
    (``ELOOP``), as does a folder or a special file (see :func:`open_nofollow`)."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class JsonlRead:
    """What :func:`scan_jsonl` found: ``objects`` (the readable lines' documents, in file order), ``bad_lines``
    (1-based numbers of the complete lines that are not JSON, empty lines included) and ``torn`` (True when the
    file ends with an incomplete last line: bytes without a newline that are not a complete JSON object)."""

    objects: list[Any] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    torn: bool = False


def _loads_line(raw: bytes) -> Any:
    return json.loads(raw.decode("utf-8"))


def scan_jsonl(path: str | Path) -> JsonlRead:
    """Read an append-only JSONL log (one JSON document per line) without stopping at damage.

    A line that is not valid JSON (or not UTF-8), an empty line included, is skipped and its number is listed in
    ``bad_lines``; the lines after it still count. A last line without its newline is the torn tail of a killed
    write (``torn``), unless it is a complete JSON object (a file whose final newline was lost), which counts. An
    absent file reads as empty. A folder or another non-regular file at ``path`` raises :class:`OSError`.
    """
    path = Path(path)
    out = JsonlRead()
    if not os.path.lexists(path):
        return out
    fd = os.open(path, os.O_RDONLY | _O_NONBLOCK)  # reading may follow a link; a FIFO must not block
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
            raise OSError(code, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                try:
                    doc = _loads_line(raw)
                except ValueError:
                    doc = None
                if isinstance(doc, dict):
                    out.objects.append(doc)
                else:
                    out.torn = True
                break
            try:
                out.objects.append(_loads_line(raw))
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                out.bad_lines.append(number)
    return out


def read_jsonl(path: str | Path) -> list[Any]:
    """The documents of an append-only JSONL log, in file order; ``[]`` when the file does not exist.

    Damage does not hide what follows it: a line that is not valid JSON in the middle is skipped and the later
    lines still count; a torn last line (a write cut short by a killed process) is skipped (:func:`scan_jsonl`
    says exactly what is skipped and reports it).
    """
    return scan_jsonl(path).objects


def end_with_newline(path: str | Path) -> bool:
    """Make an append-only log end on a line boundary before more lines are appended, so that a new line is never
    glued to a torn one: a torn last line (not a complete JSON object) is cut off, a complete one that lost its
    newline gets it back. Never follows a symbolic link (``OSError`` ``ELOOP``). Returns True when the file
    changed; an absent file is left absent."""
    if not os.path.lexists(path):
        return False
    fd = open_nofollow(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return False
        if os.pread(fd, 1, size - 1) == b"\n":
            return False
        start = max(0, size - (1 << 16))
        tail = os.pread(fd, size - start, start)
        while b"\n" not in tail and start > 0:  # a very long last line: read further back
            start = max(0, start - (1 << 20))
            tail = os.pread(fd, size - start, start)
        cut = start + tail.rfind(b"\n") + 1  # 0 when the file has no newline at all
        last = os.pread(fd, size - cut, cut)
        try:
            complete = isinstance(_loads_line(last), dict)
        except ValueError:
            complete = False
        if complete:
            os.lseek(fd, 0, os.SEEK_END)
            os.write(fd, b"\n")
        else:
            os.ftruncate(fd, cut)
        os.fsync(fd)
        return True
    finally:
        os.close(fd)


__all__ = ["NOT_REGULAR", "JsonlRead", "O_NOFOLLOW", "append_line", "atomic_path", "atomic_write_bytes",
           "atomic_write_json", "atomic_write_text", "check_regular", "end_with_newline", "open_nofollow",
           "open_regular", "read_jsonl", "read_regular_bytes", "scan_jsonl"]
