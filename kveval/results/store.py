"""Run folders: the results contract of DESIGN.md section 4.

``results/<run>/`` holds ``config.resolved.yaml``, ``env.json``, ``records.jsonl`` (one JSON object per unit of
work, appended and flushed as it completes) and ``metrics.json`` (aggregates, written atomically). A rerun of the
same config resumes: units whose key is already in ``records.jsonl`` are skipped. A different config aimed at the
same folder is refused unless ``overwrite=True``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from kveval.errors import KvevalError

CONFIG_FILE = "config.resolved.yaml"
ENV_FILE = "env.json"
RECORDS_FILE = "records.jsonl"
METRICS_FILE = "metrics.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file so that readers see the old or the new content, never a half-written one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, allow_nan=True) + "\n")


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
        "threads": torch.get_num_threads(),
        "argv": sys.argv,
    }
    return env


def record_key(rec: dict) -> str:
    """The identity of a unit of work inside a run: its ``key`` field."""
    return rec["key"]


class RunDir:
    """One results folder. ``open`` creates it or checks that it belongs to the same config (resume)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def check(cls, path: Path, resolved_config: dict, *, overwrite: bool = False) -> bool:
        """Whether ``path`` holds a run of another config (True: it will be replaced; only with ``overwrite``)."""
        config_path = Path(path) / CONFIG_FILE
        if not config_path.exists():
            return False
        same = yaml.safe_load(config_path.read_text()) == yaml.safe_load(yaml.safe_dump(resolved_config, sort_keys=False))
        if not same and not overwrite:
            raise KvevalError(
                f"{path} holds a run of a different config; rerun with --overwrite to replace it, "
                "or set output: to another folder"
            )
        return not same

    @classmethod
    def open(cls, path: Path, resolved_config: dict, *, overwrite: bool = False) -> RunDir:
        """Create the folder, or reuse it for the same config (resume); replace another config's only with overwrite."""
        run = cls(path)
        config_path = run.path / CONFIG_FILE
        text = yaml.safe_dump(resolved_config, sort_keys=False)
        if cls.check(path, resolved_config, overwrite=overwrite):
            shutil.rmtree(run.path)
        run.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(config_path, text)
        return run

    # --- records ------------------------------------------------------------------------------------------------
    @property
    def records_path(self) -> Path:
        return self.path / RECORDS_FILE

    def records(self) -> list[dict]:
        """Every complete record; a line cut short by a killed process (the last one) is ignored."""
        if not self.records_path.exists():
            return []
        out = []
        with open(self.records_path) as fh:
            for line in fh:
                if not line.endswith("\n"):
                    break  # torn write at the end of the file
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        return out

    def done_keys(self) -> set[str]:
        return {record_key(r) for r in self.records()}

    def repair(self) -> None:
        """Cut a torn last line left by a killed process, so that appends start on a fresh line."""
        if not self.records_path.exists():
            return
        data = self.records_path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data[: data.rfind(b"\n") + 1]
            self.records_path.write_bytes(keep)

    def append(self, record: dict) -> None:
        """Append one record and flush it to disk before returning."""
        line = json.dumps(record, allow_nan=True) + "\n"
        with open(self.records_path, "a") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    # --- aggregates ---------------------------------------------------------------------------------------------
    def write_env(self, env: dict, *, started: datetime, finished: datetime | None = None) -> None:
        env = dict(env)
        env["started"] = started.isoformat()
        env["finished"] = finished.isoformat() if finished else None
        atomic_write_json(self.path / ENV_FILE, env)

    def write_metrics(self, metrics: dict) -> None:
        atomic_write_json(self.path / METRICS_FILE, metrics)

    def metrics(self) -> dict:
        return read_metrics(self.path)


def now() -> datetime:
    return datetime.now(timezone.utc)


def read_metrics(run_dir: Path) -> dict:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise KvevalError(f"{path} does not exist; is {run_dir} a kveval results folder?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise KvevalError(f"{path} is not valid JSON (line {exc.lineno}); rerun the config to rebuild it") from None
