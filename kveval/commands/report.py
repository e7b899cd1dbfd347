"""``kveval report``: Markdown + self-contained HTML + CSV tables + PNG plots, for one run or across runs.

    report_command(["results/int4_g64"])                      # into results/int4_g64/
    report_command(["results/a", "results/b"], out="cmp/")    # one table and one Pareto plot for both runs

The command's work: the runs loaded, the output folder locked and checked, the report built
(:func:`kveval.report.render.build`) and written twice (:mod:`kveval.report.document`), a failure one line.
``kveval run`` ends with :func:`write_run_report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date
from pathlib import Path

from kveval.errors import KvevalError
from kveval.fileio import atomic_write_text
from kveval.report import load
from kveval.report.document import to_html, to_markdown
from kveval.report.render import build
from kveval.results import PLOTS_DIR, TABLES_DIR, RunResults, lock_folder
from kveval.results.layout import REPORT_FILES


def report_command(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write ``report.md``, ``report.html``, ``tables/*.csv`` and ``plots/*.png`` for one or several runs.

    ``out`` defaults to the run folder (one run) or ``reports/<YYYY-MM-DD>`` (several). Returns the output folder.
    A missing or corrupt results folder raises :class:`KvevalError` with a one-line message before anything is
    written. Each task adds its section and draws its own figures (needle heatmaps, the scan's heatmap and ranking,
    RULER's heatmaps, for the tasks whose ``plots`` parameter is true: :mod:`kveval.report.sections`).

    The output folder has one owner while the report is written (:func:`kveval.results.lock_folder`: a run still
    writing its folder refuses the report with one line naming it; ``kveval run`` itself already holds it). Every
    file is replaced atomically, never written through a symbolic link, so an interrupted report leaves the
    previous one (or none) and never a half-written file; a folder or file in the way, or one that cannot be
    written, is a one-line :class:`KvevalError`.
    """
    if not run_dirs:
        raise KvevalError("give at least one results folder (results/<run>)")
    runs = [load(d) for d in run_dirs]
    _dedupe_names(runs)
    if out is None:
        out = Path(run_dirs[0]) if len(runs) == 1 else Path("reports") / date.today().isoformat()
    out = Path(out)
    with lock_folder(out, command="kveval report " + " ".join(str(d) for d in run_dirs),
                     hint="give another folder with -o"):
        _check_targets(out)
        try:
            blocks = build(runs, out)
            title = f"kveval report: {', '.join(r.name for r in runs)}"
            atomic_write_text(out / "report.md", to_markdown(blocks))
            atomic_write_text(out / "report.html", to_html(blocks, title, out))
        except OSError as exc:
            raise KvevalError(f"cannot write the report into {out}: {exc.strerror or exc}; make it writable, or "
                              "give another folder with -o") from None
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:  # hand-edited run files
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise KvevalError(f"the report of {', '.join(str(d) for d in run_dirs)} failed on its numbers "
                              f"({type(exc).__name__}: {first}); is metrics.json hand-edited? rerun the config to "
                              "rebuild it") from None
    return out


def write_run_report(run_dir: Path) -> None:
    """What ``kveval run`` calls at the end of every run: the report into the run folder, with its tasks' figures
    (tasks draw nothing themselves).

    A report that fails is one :class:`KvevalError` line saying so (the command exits non-zero); the run's records
    and metrics are on disk before it is drawn and stay, so ``kveval report RUN_DIR`` redraws it once the cause is
    fixed. An error of another kind is a bug and goes through whole.
    """
    try:
        report_command([run_dir])
    except KvevalError as exc:
        raise KvevalError(f"the report of {run_dir} was not written: {exc} (its records and metrics.json are kept; "
                          f"kveval report {run_dir} draws it again)") from None


def _check_targets(out: Path) -> None:
    """Refuse (one line) a report folder where a file kveval writes is a folder or a symbolic link, or where
    ``tables`` / ``plots`` is not a plain folder: the report never writes through a link or over a foreign
    object."""
    problems = []
    for name in REPORT_FILES:
        p = out / name
        if p.is_symlink() or (p.exists() and not p.is_file()):
            problems.append(f"{name} is {'a symbolic link' if p.is_symlink() else 'not a file'}")
    for sub, pattern in ((TABLES_DIR, "*.csv"), (PLOTS_DIR, "*.png")):
        d = out / sub
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            problems.append(f"{sub} is {'a symbolic link' if d.is_symlink() else 'not a folder'}")
        elif d.is_dir():
            links = sorted(p.name for p in d.glob(pattern) if p.is_symlink() or not p.is_file())
            if links:
                problems.append(f"{sub}/{links[0]} is a symbolic link or not a file")
    if problems:
        raise KvevalError(f"{out}: {problems[0]}; kveval replaces only its own plain files there: remove it, or "
                          "give another folder with -o")


def _dedupe_names(runs: list[RunResults]) -> None:
    """Runs of the same name (``a/run``, ``b/run``) named ``run``, ``run-2``...: in the report and in the ``run``
    column of every table."""
    seen: dict[str, int] = {}
    for r in runs:
        n = seen.get(r.name, 0)
        seen[r.name] = n + 1
        if n:
            r.name = f"{r.name}-{n + 1}"
            for df in r.frames():
                if "run" in df:
                    df["run"] = r.name


__all__ = ["report_command", "write_run_report"]
