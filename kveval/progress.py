"""Progress bars (rich) on a terminal, plain log lines with --quiet or when output is not a terminal."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from kveval.messages import print_line


class Progress:
    def __init__(self, console: Console, quiet: bool = False):
        self.console = console
        self.quiet = quiet or not console.is_terminal

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
                if t - state["last"] > 10 or state["done"] == total:
                    rate = state["units"] / max(t - start, 1e-9)
                    self.log(f"{description}: {state['done']}/{total} ({rate:,.0f} {unit}/s)")
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
                rate = units_done[0] / max(time.perf_counter() - start, 1e-9)
                bar.update(task_id, advance=steps, rate=f"{rate:,.0f} {unit}/s")

            yield advance
