"""Run folders while a run writes them: the writing side of the results contract (docs/design.md section 4).

``results/<run>/`` holds ``config.resolved.yaml``, ``env.json``, ``records.jsonl`` (one JSON object per unit of
work, appended and flushed as it completes) and ``metrics.json`` (aggregates, written atomically); the names and
what each file holds are in :mod:`kveval.results.layout`, the reading side in :mod:`kveval.results.read`. A
rerun of the same config resumes: units whose key is already in ``records.jsonl`` are skipped. A different config
aimed at the same folder is refused unless ``overwrite=True``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import yaml

from kveval.errors import KvevalError
from kveval.fileio import atomic_write_json, atomic_write_text, read_jsonl
from kveval.results.layout import CONFIG_FILE, ENV_FILE, METRICS_FILE, RECORDS_FILE


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
        """Every complete record, in order (:func:`kveval.fileio.read_jsonl`: a line cut short by a killed process,
        the last one, is ignored; reading stops at a line that is not JSON)."""
        return read_jsonl(self.records_path)

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
        """``metrics.json`` (:func:`kveval.results.read.read_metrics`: a missing or corrupt file is a one-line
        KvevalError)."""
        from kveval.results.read import read_metrics  # the reading side (pandas) only when asked

        return read_metrics(self.path)


def now() -> datetime:
    return datetime.now(timezone.utc)
