"""Progress bars (rich) on a terminal, plain log lines every 10 s when output is not a terminal, and with --quiet
one closing line per task (its count, rate and nothing in between)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from kveval.messages import print_line


def rate_text(units: float, seconds: float, unit: str) -> str:
    """A rate that never rounds to 0: ``1,500 tok/s``, ``4.2 turn/s``, below one a second ``12 cell/min``,
    below one a minute ``3.1 min/cell``; ``-`` before any unit is done."""
    if units <= 0 or seconds <= 0:
        return f"- {unit}/s"
    per_s = units / seconds
    if per_s >= 10:
        return f"{per_s:,.0f} {unit}/s"
    if per_s >= 1:
        return f"{per_s:.1f} {unit}/s"
    if per_s * 60 >= 1:
        return f"{per_s * 60:.1f} {unit}/min"
    return f"{seconds / units / 60:.1f} min/{unit}"


def time_left(done: int, total: int, seconds: float) -> str:
    """``12 min 30 s left`` (at the rate so far), ``""`` before any step is done or after the last."""
    if done <= 0 or done >= total or seconds <= 0:
        return ""
    left = seconds * (total - done) / done
    minutes, secs = divmod(int(round(left)), 60)
    hours, minutes = divmod(minutes, 60)
    text = f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s" if minutes else f"{secs} s"
    return f", {text} left"


class Progress:
    def __init__(self, console: Console, quiet: bool = False):
        self.console = console
        self.quiet = quiet or not console.is_terminal  # plain lines, no bar
        self.closing_only = quiet  # --quiet: a task's last line alone

    def log(self, message: str) -> None:
        print_line(self.console, message)

    @contextmanager
    def task(self, description: str, total: int, unit: str = "tok"):
        """Yields ``advance(n_units, steps=1)``; shows units/s and the ETA."""
        if self.quiet:
            start = time.perf_counter()
            state = {"done": 0, "units": 0, "last": start}

            def advance(units: int = 0, steps: int = 1):
                state["done"] += steps
                state["units"] += units
                t = time.perf_counter()
                if state["done"] == total or (t - state["last"] > 10 and not self.closing_only):
                    rate = rate_text(state["units"], t - start, unit)
                    self.log(f"{description}: {state['done']}/{total} ({rate}"
                             f"{time_left(state['done'], total, t - start)})")
                    state["last"] = t

            yield advance
            return
        columns = [
            TextColumn("{task.description}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}", markup=False), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        ]
        with RichProgress(*columns, console=self.console, transient=False) as bar:
            task_id = bar.add_task(description, total=total, rate="")
            start = time.perf_counter()
            units_done = [0]

            def advance(units: int = 0, steps: int = 1):
                units_done[0] += units
                bar.update(task_id, advance=steps, rate=rate_text(units_done[0], time.perf_counter() - start, unit))

            yield advance
