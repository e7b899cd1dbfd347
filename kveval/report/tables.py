"""The report's tables: pandas frames for ``tables/*.csv``, the readable tables built from them, and the
formatting of their cells (:func:`format_number`, :func:`cell_text`...); :mod:`kveval.report.document` renders
them as Markdown and HTML."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from kveval.fileio import atomic_write_text
from kveval.report.sections import summary_columns, summary_keys
from kveval.results import BASELINE, RunResults
from kveval.results.read import task_entry_columns

#: Columns :func:`summary` adds to ``RunResults.summary`` from each policy's metrics: llama-perplexity's headline
#: statistics (metrics.json's ``llama_perplexity``, Δp and same top p in percent) and the power fields
SUMMARY_EXTRA = ["kld_median", "kld_p99", "kld_p99_9", "kld_max", "delta_p_mean_pct", "delta_p_rms_pct",
                 "same_top_p_pct", "same_top_p_pct_unc", "delta_ppl_pct_mde", "kld_mde", "more_tokens_to_decide"]
_POWER = ("delta_ppl_pct_mde", "kld_mde", "more_tokens_to_decide")


def _policy_metrics(metrics: dict) -> dict[str, dict]:
    """Policy name -> its metrics entry (the baseline's too) of a metrics document (or of a later task entry)."""
    out = {BASELINE: metrics.get(BASELINE) or {}}
    out.update({n: m or {} for n, m in (metrics.get("policies") or {}).items()})
    return out


def _extra_columns(df: pd.DataFrame, entries: dict[str, dict]) -> pd.DataFrame:
    """``df`` (summary rows, one per policy) with the :data:`SUMMARY_EXTRA` columns read from ``entries``."""
    out = df.copy()
    for col in SUMMARY_EXTRA:
        vals = []
        for p in out["policy"]:
            m = entries.get(str(p)) or {}
            v = m.get(col) if col in _POWER else (m.get("llama_perplexity") or {}).get(col)
            vals.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan)
        out[col] = vals
    return out


def summary(runs: RunResults | Sequence[RunResults]) -> pd.DataFrame:
    """One row per (run, policy), the baseline first in each run: every column of ``RunResults.summary``, then
    :data:`SUMMARY_EXTRA` (NaN where a run has none: an older run, a policy without perplexity)."""
    runs = [runs] if isinstance(runs, RunResults) else list(runs)
    return pd.concat([_extra_columns(r.summary, _policy_metrics(r.metrics or {})) for r in runs], ignore_index=True)


def llama_perplexity_frame(runs: RunResults | Sequence[RunResults]) -> pd.DataFrame:
    """``tables/llama_perplexity.csv``: one row per (run, policy) with llama-perplexity's statistics (metrics.json's
    ``llama_perplexity``: the keys of :data:`kveval.stats.LLAMA_STATS` and their ``_unc``), numbers; empty when no
    policy has them."""
    from kveval.stats import LLAMA_STATS

    cols = ["tokens"] + [k for key, _, unc in LLAMA_STATS for k in ((key, f"{key}_unc") if unc else (key,))]
    runs = [runs] if isinstance(runs, RunResults) else list(runs)
    rows = []
    for r in runs:
        for name, m in _policy_metrics(r.metrics or {}).items():
            lp = m.get("llama_perplexity") if isinstance(m, dict) else None
            if lp:
                rows.append({"run": r.name, "policy": name, **{c: lp.get(c) for c in cols}})
    return pd.DataFrame(rows, columns=["run", "policy", *cols])


def llama_stats_table(columns: dict[str, dict]) -> pd.DataFrame:
    """llama-perplexity's summary as it prints it: one row per statistic (its label, in its order), one column per
    entry of ``columns`` (name -> a ``llama_perplexity`` dict; e.g. policies, or the tool beside kveval), cells
    ``value ± uncertainty``; KLD with 6 decimals, Δp and same top p in percent with 3, as the tool prints them."""
    from kveval.stats import LLAMA_STATS

    rows = []
    for key, label, unc in LLAMA_STATS:
        pct = key.endswith("_pct")
        row = {"statistic": label + (" %" if pct else "")}
        for name, stats in columns.items():
            row[name] = _stat(stats or {}, key, unc)
        rows.append(row)
    return pd.DataFrame(rows)


def _stat(stats: dict, key: str, unc: bool) -> str:
    v = stats.get(key)
    if not _ok(v):
        return ""
    spec = ".2f" if key == "cor_ln_ppl_pct" else ".3f" if key.endswith("_pct") else ".6f"
    text = format(float(v), spec)
    u = stats.get(f"{key}_unc") if unc else None
    return text + (f" ± {format(float(u), spec)}" if _ok(u) else "")


def verdict_table(runs: RunResults | Sequence[RunResults]) -> pd.DataFrame:
    """The readable verdict table: policy, spec, PPL, ΔPPL %, KLD [95% CI], top-1, bits/element, compression,
    the tasks' own columns (when measured: their plug-ins' ``SummaryColumn.table``), verdict. Formatted strings; a ``run`` column only for several runs."""
    runs = [runs] if isinstance(runs, RunResults) else list(runs)
    return _verdict_rows(summary(runs), keep_run=len(runs) > 1, batches=_deployment_batches(runs))


def _deployment_batches(runs: Sequence[RunResults]) -> dict[tuple[str, str], tuple[Any, int | None]]:
    """(run, policy) -> (max batch, the context it is counted at): each run's deployment-sized bill
    (:func:`deployment_memory`), so that runs of different contexts are never compared unlabelled."""
    out: dict[tuple[str, str], tuple[Any, int | None]] = {}
    for r in runs:
        ctx, mem = deployment_memory(r)
        for policy, fields in mem.items():
            out[(str(r.name), str(policy))] = (fields.get("max_batch"), ctx)
    return out


#: the at-a-glance table's columns (at most this many; :func:`glance_table`)
GLANCE_COLUMNS = 8


def context_label(tokens: int) -> str:
    """``8192`` -> ``8k``, ``131072`` -> ``128k``, ``512`` -> ``512``: a context as users name it (k = 1024)."""
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:,}"


def deployment_memory(res: RunResults) -> tuple[int | None, dict[str, dict]]:
    """(context, policy -> memory fields) of the run's deployment-sized bill (metrics.json ``memory.deployment``;
    the baseline under its name), else the run's own context and the policies' fields (a run before 2026-12)."""
    memory = (res.metrics or {}).get("memory") or {}
    dep = memory.get("deployment")
    if isinstance(dep, dict) and isinstance(dep.get("context"), int):
        fields = {BASELINE: dep.get(BASELINE) or {}}
        fields.update({n: f or {} for n, f in (dep.get("policies") or {}).items() if isinstance(f, dict)})
        return dep["context"], fields
    ctx = memory.get("context")
    return (ctx if isinstance(ctx, int) else None), _policy_metrics(res.metrics or {})


def glance_table(res: RunResults) -> pd.DataFrame:
    """The report's first table, read at a glance (at most :data:`GLANCE_COLUMNS` columns): policy, bits per
    element, ΔPPL % with its MDE, KLD, its 99th percentile, same top p %, the largest batch at the deployment
    context (:func:`deployment_memory`) on the configured GPU, verdict. Columns empty in every row are left out
    and the tasks' own columns (a run without perplexity) fill the room; the full table is :func:`verdict_table`."""
    df = summary(res)
    ctx, mem = deployment_memory(res)
    gpu = ((res.metrics or {}).get("memory") or {}).get("gpu_memory")
    batch_col = "max batch" + (f" @ {context_label(ctx)}" if ctx else "") + (f", {gpu}" if gpu else "")
    task_columns = [c for c in summary_columns() if c.table is not None]
    rows = []
    for _, r in df.iterrows():
        base = r["policy"] == BASELINE
        mde = r.get("delta_ppl_pct_mde")
        rows.append({
            "policy": r["policy"],
            "bits/elem": _f(r["bits_per_element"], ".2f"),
            "ΔPPL % (MDE)": "" if base else _f(r["delta_ppl_pct"], "+.2f") + (
                f" ({_f(mde, '.2f')})" if _ok(mde) and _ok(r["delta_ppl_pct"]) else ""),
            "KLD": "" if base else _g(r["kld_mean"]),
            "KLD 99%": "" if base else _g(r.get("kld_p99")),
            "same top p %": "" if base else _f(r.get("same_top_p_pct"), ".2f"),
            batch_col: _f((mem.get(str(r["policy"])) or {}).get("max_batch"), ",.0f"),
            "verdict": _verdict_words(r["verdict"], r.get("more_tokens_to_decide")),
            **{c.table[0]: _f(r.get(c.key), c.table[1]) for c in task_columns},
        })
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    core = ["policy", "bits/elem", "ΔPPL % (MDE)", "KLD", "KLD 99%", "same top p %", batch_col]
    keep = [c for c in core if c == "policy" or (out[c] != "").any()]
    extra = [c.table[0] for c in task_columns if (out[c.table[0]] != "").any()]
    keep += extra[:max(0, GLANCE_COLUMNS - 1 - len(keep))]
    return out[keep + ["verdict"]]


def task_entries(runs: RunResults | Sequence[RunResults]) -> pd.DataFrame:
    """One row per (run, later task entry, policy): ``RunResults.task_entries`` of every run (a second
    perplexity task's own numbers, labelled ``tasks[i]``); empty when no config repeats a task kind."""
    runs = [runs] if isinstance(runs, RunResults) else list(runs)
    frames = [r.task_entries for r in runs if not r.task_entries.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=task_entry_columns(summary_keys()))


def task_entry_table(res: RunResults, label: str) -> pd.DataFrame:
    """The verdict table (:func:`verdict_table`'s columns) of one later task entry of a run (``label``:
    ``tasks[1]``), from ``RunResults.task_entries``: the numbers of that entry only."""
    df = res.task_entries[res.task_entries["task"] == label].drop(columns=["task", "kind"])
    entry = ((res.metrics or {}).get("tasks") or {}).get(label) or {}
    return _verdict_rows(_extra_columns(df.reset_index(drop=True), _policy_metrics(entry)), keep_run=False)


def _verdict_rows(df: pd.DataFrame, keep_run: bool,
                  batches: dict[tuple[str, str], tuple[Any, int | None]] | None = None) -> pd.DataFrame:
    """The formatted verdict rows of summary rows ``df`` (``RunResults.summary``'s columns); columns that are empty in every
    row are left out (the ``run`` column too unless ``keep_run``). ``batches`` (:func:`_deployment_batches`): the
    max batch column at the deployment context, named in the header when every row shares it, else in each cell."""
    rows = []
    batch_col, batch_cells = "max batch", {}
    if batches is not None:
        contexts = {ctx for _, ctx in batches.values() if ctx}
        one = len(contexts) == 1
        batch_col = f"max batch @ {context_label(next(iter(contexts)))}" if one else "max batch @ context"
        batch_cells = {key: _f(value, ",.0f") + ("" if one or not ctx or not _ok(value) else f" @ {context_label(ctx)}")
                       for key, (value, ctx) in batches.items()}
    task_columns = [c for c in summary_columns() if c.table is not None]  # the tasks' own (their plug-ins)
    for _, r in df.iterrows():
        base = r["policy"] == BASELINE
        kld = "" if base or not _ok(r["kld_mean"]) else _g(r["kld_mean"]) + (
            f" [{_g(r['kld_ci95_lo'])}, {_g(r['kld_ci95_hi'])}]" if _ok(r["kld_ci95_lo"]) else "")
        row = {
            "run": r["run"], "policy": r["policy"], "spec": r["spec"],
            "PPL": _f(r["ppl"], ".3f"),
            "ΔPPL %": "" if base else _f(r["delta_ppl_pct"], "+.2f"),
            "KLD [95% CI]": kld,
            "KLD 99%": "" if base else _g(r.get("kld_p99")),
            "top-1 agree": "" if base else _f(r["top1_agree"], ".3f"),
            "same top p %": "" if base else _f(r.get("same_top_p_pct"), ".2f") + (
                f" ± {_f(r.get('same_top_p_pct_unc'), '.2f')}" if _ok(r.get("same_top_p_pct_unc")) else ""),
            "bits/elem": _f(r["bits_per_element"], ".2f"),
            "bytes/token": _f(r["bytes_per_token"], ",.0f"),
            "compression": _f(r["compression_vs_fp16"], ".2f", suffix="×"),
            batch_col: batch_cells.get((str(r["run"]), str(r["policy"])), "") if batches is not None
            else _f(r["max_batch"], ".0f"),
            **{c.table[0]: _f(r.get(c.key), c.table[1]) for c in task_columns},
            "noise floor ΔPPL %": _f(r["noise_floor_ppl_pct"], ".2f", prefix="±"),
            "preset checked": "" if base else _checked(r["policy"]),
            "MDE ΔPPL %": "" if base else _f(r.get("delta_ppl_pct_mde"), ".2f"),
            "verdict": _verdict_words(r["verdict"], r.get("more_tokens_to_decide")),
        }
        rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    keep = [c for c in out.columns if c in ("policy", "verdict") or (out[c] != "").any()]
    if not keep_run:
        keep = [c for c in keep if c != "run"]
    return out[keep]


def _verdict_words(verdict, more) -> str:
    """The verdict, and for ``inconclusive`` how many more scored tokens would decide it."""
    text = "" if not _ok(verdict) else str(verdict)
    if text == "inconclusive" and _ok(more):
        text += f" (+{float(more):,.0f} tokens)"
    return text


def _checked(policy: str) -> str:
    """How the preset a policy is named after was checked (``system``, ``reference``, ``documented``:
    :mod:`kveval.policy.provenance`); empty for a policy named after no system."""
    from kveval.policy.provenance import check_of

    check = check_of(str(policy))
    return "" if check is None else check.kind


def memory_table(res: RunResults) -> pd.DataFrame:
    """The memory bill per policy at the run's context (batch 1), formatted: codes, scales (+ zero points),
    full-precision tokens, total (binary units), bytes per token and compression against FP16."""
    from kveval.units import format_bytes

    mem = res.memory
    if mem.empty:
        return pd.DataFrame()
    fp16 = mem.loc[mem["policy"] == BASELINE, "total"]
    dctx, dmem = deployment_memory(res)
    run_ctx = ((res.metrics or {}).get("memory") or {}).get("context")
    rows = []
    for _, m in mem.iterrows():
        row = {
            "policy": "fp16 (baseline)" if m["policy"] == BASELINE else m["policy"],
            "codes": format_bytes(m["codes"]), "scales + zero points": format_bytes(m["scales"]),
            "full precision": format_bytes(m["residual"]), "total": format_bytes(m["total"]),
            "bytes/token": f"{m['bytes_per_token']:,.0f}",
            "vs FP16": f"{float(fp16.iloc[0]) / m['total']:.2f}×" if len(fp16) and m["total"] else "",
        }
        if dctx and dctx != run_ctx:  # the same policy at the deployment context
            fields = dmem.get(str(m["policy"])) or {}
            per_token = fields.get("bytes_per_token")
            row[f"total @ {context_label(dctx)}"] = format_bytes(per_token * dctx) if _ok(per_token) else ""
            row[f"max batch @ {context_label(dctx)}"] = _f(fields.get("max_batch"), ",.0f")
        rows.append(row)
    return pd.DataFrame(rows)


#: Columns of :func:`weights_frame` (``tables/weights_x_kv.csv``): one row per (weight variant, KV policy), the
#: variant with the full-precision cache first (policy ``baseline``); metrics.json's ``weights`` fields.
WEIGHTS_COLUMNS = [
    "run", "weights", "policy", "weight_spec", "modules_quantized", "params_quantized", "bits_per_weight",
    "weight_bytes", "weight_bytes_fp16", "ppl", "delta_ppl_pct", "kld_mean", "top1_agree",
    "weights_delta_ppl_pct", "kv_delta_ppl_pct", "delta_ppl_pct_sum", "delta_ppl_pct_excess",
    "delta_ppl_pct_excess_ci95_lo", "delta_ppl_pct_excess_ci95_hi", "delta_ppl_interaction",
    "delta_ppl_worse_than_sum", "weights_kld_mean", "kv_kld_mean", "kld_sum", "kld_excess", "kld_excess_ci95_lo",
    "kld_excess_ci95_hi", "kld_interaction", "kld_worse_than_sum", "kv_on_weights_kld_mean",
    "kv_on_weights_delta_ppl_pct", "max_batch", "verdict",
]


def weights_frame(res: RunResults) -> pd.DataFrame:
    """The weights x KV interaction of a run (``metrics["weights"]``) as numbers: one row per (weight variant, KV
    policy), ``WEIGHTS_COLUMNS``; the row of policy ``baseline`` is the variant with the full-precision cache (the
    weight effect alone: ``delta_ppl_pct``, ``kld_mean``; the interaction columns empty). Empty when the run had no
    weight variants."""
    variants = ((res.metrics or {}).get("weights") or {}).get("variants") or {}
    rows = []
    for vname, v in variants.items():
        if not isinstance(v, dict):
            continue
        info = v.get("info") or {}
        common = {"run": res.name, "weights": vname, "weight_spec": info.get("describe"),
                  "modules_quantized": ", ".join(info.get("modules_quantized") or []),
                  "params_quantized": info.get("params_quantized"), "bits_per_weight": info.get("bits_per_weight"),
                  "weight_bytes": v.get("weight_bytes"), "weight_bytes_fp16": v.get("weight_bytes_fp16")}
        alone = v.get("alone") or {}
        rows.append({**common, "policy": BASELINE, **{k: alone.get(k) for k in (
            "ppl", "delta_ppl_pct", "kld_mean", "top1_agree", "max_batch", "verdict")},
            "weights_delta_ppl_pct": alone.get("delta_ppl_pct"), "weights_kld_mean": alone.get("kld_mean")})
        for pname, m in (v.get("policies") or {}).items():
            m = m or {}
            row = {**common, "policy": pname}
            for col in WEIGHTS_COLUMNS:
                if col not in row and col in m:
                    row[col] = m[col]
            for name in ("delta_ppl_pct_excess", "kld_excess"):
                ci = m.get(f"{name}_ci95") or [None, None]
                row[f"{name}_ci95_lo"], row[f"{name}_ci95_hi"] = ci[0], ci[1] if len(ci) > 1 else None
            rows.append(row)
    return pd.DataFrame(rows, columns=WEIGHTS_COLUMNS)


def weights_table(res: RunResults) -> pd.DataFrame:
    """The readable weights x KV table: per (weight variant, KV policy) the weight effect (W), the KV effect on the
    checkpoint's weights (KV), the combined effect, their sum and the excess with its 95% interval, for ΔPPL %
    and KLD, and whether the combination is worse than the sum (``yes*``: the interval excludes 0)."""
    df = weights_frame(res)
    rows = []
    for _, r in df.iterrows():
        alone = r["policy"] == BASELINE
        worse = {k: "" if alone else _worse(r[f"{k}_worse_than_sum"], r[f"{k}_interaction"]) for k in ("delta_ppl", "kld")}
        ci = {k: "" if alone else _with_ci(r, k, spec) for k, spec in (("delta_ppl_pct_excess", "+.2f"),
                                                                       ("kld_excess", "+.3g"))}
        rows.append({
            "weights": r["weights"], "KV": "fp16 (FP cache)" if alone else r["policy"],
            "bits/weight": _f(r["bits_per_weight"], ".2f"),
            "ΔPPL % W": _f(r["weights_delta_ppl_pct"], "+.2f"),
            "ΔPPL % KV": "" if alone else _f(r["kv_delta_ppl_pct"], "+.2f"),
            "ΔPPL % both": "" if alone else _f(r["delta_ppl_pct"], "+.2f"),
            "ΔPPL % W+KV": "" if alone else _f(r["delta_ppl_pct_sum"], "+.2f"),
            "ΔPPL % excess [95% CI]": ci["delta_ppl_pct_excess"],
            "ΔPPL worse than sum": worse["delta_ppl"],
            "KLD W": _g(r["weights_kld_mean"]),
            "KLD KV": "" if alone else _g(r["kv_kld_mean"]),
            "KLD both": "" if alone else _g(r["kld_mean"]),
            "KLD W+KV": "" if alone else _g(r["kld_sum"]),
            "KLD excess [95% CI]": ci["kld_excess"],
            "KLD worse than sum": worse["kld"],
            "max batch": _f(r["max_batch"], ".0f"),
        })
    return pd.DataFrame(rows)


def _worse(flag, word) -> str:
    """``yes`` / ``no`` for "worse than the sum", ``*`` when the interval of the excess excludes 0."""
    if flag is None or not _ok(flag):
        return ""
    return ("yes" if bool(flag) else "no") + ("*" if word in ("superadditive", "subadditive") else "")


def _with_ci(r, name: str, spec: str) -> str:
    """``r[name]`` with its 95% interval (``name_ci95_lo`` / ``_hi``), formatted by ``spec``."""
    if not _ok(r[name]):
        return ""
    lo, hi = r[f"{name}_ci95_lo"], r[f"{name}_ci95_hi"]
    return _f(r[name], spec) + (f" [{_f(lo, spec)}, {_f(hi, spec)}]" if _ok(lo) and _ok(hi) else "")


def write_csvs(runs: Sequence[RunResults], tables_dir: Path) -> dict[str, Path]:
    """Write ``summary.csv``, ``positions.csv``, ``layers.csv``, ``memory.csv`` and, when present, each of the
    tasks' tables (``RunResults.tables``: ``needle.csv``...), ``task_entries.csv`` (the later entries of a repeated task kind, one
    row per entry and policy) and ``weights_x_kv.csv`` (:func:`weights_frame`) (all runs concatenated, a ``run``
    column first); returns name -> path."""
    tables_dir = Path(tables_dir)
    tables_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    frames = {
        "summary": summary(runs),
        "positions": pd.concat([r.positions for r in runs], ignore_index=True),
        "layers": pd.concat([r.layers for r in runs], ignore_index=True),
        "memory": pd.concat([r.memory for r in runs], ignore_index=True),
    }
    optional = {  # written only when some run has rows: the tasks' tables, the later entries, the weights, the tool
        **{name: pd.concat([r.tables[name] for r in runs if name in r.tables], ignore_index=True)
           for name in dict.fromkeys(n for r in runs for n in r.tables)},
        "task_entries": task_entries(runs),
        "weights_x_kv": pd.concat([weights_frame(r) for r in runs], ignore_index=True),
        "llama_perplexity": llama_perplexity_frame(runs),
    }
    frames.update({name: df for name, df in optional.items() if not df.empty})
    for name, df in frames.items():
        path = tables_dir / f"{name}.csv"
        atomic_write_text(path, csv_safe(df).to_csv(index=False))
        out[name] = path
    return out


#: First characters that make a spreadsheet read a cell as a formula (OWASP "CSV injection").
FORMULA_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")


def csv_safe_cell(value):
    """A text cell that a spreadsheet would run as a formula (``=HYPERLINK(...)``, ``+1``, ``@SUM``, a leading
    tab or CR) gets a leading ``'`` so that it opens as text; anything else, numbers included (``-0.5`` stays a
    number), is returned unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_TRIGGERS):
        return "'" + value
    return value


def csv_safe(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every text cell and column name made spreadsheet-safe (:func:`csv_safe_cell`); numeric columns
    are untouched."""
    out = df.copy()
    for col in out.columns:
        if not pd.api.types.is_numeric_dtype(out[col]):  # object or string dtype (pandas >= 3 infers "str")
            out[col] = out[col].map(csv_safe_cell)
    out.columns = [csv_safe_cell(c) for c in out.columns]
    return out


def plan_table(res: RunResults) -> pd.DataFrame:
    """Predicted (``kveval plan``) against measured KLD and ΔPPL for the planned policy and the uniform policies of
    nearest memory; empty unless the run's config named a ``plan:``. KLD is the mean per-token KLD (the plan
    predicts it as the sum of the scanned one-tensor KLDs, assuming they add up)."""
    plan = (res.metrics or {}).get("plan") or {}
    predicted = plan.get("predicted") or {}
    if not predicted or res.summary.empty:
        return pd.DataFrame()
    rows = []
    by_policy = res.summary.set_index("policy")
    for name, pred in predicted.items():
        if name not in by_policy.index:
            continue
        m = by_policy.loc[name]

        def num(v, spec):
            return "" if v is None or pd.isna(v) else format(v, spec)

        rows.append({
            "policy": name,
            "bits/elem": num(m.get("bits_per_element"), ".3f"),
            "predicted KLD": num(pred.get("kld"), ".4g"),
            "measured KLD": num(m.get("kld_mean"), ".4g"),
            "predicted ΔPPL %": num(pred.get("delta_ppl_pct"), "+.2f"),
            "measured ΔPPL %": num(m.get("delta_ppl_pct"), "+.2f"),
        })
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------- cells


def cell_text(v) -> str:
    """A table cell as the report shows it: empty for None and NaN, a float with three significant digits,
    anything else as text (the tables above format their own cells; :mod:`kveval.report.document` renders them)."""
    if isinstance(v, float):
        return _g(v)
    return "" if v is None else str(v)


def has_value(v) -> bool:
    """Not None and not NaN (a table cell to fill)."""
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def is_number(v) -> bool:
    """A value that reads as a number other than NaN (strings and other objects do not)."""
    try:
        return v is not None and not math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def format_general(v) -> str:
    """``v`` with three significant digits, ``n/a`` when it is no number (the report's sentences)."""
    return f"{float(v):.3g}" if is_number(v) else "n/a"


def format_number(v, spec: str, prefix: str = "", suffix: str = "") -> str:
    """A table cell: ``v`` formatted with ``spec`` between ``prefix`` and ``suffix``, empty without a value."""
    return "" if not has_value(v) else f"{prefix}{format(float(v), spec)}{suffix}"


_ok, _f = has_value, format_number


def _g(v) -> str:
    return "" if not _ok(v) else f"{float(v):.3g}"


__all__ = ["glance_table", "deployment_memory", "context_label", "GLANCE_COLUMNS", "summary", "llama_perplexity_frame",
           "llama_stats_table", "SUMMARY_EXTRA", "verdict_table", "task_entries", "task_entry_table", "memory_table",
           "plan_table", "write_csvs", "csv_safe", "csv_safe_cell", "weights_frame", "weights_table",
           "WEIGHTS_COLUMNS", "cell_text", "format_general", "format_number", "has_value", "is_number"]
