"""Run folders while a run writes them: the writing side of the results contract (docs/design.md section 4).

``results/<run>/`` holds ``config.resolved.yaml``, ``env.json``, ``records.jsonl`` (one JSON object per unit of
work, appended and flushed as it completes) and ``metrics.json`` (aggregates, written atomically); the names and
what each file holds are in :mod:`kveval.results.layout`, the reading side in :mod:`kveval.results.read`. A
rerun of the same config resumes: units whose key is already in ``records.jsonl`` are skipped. A different config
aimed at the same folder is refused unless ``overwrite=True``.

The rules that keep a folder's records whole (the caller holds the folder's lock, :mod:`kveval.results.lock`):

* Ownership: kveval writes only into a new or empty folder, a folder it made (the marker
  :data:`~kveval.results.layout.MARKER_FILE`) or a run folder of an older kveval (nothing but kveval's own file
  names); ``overwrite`` removes only kveval's own files there, and only once every check has passed
  (:mod:`kveval.results.checks`, read only; :meth:`RunDir.open` is the last step before work).
* Reading: every complete record counts once, the first of each key (:meth:`RunDir.records`); a line that is
  not JSON, or not an object with a string ``key``, is skipped with a warning and the later lines still count.
* Writing: records are appended whole, after a torn last line is cut (so a new record never glues onto it), and
  never through a symbolic link; the other files are replaced atomically.
* Scope: a task sees the run through a :class:`TaskRecords` view: only the records of keys it looks up or appends
  count for it (a window or trial the config does not have never reaches its metrics), and a second task of the
  same kind in one config gets its own key prefix (``tasks[i]/``, :func:`task_label`).
* Tokens: the marker records the hash of the corpus token ids the records were computed on; a resume on other
  token ids is refused (:meth:`RunDir.check_tokens`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Set
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from kveval.errors import KvevalError
from kveval.fileio import (
    append_line,
    atomic_write_json,
    atomic_write_text,
    end_with_newline,
    open_regular,
    scan_jsonl,
)
from kveval.results.checks import (
    check_folder,
    check_inputs_unchanged,
    check_tokens,
    is_own_name,
    not_regular,
    read_marker,
)
from kveval.results.checks import folder_kind as folder_kind  # re-exported (kveval.commands.calibrate)
from kveval.results.layout import (
    CONFIG_FILE,
    ENV_FILE,
    LOCK_FILE,
    MARKER_FILE,
    METRICS_FILE,
    RECORDS_FILE,
)

#: The marker's format version.
MARKER_FORMAT = 1


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str = "cpu") -> dict:
    """Versions, device and threads: enough to tell two machines' runs apart."""
    import torch
    import transformers

    import kveval

    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kveval": kveval.__version__,
        "git_commit": _git_commit(),
        "device": device,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu": cpu_model(),
        "cpu_capability": cpu_capability(),
        "threads": torch.get_num_threads(),
        "argv": sys.argv,
    }
    outside = untested_dependencies()
    if outside:
        env["untested_dependencies"] = outside
    return env


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``, else ``platform.processor()``), None when
    neither says: two machines whose CPUs differ may round differently (docs/findings.md)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_capability() -> str | None:
    """The vector instruction set torch's CPU kernels dispatch to (``torch.backends.cpu.get_cpu_capability()``:
    ``AVX512``, ``AVX2``, ``DEFAULT``...; ``ATEN_CPU_CAPABILITY`` lowers it): the kernels' summation order, and so
    their rounding, depends on it."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return None


def untested_dependencies(requirements: list[str] | None = None) -> list[str]:
    """Installed packages outside kveval's own requirements (its metadata's, extras aside), one line each, e.g.
    ``transformers 5.26.0 is outside kveval's tested range >=5.0,<5.26``: kveval subclasses transformers' cache
    layers, which change between minor releases, so a release beyond the bound may give wrong numbers without an
    error. ``requirements``: requirement strings to check instead of kveval's installed metadata (kveval not
    installed, run from a source tree: nothing to check, [])."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    if requirements is None:
        try:
            requirements = metadata.requires("kveval") or []
        except metadata.PackageNotFoundError:  # run from a source tree that was never installed
            return []
    out = []
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or another Python's
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue  # missing packages fail at import with their own message
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name} {have} is outside kveval's tested range {req.specifier}")
    return out


def record_key(rec: dict) -> str:
    """The identity of a unit of work inside a run: its ``key`` field."""
    return rec["key"]


def _warn_stderr(message: str) -> None:
    print(f"kveval: warning: {message}", file=sys.stderr)


def tokens_digest(token_ids: Any) -> dict:
    """``{"sha256", "count"}`` of a sequence of token ids (a 1-D torch tensor, a numpy array or a list), hashed as
    little-endian int64: what the marker records, so that a resume on another corpus is caught."""
    if hasattr(token_ids, "detach"):
        token_ids = token_ids.detach().cpu().numpy()
    import numpy as np

    arr = np.ascontiguousarray(np.asarray(token_ids, dtype="<i8").reshape(-1))
    return {"sha256": hashlib.sha256(arr.tobytes()).hexdigest(), "count": int(arr.size)}


def input_digests(files: dict[str, str]) -> dict:
    """``{label: {"path", "sha256", "bytes"}}`` of the input files a run reads (``files``: ``{label: path}``, from
    :func:`kveval.config.input_files`), read in 1 MiB blocks: what the marker records, so that a resume on an
    input edited in place is refused (:func:`~kveval.results.checks.check_inputs_unchanged`). KvevalError (one
    line) for a file that cannot be read."""
    out = {}
    for label, path in files.items():
        h, size = hashlib.sha256(), 0
        try:
            with open_regular(path) as f:
                while block := f.read(1 << 20):
                    h.update(block)
                    size += len(block)
        except (OSError, KvevalError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise KvevalError(f"{label} '{path}' cannot be read ({reason})") from None
        out[label] = {"path": str(path), "sha256": h.hexdigest(), "bytes": size}
    return out


class RunDir:
    """One results folder. ``check`` says whether a config may use it, ``open`` makes it ready to append to.

    The caller holds the folder's lock (:func:`kveval.results.lock.lock_folder`) from ``check`` to the end of the
    run, so that nothing changes between the checks and the writes. ``warn``: where warnings about damaged records
    go (one line each, once per folder; default: stderr).
    """

    def __init__(self, path: Path, *, warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        self._warn = warn or _warn_stderr
        self._warned: set[str] = set()

    # --- checks (read only: kveval.results.checks) --------------------------------------------------------------
    @classmethod
    def check(cls, path: Path, resolved_config: dict, *, overwrite: bool = False) -> bool:
        """Whether the run folder ``path`` must be started afresh (True: only with ``overwrite``); one-line
        :class:`KvevalError` when this config may not use it (:func:`~kveval.results.checks.check_folder`)."""
        return check_folder(path, resolved_config, overwrite=overwrite)

    @classmethod
    def check_tokens(cls, path: Path, digest: dict) -> None:
        """Refuse to resume ``path`` on other token ids (:func:`~kveval.results.checks.check_tokens`)."""
        check_tokens(path, digest)

    # --- opening (the first write) ------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: Path, resolved_config: dict, *, overwrite: bool = False, reset: bool = False,
             warn: Callable[[str], None] | None = None) -> RunDir:
        """Make ``path`` ready for this config: after :meth:`check` (repeated here), start it afresh when it holds
        another config (only with ``overwrite``) or when ``reset`` (the caller's own reason: changed scales), by
        removing kveval's own files only; mark it as kveval's; write the resolved config; cut a torn last record.
        Call it once every check has passed: it is the first write."""
        run = cls(path, warn=warn)
        text = yaml.safe_dump(resolved_config, sort_keys=False)
        replace = cls.check(path, resolved_config, overwrite=overwrite) or reset
        try:
            run.path.mkdir(parents=True, exist_ok=True)
            if replace:
                run._clear()
            if not_regular(run.path / MARKER_FILE) is None and not (run.path / MARKER_FILE).exists():
                run._write_marker({"format": MARKER_FORMAT, "created": now().isoformat(timespec="seconds"),
                                   "kveval": _version()})
            atomic_write_text(run.path / CONFIG_FILE, text)
            end_with_newline(run.records_path)
        except OSError as exc:
            raise KvevalError(f"cannot write the run folder {run.path}: {exc.strerror or exc}; make it writable, "
                              "or set output: to another folder") from None
        run.records()  # warn now about damaged lines, before the work starts
        return run

    def _clear(self) -> None:
        """Remove kveval's own files (never the user's, never the lock, never the folder itself)."""
        for name in os.listdir(self.path):
            if name == LOCK_FILE or not is_own_name(name):
                continue
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    # --- the marker and the folder's state ---------------------------------------------------------------------
    def marker(self) -> dict:
        """The marker's content (``{}`` when absent or unreadable)."""
        return read_marker(self.path)

    def _write_marker(self, data: dict) -> None:
        atomic_write_json(self.path / MARKER_FILE, data)

    def record_tokens(self, digest: dict) -> None:
        """Check (:meth:`check_tokens`) and remember the token ids the records are computed on. A folder whose
        records predate the hash adopts it, with a warning."""
        self.check_tokens(self.path, digest)
        marker = self.marker()
        if marker.get("tokens") == digest:
            return
        if not isinstance(marker.get("tokens"), dict) and self.records():
            self._warn_once(f"{self.records_path}: records made before kveval recorded the corpus tokens' hash; "
                            "assuming they were computed on the same corpus")
        marker.setdefault("format", MARKER_FORMAT)
        marker["tokens"] = digest
        try:
            self._write_marker(marker)
        except OSError as exc:
            raise KvevalError(f"cannot write {self.path / MARKER_FILE}: {exc.strerror or exc}") from None

    def record_inputs(self, digests: dict) -> None:
        """Check (:func:`~kveval.results.checks.check_inputs_unchanged`) and remember the digests of the input
        files the records are computed from (:func:`input_digests`), beside those remembered before."""
        check_inputs_unchanged(self.path, digests)
        marker = self.marker()
        before = marker.get("inputs")
        inputs: dict = before if isinstance(before, dict) else {}
        if all(inputs.get(k) == v for k, v in digests.items()) and "inputs" in marker:
            return
        marker.setdefault("format", MARKER_FORMAT)
        marker["inputs"] = {**inputs, **digests}
        try:
            self._write_marker(marker)
        except OSError as exc:
            raise KvevalError(f"cannot write {self.path / MARKER_FILE}: {exc.strerror or exc}") from None

    # --- records ------------------------------------------------------------------------------------------------
    @property
    def records_path(self) -> Path:
        return self.path / RECORDS_FILE

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)

    def records(self) -> list[dict]:
        """Every complete record, once: the first record of each key, in file order.

        Skipped, with one warning each time the set of skipped lines changes: lines that are not JSON (a torn
        last line is silently dropped), documents that are not objects with a string ``key``, and later records
        of a key already seen (a double run of an older kveval). The later lines still count.
        """
        try:
            got = scan_jsonl(self.records_path)
        except OSError as exc:
            raise KvevalError(f"cannot read {self.records_path} ({exc.strerror or exc}); this run folder is "
                              "damaged: rerun with --overwrite to start it afresh") from None
        out: list[dict] = []
        seen: set[str] = set()
        keyless = duplicates = 0
        for doc in got.objects:
            if not isinstance(doc, dict) or not isinstance(doc.get("key"), str):
                keyless += 1
                continue
            if doc["key"] in seen:
                duplicates += 1
                continue
            seen.add(doc["key"])
            out.append(doc)
        if got.bad_lines or keyless:
            lines = got.bad_lines[:5]
            where = f" (line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines))}" + (
                ", ...)" if len(got.bad_lines) > 5 else ")") if lines else ""
            parts = []
            if got.bad_lines:
                parts.append(f"{len(got.bad_lines)} line{'s' if len(got.bad_lines) > 1 else ''} that are not "
                             f"JSON{where}")
            if keyless:
                parts.append(f"{keyless} line{'s' if keyless > 1 else ''} that are not records (no 'key')")
            self._warn_once(f"{self.records_path}: skipped {' and '.join(parts)}; the units they held are "
                            "recomputed")
        if duplicates:
            self._warn_once(f"{self.records_path}: {duplicates} duplicate record{'s' if duplicates > 1 else ''} "
                            "ignored (the first record of each key counts)")
        return out

    def done_keys(self) -> set[str]:
        """The keys of every complete record."""
        return {record_key(r) for r in self.records()}

    def repair(self) -> None:
        """Make the log end on a line boundary, so that appends start on a fresh line: a torn last line left by a
        killed process is cut, a complete one that lost its newline gets it back (:meth:`open` does this)."""
        try:
            end_with_newline(self.records_path)
        except OSError as exc:
            raise KvevalError(f"cannot repair {self.records_path}: {exc.strerror or exc}") from None

    def append(self, record: dict) -> None:
        """Append one record and flush it to disk before returning; never through a symbolic link."""
        try:
            append_line(self.records_path, json.dumps(record, allow_nan=True))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise KvevalError(f"{self.records_path} is a symbolic link; kveval never writes through links "
                                  "in a run folder: replace it with the file it points to") from None
            raise KvevalError(f"cannot append to {self.records_path}: {exc.strerror or exc}") from None

    def task_view(self, prefix: str = "") -> TaskRecords:
        """The run as one task entry sees it (:class:`TaskRecords`)."""
        return TaskRecords(self, prefix)

    # --- aggregates ---------------------------------------------------------------------------------------------
    def _replace_json(self, name: str, data: dict) -> None:
        try:
            atomic_write_json(self.path / name, data)
        except OSError as exc:
            raise KvevalError(f"cannot write {self.path / name}: {exc.strerror or exc}; the records are safe: fix "
                              "that and rerun the same command to finish") from None

    def worked_before(self) -> dict:
        """What the folder's ``env.json`` says of this run's earlier parts, read before a resumed run rewrites it:
        ``{"first_started": ISO, "seconds": s, "parts": n}`` (an interrupted part counts until its last record);
        ``{}`` for a new folder or an env.json that cannot be read."""
        from kveval.results.read import read_env  # the reading side: a FIFO or corrupt file is a KvevalError

        try:
            env = read_env(self.path)
            started = datetime.fromisoformat(env["started"])
        except (KvevalError, ValueError, KeyError, TypeError, RecursionError):
            return {}
        seconds = env.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 1e9:
            try:
                end = datetime.fromisoformat(env["finished"]) if env.get("finished") else \
                    datetime.fromtimestamp(os.stat(self.records_path).st_mtime, timezone.utc)
            except (OSError, ValueError, TypeError):
                end = started
            seconds = max(0.0, (end - started).total_seconds())
        parts = env.get("parts")
        first = env.get("first_started")
        return {"first_started": first if isinstance(first, str) else started.isoformat(), "seconds": float(seconds),
                "parts": parts if isinstance(parts, int) and not isinstance(parts, bool) and 0 < parts < 10**6 else 1}

    def write_env(self, env: dict, *, started: datetime, finished: datetime | None = None,
                  before: dict | None = None) -> None:
        """``env.json`` with ``started`` and ``finished`` (ISO 8601; None while the run works), atomically; with
        the earlier parts of a resumed run (``before``, :meth:`worked_before`): ``first_started``, ``parts`` and,
        once finished, ``seconds`` (all parts' working time)."""
        env = dict(env)
        env["started"] = started.isoformat()
        env["finished"] = finished.isoformat() if finished else None
        before = before or {}
        env["first_started"] = before.get("first_started", env["started"])
        env["parts"] = before.get("parts", 0) + 1
        if finished is not None:
            env["seconds"] = round(before.get("seconds", 0.0) + (finished - started).total_seconds(), 3)
        self._replace_json(ENV_FILE, env)

    def write_metrics(self, metrics: dict) -> None:
        """``metrics.json``, atomically."""
        self._replace_json(METRICS_FILE, metrics)

    def metrics(self) -> dict:
        """``metrics.json`` (:func:`kveval.results.read.read_metrics`: a missing or corrupt file is a one-line
        KvevalError)."""
        from kveval.results.read import read_metrics  # the reading side (pandas) only when asked

        return read_metrics(self.path)


def task_label(kinds: Iterable[str], index: int) -> str:
    """What tells task entry ``index`` apart from the other entries of its kind in a config whose entries have
    these ``kinds``: ``""`` for the first entry of its kind (its records keep bare keys and its metrics the top
    level of ``metrics.json``, as in run folders made before labels), ``"tasks[i]"`` for a later entry of the
    same kind (its records are keyed ``tasks[i]/...`` and its metrics go under ``metrics["tasks"]["tasks[i]"]``,
    so that two perplexity tasks in one config share neither keys nor fields)."""
    kinds = list(kinds)
    return f"tasks[{index}]" if kinds[index] in kinds[:index] else ""


class _LookedUp(Set[str]):
    """The recorded keys of one task entry; every ``key in done`` marks ``key`` as expected by the task."""

    def __init__(self, view: TaskRecords, stored: set[str]):
        self._view = view
        self._stored = stored

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        self._view.expected.add(key)
        found = self._view.prefix + key in self._stored
        self._view.resumed = self._view.resumed or found
        return found

    def __iter__(self) -> Iterator[str]:
        n = len(self._view.prefix)
        return iter(sorted(k[n:] for k in self._stored if k.startswith(self._view.prefix)))

    def __len__(self) -> int:
        return sum(1 for k in self._stored if k.startswith(self._view.prefix))

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> frozenset[Any]:  # set operators (done | x) give plain sets
        return frozenset(it)


class TaskRecords:
    """A run folder as one task entry sees it (``ctx.run`` inside a task's ``run``): ``done_keys``, ``append``,
    ``records``, with the entry's key prefix added and removed out of the task's sight.

    Which records count for the task: those of the keys it expects, and a task expects exactly the keys it looks up
    in ``done_keys()`` (``key in done``, which every task does for every unit of its grid before computing or
    skipping it) or appends. A record of a window, trial or cell that the config does not have (another config's,
    a hand-edited line) is never looked up, so it never reaches the task's aggregate.
    """

    def __init__(self, run: RunDir, prefix: str = ""):
        self.run = run
        self.prefix = prefix
        self.expected: set[str] = set()
        self.resumed = False  # whether the task found any of its keys already recorded

    @property
    def path(self) -> Path:
        return self.run.path

    @property
    def records_path(self) -> Path:
        return self.run.records_path

    def done_keys(self) -> Set[str]:
        """The task's recorded keys (without the prefix); a lookup marks a key as expected."""
        return _LookedUp(self, self.run.done_keys())

    def append(self, record: dict) -> None:
        """Append ``record`` under the entry's prefix (its ``key`` as the task sees it is expected from now on)."""
        self.expected.add(record["key"])
        self.run.append({**record, "key": self.prefix + record["key"]} if self.prefix else record)

    def records(self) -> list[dict]:
        """The first complete record of each expected key, in file order, keys without the prefix."""
        n = len(self.prefix)
        out = []
        for rec in self.run.records():
            key = rec["key"]
            if key.startswith(self.prefix) and key[n:] in self.expected:
                out.append({**rec, "key": key[n:]} if n else rec)
        return out


def _version() -> str | None:
    import kveval

    return getattr(kveval, "__version__", None)


def now() -> datetime:
    return datetime.now(timezone.utc)
