"""The sweep's cross-run report and its index, from the run folders (through :mod:`kveval.results` only).

``<sweep>/sweep.json`` (:func:`write_index`): the sweep, its Ray set-up, and per run its name, axes (model /
policies / tasks labels), status, folder, config file, log, error (one line), exit status, wall time, host.
``<sweep>/report.md`` + ``report.html`` (self-contained), ``tables/sweep_summary.csv`` and
``plots/quality_vs_memory.png`` (:func:`write_report`): one table across models x policies (PPL, ΔPPL %, KLD,
top-1, bits/element, verdict) read from each finished run's metrics.json, ΔPPL % as a policy x model grid, the
quality-vs-memory figure of every run (:func:`kveval.report.plots.quality_vs_memory`), and the failed runs with
their errors.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kveval.errors import KvevalError
from kveval.fileio import atomic_write_json, atomic_write_text
from kveval.report import load, plots, tables
from kveval.report.render import Block, to_html, to_markdown
from kveval.results import BASELINE, PLOTS_DIR, TABLES_DIR, RunResults

INDEX_FILE = "sweep.json"
REPORT_MD, REPORT_HTML = "report.md", "report.html"
SUMMARY_CSV = "sweep_summary.csv"
FIGURE = "quality_vs_memory.png"
#: The long table's columns: the run's place on the grid, then the numbers of each policy.
COLUMNS = ["run", "model", "policies", "tasks", "policy", "bits/elem", "PPL", "ΔPPL %", "KLD", "top-1", "verdict"]


def write_index(path: Path, document: dict) -> None:
    """Write sweep.json atomically (readers see the previous index or the new one)."""
    atomic_write_json(path, document)


def _number(value, spec: str) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return ""
    return "" if v != v else format(v, spec)


def summary_frame(runs: list[tuple[dict, RunResults]]) -> pd.DataFrame:
    """One row per (run, policy), the run's baseline first: the run's axes and the policy's numbers (the raw
    values, for the CSV). ``runs``: ``(sweep.json entry, loaded run)`` of every finished run."""
    rows = []
    for entry, res in runs:
        axes = entry.get("axes") or {}
        for _, r in res.summary.iterrows():
            rows.append({
                "run": entry["name"], "model": axes.get("model") or res.metrics.get("model", ""),
                "policies": axes.get("policies") or ", ".join(res.policies), "tasks": axes.get("tasks", ""),
                "policy": r["policy"],
                "bits_per_element": r["bits_per_element"], "ppl": r["ppl"], "delta_ppl_pct": r["delta_ppl_pct"],
                "kld_mean": r["kld_mean"], "top1_agree": r["top1_agree"], "bytes_per_token": r["bytes_per_token"],
                "verdict": r["verdict"] if r["policy"] != BASELINE else "",
            })
    return pd.DataFrame(rows)


def readable(frame: pd.DataFrame) -> pd.DataFrame:
    """The long table as text: numbers formatted, the baseline's quality columns empty, empty columns dropped."""
    if frame.empty:
        return pd.DataFrame(columns=COLUMNS)
    out = pd.DataFrame({
        "run": frame["run"], "model": frame["model"], "policies": frame["policies"], "tasks": frame["tasks"],
        "policy": frame["policy"],
        "bits/elem": [_number(v, ".2f") for v in frame["bits_per_element"]],
        "PPL": [_number(v, ".4f") for v in frame["ppl"]],
        "ΔPPL %": [_number(v, "+.3f") for v in frame["delta_ppl_pct"]],
        "KLD": [_number(v, ".3g") for v in frame["kld_mean"]],
        "top-1": [_number(v, ".4f") for v in frame["top1_agree"]],
        "verdict": frame["verdict"].fillna(""),
    })
    base = out["policy"] == BASELINE
    out.loc[base, ["ΔPPL %", "KLD", "top-1"]] = ""
    keep = [c for c in out.columns if c in ("run", "policy") or (out[c].astype(str) != "").any()]
    return out[keep]


def delta_grid(frame: pd.DataFrame) -> pd.DataFrame:
    """ΔPPL % as a grid: one row per policy, one column per model (``model / tasks`` when there are task sets);
    empty when fewer than two models or no perplexity was measured."""
    if frame.empty:
        return pd.DataFrame()
    sub = frame[(frame["policy"] != BASELINE) & frame["delta_ppl_pct"].notna()].copy()
    if sub.empty or sub["model"].nunique() < 2:
        return pd.DataFrame()
    sub["column"] = [m if not t else f"{m} / {t}" for m, t in zip(sub["model"], sub["tasks"])]
    grid = sub.pivot_table(index="policy", columns="column", values="delta_ppl_pct", aggfunc="first", sort=False)
    out = grid.map(lambda v: _number(v, "+.3f")).reset_index()
    out.columns = ["policy", *[str(c) for c in grid.columns]]
    return out


def write_report(out: Path, index: dict) -> Path:
    """Write the cross-run report of the sweep whose sweep.json document is ``index`` into ``out``; returns the
    path of report.md. Runs whose folder cannot be read (deleted, hand-edited) are listed with the reason."""
    loaded: list[tuple[dict, RunResults]] = []
    unreadable: list[str] = []
    for entry in index["runs"]:
        if entry["status"] not in ("finished", "skipped"):
            continue
        try:
            res = load(entry["folder"])
        except KvevalError as exc:
            unreadable.append(f"{entry['name']}: {exc}")
            continue
        res.name = entry["name"]
        for df in (res.summary,):
            df["run"] = entry["name"]
        loaded.append((entry, res))
    frame = summary_frame(loaded)
    (out / TABLES_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / TABLES_DIR / SUMMARY_CSV, tables.csv_safe(frame).to_csv(index=False))

    counts = index["counts"]
    blocks = [Block("h", f"kveval sweep: {index['sweep']}", 1),
              Block("p", f"{len(index['runs'])} runs from {index['file']}: {counts.get('finished', 0)} finished, "
                         f"{counts.get('skipped', 0)} already finished (skipped), {counts.get('failed', 0)} failed"
                         + (f", {counts['interrupted']} interrupted" if counts.get("interrupted") else "")
                         + f"; wall time {index['wall_s']:.1f} s (Ray: {index['ray']['where']}).")]
    blocks.append(Block("h", "All runs, all policies", 2))
    blocks.append(Block("table", readable(frame), caption="One row per policy of each finished run (PPL of the "
                        "run's own FP16 baseline first); ΔPPL % and KLD against that baseline."))
    grid = delta_grid(frame)
    if not grid.empty:
        blocks.append(Block("table", grid, caption="ΔPPL % by policy (rows) and model (columns)"))
    fig = plots.quality_vs_memory([res for _, res in loaded]) if loaded else None
    if fig is not None:
        plots.save(fig, out / PLOTS_DIR / FIGURE)
        fig.clear()
        blocks.append(Block("img", (f"{PLOTS_DIR}/{FIGURE}", "Quality vs memory, all runs"),
                            caption="ΔPPL % and KLD against KV bytes per token, one point per policy; colour and "
                                    "marker: run; dashed: the Pareto front across runs."))
    problems = [f"{e['name']}: {e['status']}: {e['error']}" for e in index["runs"]
                if e["status"] not in ("finished", "skipped")] + unreadable
    if problems:
        blocks.append(Block("h", "Runs without results", 2))
        blocks.append(Block("ul", problems))
    blocks.append(Block("h", "Runs", 2))
    blocks.append(Block("table", pd.DataFrame([{
        "run": e["name"], "status": e["status"], "wall s": _number(e.get("wall_s"), ".1f"),
        "folder": e["folder"], "log": e["log"]} for e in index["runs"]]), caption="sweep.json holds the same, with "
        "hosts, times and exit statuses"))
    atomic_write_text(out / REPORT_MD, to_markdown(blocks))
    atomic_write_text(out / REPORT_HTML, to_html(blocks, f"kveval sweep: {index['sweep']}", out))
    return out / REPORT_MD
