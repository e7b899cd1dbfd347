"""Read a results folder into pandas: the reading side of the results contract, the API of the notebooks, of the
report and of ``kveval plan`` (file names and what each holds: :mod:`kveval.results.layout`).

    from kveval.results import load
    res = load("results/int4_g64")
    res.summary            # one row per policy, the baseline first
    res.positions          # loss / KLD by token position bin, long format
    res.layers             # per-layer K/V quantization error, one row per (policy, layer)
    res.records            # records.jsonl as a DataFrame (one row per unit of work)

The raw documents: :func:`read_metrics`, :func:`read_config`, :func:`read_env`, :func:`read_records`. Only the
documented files are read (``metrics.json``, ``config.resolved.yaml``, ``env.json``, ``records.jsonl``), so old
runs and runs from other machines load alike; what a run did not measure is absent (an empty frame, or NaN in a
column), never an error. The memory columns of runs that predate them are computed from the resolved config with
:mod:`kveval.memory` (pure arithmetic) when the model's shape is known.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from kveval.errors import KvevalError
from kveval.fileio import scan_jsonl
from kveval.results.layout import (
    BASELINE,
    CONFIG_FILE,
    ENV_FILE,
    MARKER_FILE,
    METRICS_FILE,
    RECORDS_FILE,
    TASK_ENTRIES,
)

log = logging.getLogger(__name__)
#: what reading an old or foreign run's policy or shape back can raise: a config line (KvevalError), a spec
#: (ValueError), a field of the wrong type or missing (TypeError, KeyError)
CONFIG_ERRORS = (KvevalError, ValueError, TypeError, KeyError)


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__

#: Columns of ``RunResults.summary`` every run has (NaN where it did not measure them): the quality columns, then
#: (after the columns the tasks' reporting plug-ins add: :func:`summary_columns`) the cost and bookkeeping ones.
QUALITY_COLUMNS = ["run", "policy", "spec", "ppl", "delta_ppl", "delta_ppl_pct", "kld_mean", "kld_ci95_lo",
                   "kld_ci95_hi", "top1_agree"]
COST_COLUMNS = ["bytes_per_token", "compression_vs_fp16", "bits_per_element", "max_batch", "key_rel_mse_mean",
                "value_rel_mse_mean", "noise_floor_ppl_pct", "noise_floor_kld", "tokens", "verdict"]
SUMMARY_COLUMNS = [*QUALITY_COLUMNS, *COST_COLUMNS]
POSITION_COLUMNS = ["run", "policy", "bin", "start", "end", "center", "loss", "delta_loss", "kld"]
MEMORY_COLUMNS = ["run", "policy", "context", "codes", "scales", "residual", "total", "bytes_per_token"]
#: Columns of ``RunResults.task_entries`` (before the tasks' own): the summary columns of a later task entry of a
#: kind already in the config, with the entry's label (``tasks[1]``) and kind.
TASK_ENTRY_COLUMNS = ["run", "task", "kind", *SUMMARY_COLUMNS[1:]]

#: a task's tables of one run: ``(run name, metrics.json) -> {table name: DataFrame}`` (``RunResults.tables``)
TaskTables = Callable[[str, dict], "dict[str, pd.DataFrame]"]


def summary_columns(task_columns: Sequence[str] = ()) -> list[str]:
    """The summary's columns with the tasks' own (``task_columns``) between the quality and the cost columns."""
    return [*QUALITY_COLUMNS, *[c for c in task_columns if c not in SUMMARY_COLUMNS], *COST_COLUMNS]


def task_entry_columns(task_columns: Sequence[str] = ()) -> list[str]:
    """``RunResults.task_entries``'s columns: the entry's label and kind, then the summary's."""
    return ["run", "task", "kind", *summary_columns(task_columns)[1:]]


@dataclass
class RunResults:
    """One results folder, loaded.

    Attributes (every DataFrame has a ``run`` column, the run's name, so that frames of several runs concatenate):

    * ``path``: the folder; ``name``: the run's name (``metrics["run"]``, else the folder name).
    * ``summary``: one row per policy, ``baseline`` first; columns ``SUMMARY_COLUMNS``: ``spec`` (the policy in
      words), ``ppl``, ``delta_ppl``, ``delta_ppl_pct`` (100 * (PPL / PPL_fp - 1)), ``kld_mean`` and its 95%
      bootstrap CI ``kld_ci95_lo/hi`` (nats per token), ``top1_agree`` (fraction of tokens whose argmax matches the
      baseline), the tasks' own columns (``needle_accuracy``...: their reporting plug-ins,
      :mod:`kveval.report.sections`), ``bytes_per_token`` (KV bytes per token of one sequence, all layers, K and V,
      scales included), ``compression_vs_fp16``, ``bits_per_element``, ``max_batch``, ``key/value_rel_mse_mean``,
      ``noise_floor_*``, ``tokens`` (tokens evaluated) and ``verdict`` ("pass" | "fail" | "within_noise"; empty
      for the baseline).
    * ``positions``: long format, one row per (policy, position bin): ``bin``, ``start``/``end`` (token positions,
      end exclusive), ``center``, ``loss`` (mean NLL, nats/token), ``delta_loss`` (minus the baseline's), ``kld``.
    * ``layers``: one row per (policy, layer): ``layer`` and the ``key_*`` / ``value_*`` error columns of
      ``layer_errors`` (``*_rel_mse``, ``*_sqnr_db``, ``*_max_abs_err``, ``*_outlier_channels``, ``*_outlier_ratio``).
    * ``tables``: the tasks' own tables, by name (given by the tasks' reporting plug-ins when loaded through
      :func:`kveval.report.load`; each also reads as an attribute: ``res.needle``, ``res.ruler``,
      ``res.sensitivity``; their columns are in each task's ``reporting.py``), empty frames when the run has none.
    * ``memory``: the memory bill per policy at ``context`` tokens, bytes of ``codes``, ``scales`` (zero points
      included) and ``residual`` (full precision), when the model's shape is known, else empty.
    * ``records``: ``records.jsonl`` as a DataFrame; ``config``, ``env``, ``metrics``, ``marker`` (the run
      folder's ``.kveval-run.json``: the digests of what it read): the raw documents.
    * ``task_entries``: the later entries of a kind already in the config (a second perplexity task: its metrics
      are under ``metrics["tasks"]["tasks[1]"]``, never mixed with the first's), one row per (entry, policy) with
      the columns of ``summary`` plus ``task`` (the label, ``tasks[1]``) and ``kind`` (``TASK_ENTRY_COLUMNS``);
      empty when the config has one entry per kind. The first entry of each kind is ``summary``.
    """

    path: Path
    name: str
    metrics: dict
    config: dict
    env: dict
    summary: pd.DataFrame
    positions: pd.DataFrame
    layers: pd.DataFrame
    memory: pd.DataFrame
    records: pd.DataFrame = field(repr=False)
    marker: dict = field(default_factory=dict, repr=False)
    task_entries: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=TASK_ENTRY_COLUMNS), repr=False)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> pd.DataFrame:
        """A task's table by name (``res.needle``: ``res.tables["needle"]``)."""
        tables = self.__dict__.get("tables") or {}
        if name in tables:
            return tables[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or task table {name!r}")

    def frames(self) -> list[pd.DataFrame]:
        """Every frame of the run that has a ``run`` column (the report renames a run through them)."""
        return [self.summary, self.positions, self.layers, self.memory, self.task_entries, *self.tables.values()]

    @property
    def policies(self) -> list[str]:
        """Policy names in the order of ``metrics.json`` (the baseline excluded)."""
        return list(self.metrics.get("policies", {}))

    @property
    def threshold(self) -> dict:
        """``{"delta_ppl_pct": float | None, "kld": float | None}`` from the resolved config."""
        thr = self.config.get("threshold") or {}
        return {"delta_ppl_pct": thr.get("delta_ppl_pct"), "kld": thr.get("kld")}

    def policy_config(self, name: str) -> Any:
        """The policy's config form (``kv.policies.NAME``), or None."""
        return ((self.config.get("kv") or {}).get("policies") or {}).get(name)

    def task_params(self, kind: str) -> list[dict]:
        """The parameters of every ``kind`` task (``"needle"``, ``"sensitivity"``...) of the resolved config, in
        the config's order; ``[]`` when the run had none."""
        return [entry[kind] for entry in self.config.get("tasks") or []
                if isinstance(entry, dict) and isinstance(entry.get(kind), dict)]


def _read_text(path: Path, what: str) -> str:
    """The text of a run folder's file; a folder, a special file, unreadable bytes or an I/O error there is a
    one-line :class:`KvevalError` naming the file (``what``: what to do about it)."""
    try:
        if not path.is_file():
            raise KvevalError(f"{path} is not a file; {what}")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvevalError(f"{path} is not text (not UTF-8); {what}") from None
    except OSError as exc:
        raise KvevalError(f"cannot read {path} ({exc.strerror or exc}); {what}") from None


def _read_json(path: Path) -> Any:
    text = _read_text(path, "rerun the config to rebuild it")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvevalError(f"{path} is not valid JSON (line {exc.lineno}); rerun the config to rebuild it") from None


def read_metrics(run_dir: str | Path) -> dict:
    """``metrics.json`` of a run folder.

    Raises :class:`KvevalError` with a one-line message when ``run_dir`` is not a folder, when it has no
    ``metrics.json`` (saying whether its run is unfinished: records or a config but no metrics yet), or when the
    file is not a readable file of valid JSON or has no ``policies`` mapping.
    """
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise KvevalError(f"{run_dir} is not a folder; give a kveval results folder (results/<run>)")
    if not os.path.lexists(path):
        if (run_dir / RECORDS_FILE).exists() or (run_dir / CONFIG_FILE).exists():
            raise KvevalError(f"{run_dir} has no {METRICS_FILE} yet: its run is unfinished or was interrupted; "
                              "rerun its command to resume and finish it")
        raise KvevalError(f"{path} does not exist; is {run_dir} a kveval results folder?")
    metrics = _read_json(path)
    if not isinstance(metrics, dict) or not isinstance(metrics.get("policies", {}), dict):
        raise KvevalError(f"{path} is not a kveval metrics document (no 'policies' mapping); rerun the config")
    for section in (BASELINE, "memory", "plan", TASK_ENTRIES):
        if metrics.get(section) is not None and not isinstance(metrics[section], dict):
            raise KvevalError(f"{path}: '{section}' is not a mapping; rerun the config to rebuild it")
    for label, part in (metrics.get(TASK_ENTRIES) or {}).items():
        if not isinstance(part, dict) or not isinstance(part.get("policies", {}), dict):
            raise KvevalError(f"{path}: task entry '{label}' is not a metrics mapping; rerun the config to rebuild "
                              "it")
    for pname, m in metrics.get("policies", {}).items():
        if m is not None and not isinstance(m, dict):
            raise KvevalError(f"{path}: policy '{pname}' is not a mapping; rerun the config to rebuild it")
    return metrics


def read_config(run_dir: str | Path) -> dict:
    """``config.resolved.yaml`` of a run folder as plain data; ``{}`` when the file is absent (or not a mapping).

    Raises :class:`KvevalError` with a one-line message when the file is not a readable file of valid YAML.
    """
    path = Path(run_dir) / CONFIG_FILE
    if not os.path.lexists(path):
        return {}
    text = _read_text(path, "rerun the config to rebuild it")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError:
        raise KvevalError(f"{path} is not valid YAML; rerun the config to rebuild it") from None
    return config if isinstance(config, dict) else {}


def read_env(run_dir: str | Path) -> dict:
    """``env.json`` of a run folder; ``{}`` when the file is absent (or not a mapping); KvevalError (one line)
    when it is not a readable file of valid JSON."""
    path = Path(run_dir) / ENV_FILE
    env = _read_json(path) if os.path.lexists(path) else {}
    return env if isinstance(env, dict) else {}


def read_marker(run_dir: str | Path) -> dict:
    """``.kveval-run.json`` of a run folder (what the run read: the evaluated tokens' digest, the input files');
    ``{}`` when absent (or not a mapping); KvevalError (one line) when it is not a readable file of valid JSON."""
    path = Path(run_dir) / MARKER_FILE
    marker = _read_json(path) if os.path.lexists(path) else {}
    return marker if isinstance(marker, dict) else {}


def read_records(run_dir: str | Path) -> list[dict]:
    """``records.jsonl`` of a run folder: the first complete record of each key, in file order; ``[]`` when the
    file is absent.

    Lines that are not JSON, documents that are not objects with a string ``key``, later records of a key already
    seen and a torn last line are skipped (:func:`kveval.fileio.scan_jsonl`), so a folder written twice by an
    older kveval reads as if written once. KvevalError (one line) when the file is a folder or unreadable.
    """
    path = Path(run_dir) / RECORDS_FILE
    try:
        docs = scan_jsonl(path).objects
    except OSError as exc:
        raise KvevalError(f"cannot read {path} ({exc.strerror or exc}); rerun the config to rebuild it") from None
    out: list[dict] = []
    seen: set[str] = set()
    for doc in docs:
        if isinstance(doc, dict) and isinstance(doc.get("key"), str) and doc["key"] not in seen:
            seen.add(doc["key"])
            out.append(doc)
    return out


def _num(value: Any) -> float:
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def describe_policy(cfg: Any, name: str) -> str:
    """The policy in words (``KVPolicy.describe``), or ``""`` when its config cannot be read by this version."""
    if name == BASELINE:
        return "full precision (no KV quantization)"
    if cfg is None:
        return ""
    from kveval.policy import KVPolicy

    try:
        return KVPolicy.from_config(cfg, name=name).describe()
    except CONFIG_ERRORS as exc:  # an old or foreign config: the report still shows the numbers, and says why
        log.warning("kveval: policy '%s' of this run is not a policy this kveval reads (%s); its description is "
                    "left out", name, _first(exc))
        return ""


def _arch(metrics: dict, config: dict):
    """The model's KV shape: ``metrics["memory"]["arch"]``, else the named shape of the model, else None."""
    from kveval.memory import NAMED_SHAPES, Arch

    arch = (metrics.get("memory") or {}).get("arch")
    if isinstance(arch, dict):
        try:
            return Arch.from_dict(arch)  # every field: windows, layer kinds, MLA, state
        except CONFIG_ERRORS as exc:
            log.warning("kveval: metrics.json's memory.arch is not a shape this kveval reads (%s); the model's "
                        "named shape is used if it has one", _first(exc))
    model = str(metrics.get("model") or (config.get("model") or {}).get("name") or "").removeprefix("builtin:")
    if model in NAMED_SHAPES:
        return Arch.named(model)
    return None


def _context(metrics: dict, config: dict) -> int:
    ctx = (metrics.get("memory") or {}).get("context")
    if isinstance(ctx, int) and ctx > 0:
        return ctx
    lengths = []
    for entry in config.get("tasks") or []:
        if isinstance(entry, dict):
            for params in entry.values():
                if isinstance(params, dict) and isinstance(params.get("seq_len"), int):
                    lengths.append(params["seq_len"])
    return max(lengths) if lengths else 2048


def _memory(name: str, metrics: dict, config: dict) -> pd.DataFrame:
    """The bill per policy (codes / scales / residual bytes at the run's context); empty if the shape is unknown."""
    arch = _arch(metrics, config)
    if arch is None:
        return pd.DataFrame(columns=MEMORY_COLUMNS)
    from kveval.memory import kv_bytes
    from kveval.policy import KVPolicy

    context = _context(metrics, config)
    rows = []
    pols = ((config.get("kv") or {}).get("policies") or {})
    for pname in [BASELINE, *metrics.get("policies", {})]:
        try:
            pol = KVPolicy.preset("fp16") if pname == BASELINE else KVPolicy.from_config(pols[pname], name=pname)
            bill = kv_bytes(arch, pol, context)
        except CONFIG_ERRORS as exc:
            log.warning("kveval: the memory bill of policy '%s' in %s was not recomputed (%s); its row is left "
                        "out of the memory table", pname, name, _first(exc))
            continue
        rows.append({"run": name, "policy": pname, "context": context, "codes": bill.codes, "scales": bill.scales,
                     "residual": bill.residual, "total": bill.total, "bytes_per_token": bill.bytes_per_token})
    return pd.DataFrame(rows, columns=MEMORY_COLUMNS)


def _summary(name: str, metrics: dict, config: dict, memory: pd.DataFrame, task_columns: Sequence[str] = ()
             ) -> pd.DataFrame:
    columns = summary_columns(task_columns)
    pols = ((config.get("kv") or {}).get("policies") or {})
    base = metrics.get(BASELINE) or {}
    entries = [(BASELINE, base)] + list((metrics.get("policies") or {}).items())
    fp16_bpt = None
    if not memory.empty and (memory["policy"] == BASELINE).any():
        fp16_bpt = float(memory.loc[memory["policy"] == BASELINE, "bytes_per_token"].iloc[0])
    rows = []
    for pname, m in entries:
        m = m or {}
        ci = m.get("kld_ci95") or [None, None]
        row: dict[str, Any] = {"run": name, "policy": pname, "spec": describe_policy(pols.get(pname), pname)}
        for col in columns:
            if col in ("run", "policy", "spec", "kld_ci95_lo", "kld_ci95_hi", "verdict"):
                continue
            row[col] = _num(m.get(col))
        row["kld_ci95_lo"], row["kld_ci95_hi"] = _num(ci[0]), _num(ci[1] if len(ci) > 1 else None)
        if pname == BASELINE:
            for col, v in (("delta_ppl", 0.0), ("delta_ppl_pct", 0.0), ("kld_mean", 0.0), ("top1_agree", 1.0)):
                if math.isnan(row[col]) and not math.isnan(row["ppl"]):
                    row[col] = v
        # memory columns of runs that predate them: from the bill
        hit = memory[memory["policy"] == pname] if not memory.empty else memory
        if len(hit) and math.isnan(row["bytes_per_token"]):
            bpt = float(hit["bytes_per_token"].iloc[0])
            row["bytes_per_token"] = bpt
            if fp16_bpt:
                row["compression_vs_fp16"] = fp16_bpt / bpt
        row["verdict"] = "" if pname == BASELINE else str(m.get("verdict") or "")
        rows.append(row)
    df = pd.DataFrame(rows, columns=columns)
    # bits per element from the bill: 8 * total / elements; elements = 2 * layers * kv_heads * context * head_dim
    arch = _arch(metrics, config)
    if arch is not None and not memory.empty:
        per_token_elems = 2 * arch.layers * arch.kv_heads * arch.head_dim
        missing = df["bits_per_element"].isna() & df["bytes_per_token"].notna()
        df.loc[missing, "bits_per_element"] = 8 * df.loc[missing, "bytes_per_token"] / per_token_elems
    return df


def _positions(name: str, metrics: dict) -> pd.DataFrame:
    rows = []
    base = metrics.get(BASELINE) or {}
    base_loss = base.get("loss_by_position") or []
    for pname, m in [(BASELINE, base), *(metrics.get("policies") or {}).items()]:
        m = m or {}
        loss = m.get("loss_by_position") or []
        kld = m.get("kld_by_position") or []
        edges = m.get("position_bin_edges") or base.get("position_bin_edges") or []
        n = max(len(loss), len(kld))
        for i in range(n):
            start = edges[i] if i + 1 < len(edges) else math.nan
            end = edges[i + 1] if i + 1 < len(edges) else math.nan
            lo = _num(loss[i]) if i < len(loss) else math.nan
            bl = _num(base_loss[i]) if i < len(base_loss) else math.nan
            k = _num(kld[i]) if i < len(kld) else (0.0 if pname == BASELINE else math.nan)
            rows.append({"run": name, "policy": pname, "bin": i, "start": start, "end": end,
                         "center": (start + end) / 2, "loss": lo, "delta_loss": lo - bl, "kld": k})
    return pd.DataFrame(rows, columns=POSITION_COLUMNS)


def _scalarise(value: Any) -> Any:
    if isinstance(value, list):
        nums = [_num(v) for v in value]
        return float(sum(nums) / len(nums)) if nums and not any(math.isnan(x) for x in nums) else math.nan
    return value


def _layers(name: str, metrics: dict) -> pd.DataFrame:
    rows = []
    for pname, m in (metrics.get("policies") or {}).items():
        for err in (m or {}).get("layer_errors") or []:
            if isinstance(err, dict) and "layer" in err:
                rows.append({"run": name, "policy": pname, **{k: _scalarise(v) for k, v in err.items()}})
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=["run", "policy", "layer", "key_rel_mse", "value_rel_mse"])
    return df


def _task_entries(name: str, metrics: dict, config: dict, memory: pd.DataFrame, task_columns: Sequence[str] = ()
                  ) -> pd.DataFrame:
    """``RunResults.task_entries``: the summary rows of every later task entry that measured something per policy
    (a perplexity column or a task's own), each labelled with its entry."""
    frames = []
    columns = task_entry_columns(task_columns)
    for label, part in (metrics.get(TASK_ENTRIES) or {}).items():
        if not part.get("policies"):
            continue  # a scan (its own section), or an entry with nothing per policy
        df = _summary(name, {**part, "model": metrics.get("model"), "memory": metrics.get("memory")}, config, memory,
                      task_columns)
        if not df[["ppl", *task_columns]].notna().to_numpy().any():
            continue  # nothing of the summary's columns (lm-eval's numbers are its own)
        df.insert(1, "task", str(label))
        df.insert(2, "kind", str(part.get("kind") or ""))
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=columns)
    return pd.concat(frames, ignore_index=True)[columns]


def load(run_dir: str | Path, task_columns: Sequence[str] = (), task_tables: TaskTables | None = None) -> RunResults:
    """Load ``results/<run>/`` into a :class:`RunResults` (see its docstring for every frame and column).

    ``task_columns``: the tasks' own summary columns; ``task_tables``: their tables (both given by
    :func:`kveval.report.load`, which reads the tasks' reporting plug-ins; without them the run's generic frames).

    Raises :class:`kveval.errors.KvevalError` (one line) when the folder or its ``metrics.json`` is missing or
    corrupt (not JSON, or JSON without the shape of a metrics document); the other files are optional but must
    be readable when present.
    """
    path = Path(run_dir)
    metrics = read_metrics(path)
    config = read_config(path)
    env = read_env(path)
    marker = read_marker(path)
    records = read_records(path)
    try:
        name = str(metrics.get("run") or config.get("name") or path.name)
        memory = _memory(name, metrics, config)
        return RunResults(
            path=path, name=name, metrics=metrics, config=config, env=env, marker=marker,
            summary=_summary(name, metrics, config, memory, task_columns), positions=_positions(name, metrics),
            layers=_layers(name, metrics), memory=memory, records=pd.DataFrame(records),
            task_entries=_task_entries(name, metrics, config, memory, task_columns),
            tables=task_tables(name, metrics) if task_tables is not None else {},
        )
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:  # a hand-edited document
        raise KvevalError(f"{path / METRICS_FILE} does not have the shape of a kveval metrics document "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); rerun the "
                          "config to rebuild it") from None


__all__ = ["BASELINE", "RunResults", "load", "read_metrics", "read_config", "read_env", "read_marker", "read_records",
           "describe_policy", "SUMMARY_COLUMNS", "POSITION_COLUMNS", "TASK_ENTRY_COLUMNS", "summary_columns",
           "task_entry_columns"]
