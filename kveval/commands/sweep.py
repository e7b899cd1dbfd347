"""``kveval sweep SWEEP.yaml``: expand a grid into run configs, check them all, run each as a Ray task
(``kveval run`` in its own run folder), skip the runs already finished, then write sweep.json and one cross-run
report.

The sweep's folder (``output``, default ``results/sweeps/<name>``)::

    configs/<run>.yaml     each run's resolved config (rerun one by hand: kveval run configs/<run>.yaml)
    runs/<run>/            each run's folder (records.jsonl, metrics.json, report...: a kveval run folder)
    logs/<run>.log         each run's output
    sweep.json             the index: runs, status, folders, errors, wall times (rewritten as runs end)
    report.md, report.html, tables/sweep_summary.csv, plots/quality_vs_memory.png
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kveval.errors import KvevalError
from kveval.fileio import atomic_write_text, read_regular_bytes
from kveval.messages import print_line
from kveval.results import METRICS_FILE, lock_folder, read_config
from kveval.results.layout import LOCK_FILE, MARKER_FILE, PLOTS_DIR, RECORDS_FILE, REPORT_FILES, TABLES_DIR
from kveval.sweep.expand import RUNS_DIR
from kveval.sweep.load import PlannedRun, SweepPlan, load_sweep, resolved_yaml
from kveval.sweep.report import INDEX_FILE, write_index, write_report
from kveval.sweep.runner import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    SKIPPED,
    RunOutcome,
    RunTask,
    SweepProgress,
    now,
    ray_options,
    ray_session,
    run_tasks,
)

CONFIGS_DIR, LOGS_DIR = "configs", "logs"
#: what a sweep writes in its folder (and the lock, and atomic writes' hidden temporaries): a folder holding
#: anything else is not the sweep's, and the sweep would overwrite it (a run's report.md, report.html, plots)
_SWEEP_NAMES = (RUNS_DIR, CONFIGS_DIR, LOGS_DIR, INDEX_FILE, *REPORT_FILES, TABLES_DIR, PLOTS_DIR, LOCK_FILE)


def check_sweep_folder(out: Path) -> None:
    """A sweep writes only into a folder of its own: one that does not exist, an empty one, or one holding only
    what a sweep writes (:data:`_SWEEP_NAMES`: a previous or interrupted sweep). One KvevalError line for a file,
    a run folder (its marker, records.jsonl, metrics.json) or a folder holding anything else."""
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise KvevalError(f"sweep output '{out}' is not a folder; give the sweep a new or empty folder with -o DIR")
    try:
        names = sorted(os.listdir(out))
    except OSError as exc:
        raise KvevalError(f"sweep output '{out}' cannot be read ({exc.strerror or exc})") from None
    others = [n for n in names if n not in _SWEEP_NAMES
              and not (n.startswith(".") and any(n.startswith(f".{own}.") for own in _SWEEP_NAMES))]
    if not others:
        return
    what = "a kveval run folder" if MARKER_FILE in others or RECORDS_FILE in others or METRICS_FILE in others \
        else "not a sweep's folder"
    raise KvevalError(f"sweep output '{out}' is {what} (it holds {others[0]!r}); a sweep writes only into a new, "
                      "empty or sweep folder of its own: give it one with -o DIR")


def finished_before(run: PlannedRun, before: dict | None = None) -> bool:
    """Whether the run's folder already holds its finished result: metrics.json, and the same resolved config,
    unless the sweep that ran it last (``before``, its sweep.json entry) saw its ``kveval run`` end otherwise: a run
    lost after its metrics and before its report (a node going down) is run again, and resumes from its records
    to its report."""
    if not (run.folder / METRICS_FILE).is_file():
        return False
    if before is not None and before.get("status") in (FAILED, INTERRUPTED, "queued"):
        return False
    try:
        return read_config(run.folder) == yaml.safe_load(resolved_yaml(run.resolved))
    except KvevalError:  # a damaged folder: kveval run says what is wrong with it
        return False


def previous_entries(path: Path) -> dict[str, dict]:
    """The runs of the sweep.json a previous sweep left in this folder, by name (``{}`` when there is none or it
    does not read as one)."""
    try:
        runs = json.loads(read_regular_bytes(path)).get("runs")  # a FIFO there is refused, never opened
        return {e["name"]: e for e in runs if isinstance(e, dict) and isinstance(e.get("name"), str)}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def skipped_outcome(name: str, before: dict | None) -> RunOutcome:
    """A run that had finished before: SKIPPED, with the wall time, host and times of the sweep that ran it
    (from its sweep.json entry, when that entry says it finished)."""
    if not before or before.get("status") not in (FINISHED, SKIPPED) or before.get("returncode") not in (0, None):
        return RunOutcome(name, SKIPPED)
    return RunOutcome(name, SKIPPED, returncode=before.get("returncode"), wall_s=before.get("wall_s"),
                      host=before.get("host"), started=before.get("started"), finished=before.get("finished"))


def _entry(plan: SweepPlan, run: PlannedRun, outcome: RunOutcome | None) -> dict:
    """A run's sweep.json entry: its axes and paths, and its outcome so far (``queued`` before it ends)."""
    out = plan.output
    entry = {"name": run.name, "axes": run.spec.axes, "source": run.spec.source, "folder": str(run.folder),
             "config": str(out / CONFIGS_DIR / f"{run.name}.yaml"), "log": str(out / LOGS_DIR / f"{run.name}.log")}
    if outcome is None:
        return {**entry, "status": "queued", "error": None, "returncode": None, "wall_s": None}
    data = outcome.to_dict()
    data.pop("name")
    return {**entry, **data}


def _counts(entries: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for e in entries:
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    return counts


def dry_run_table(plan: SweepPlan) -> Table:
    """The runs a sweep would start: name, axes, folder, and whether it is already finished."""
    table = Table(title=Text(f"sweep {plan.sweep.name}: {len(plan.runs)} runs into {plan.output}"),
                  title_justify="left")
    for col in ("run", "model", "policies", "tasks", "folder", "state"):
        table.add_column(col, no_wrap=col == "run", overflow="fold")
    previous = previous_entries(plan.output / INDEX_FILE)
    for run in plan.runs:
        axes = run.spec.axes
        cells = (run.name, axes.get("model") or run.cfg.model.name, axes.get("policies") or ", ".join(run.cfg.kv.policies),
                 axes.get("tasks", ""), str(run.folder),
                 "finished (would skip)" if finished_before(run, previous.get(run.name)) else "to run")
        table.add_row(*(Text(str(c)) for c in cells))  # user text (a model path, a folder): never markup
    return table


def sweep_command(path: str, overrides: list[str] | None = None, *, address: str | None = None,
                  overwrite: bool = False, dry_run: bool = False, quiet: bool = False,
                  allow_code: bool = False, output: str | None = None) -> int:
    """Check every run of the sweep file (one KvevalError line for the first problem, before anything starts),
    then run the unfinished ones on Ray and write sweep.json and the report. Returns the exit status: 0 when every
    run has its results, 1 when some failed (each listed with its one-line error). ``output``: the sweep's folder
    instead of its file's ``output:``."""
    plan = load_sweep(path, overrides, allow_code=allow_code, output=output)
    console = Console(width=None if sys.stdout.isatty() else 160)
    check_sweep_folder(plan.output)  # before the dry run's table too: it would be refused
    if dry_run:
        console.print(dry_run_table(plan))
        return 0
    out = plan.output
    command = shlex.join(["kveval", "sweep", str(path), *[a for o in overrides or [] for a in ("-s", o)],
                          *(["-o", output] if output else []), *(["--address", address] if address else [])])
    with lock_folder(out, command=command, hint="wait for that sweep, or give it another folder with -o DIR"):
        check_sweep_folder(out)  # again, under the lock: nothing changes it from here on
        started, t0 = now(), time.perf_counter()
        outcomes: dict[str, RunOutcome] = {}
        previous = previous_entries(out / INDEX_FILE)
        tasks: list[RunTask] = []
        extra = (["--overwrite"] if overwrite else []) + (["--allow-code"] if allow_code else [])
        for run in plan.runs:
            config_file = out / CONFIGS_DIR / f"{run.name}.yaml"
            config_file.parent.mkdir(parents=True, exist_ok=True)
            if finished_before(run, previous.get(run.name)):
                outcomes[run.name] = skipped_outcome(run.name, previous.get(run.name))
                continue
            atomic_write_text(config_file, resolved_yaml(run.resolved))
            tasks.append(RunTask(run.name, str(config_file.absolute()), str(run.folder),
                                 str((out / LOGS_DIR / f"{run.name}.log").absolute()), os.getcwd(), extra,
                                 plan.sweep.resources.timeout_s))
        res = plan.sweep.resources
        where = (address or "local") if tasks else "not started: every run had finished before"
        index: dict = {"sweep": plan.sweep.name, "file": str(plan.path), "command": command, "started": started,
                       "finished": None, "wall_s": None, "ray": {"where": where}, "resources": res.model_dump(),
                       "counts": {}, "runs": []}

        def save(outcome: RunOutcome | None = None) -> None:
            if outcome is not None:
                outcomes[outcome.name] = outcome
            index["runs"] = [_entry(plan, r, outcomes.get(r.name)) for r in plan.runs]
            index["counts"] = _counts(index["runs"])
            write_index(out / INDEX_FILE, index)

        console.print(Text.assemble(("kveval sweep", "bold"), f" {plan.sweep.name}: {_count(len(plan.runs), 'run')}, "
                                    f"{len(tasks)} to run, {len(plan.runs) - len(tasks)} already finished; "
                                    f"folder {out}/"), highlight=False)
        if not tasks:
            save()
        else:  # sweep.json is rewritten once Ray is there: a cluster that cannot be reached leaves the last one
            with ray_session(address, plan.sweep.ray.num_cpus, plan.sweep.ray.num_gpus) as ray:
                cpus = ray.cluster_resources().get("CPU", 0)
                index["ray"] = {"where": where, "cluster_cpus": cpus,
                                "cluster_gpus": ray.cluster_resources().get("GPU", 0)}
                save()
                print_line(console, f"Ray ({where}, {_count(cpus, 'CPU')}): each run asks for {res.num_cpus:g} CPU, "
                                    f"{res.num_gpus:g} GPU" + (f", {res.memory}" if res.memory else ""))
                run_tasks(tasks, ray_options(res.num_cpus, res.num_gpus, res.memory),
                          SweepProgress(console, quiet=quiet), on_outcome=save)
        index["finished"] = now()
        index["wall_s"] = round(time.perf_counter() - t0, 3)
        save()
        report = write_report(out, index)
    console.print(outcome_table(index))
    print_line(console, f"index: {out / INDEX_FILE}\nreport: {report}")
    return 1 if index["counts"].get(FAILED) else 0


def outcome_table(index: dict) -> Table:
    """The closing table: one row per run, its status, wall time and error."""
    table = Table(title=Text(f"sweep {index['sweep']}: " + ", ".join(f"{n} {s}" for s, n in index["counts"].items())
                             + f" in {index['wall_s']:.1f} s"), title_justify="left")
    for col in ("run", "status", "wall s", "error"):
        table.add_column(col, no_wrap=col != "error", overflow="fold")
    for e in index["runs"]:
        style = {FINISHED: "green", SKIPPED: "cyan", FAILED: "red"}.get(e["status"], "yellow")
        wall = "" if e.get("wall_s") is None else f"{e['wall_s']:.1f}"
        table.add_row(Text(str(e["name"])), Text(str(e["status"]), style=style), wall,
                      Text(str(e.get("error") or "")))  # a run's error holds user text: never markup
    return table


def _count(n: float, noun: str) -> str:
    """``1 run``, ``2 runs``, ``0 runs``, ``0.5 CPU`` (``n`` as :g)."""
    return f"{n:g} {noun}" + ("s" if n > 1 or n == 0 else "")
