"""The one work loop of every task: units of work, one record each, resumed, batched, with a progress line.

A task describes its work as a list of :class:`Unit` s, in the order they are to run, and a :class:`Work`: how the
progress line and the resume line name it, how units are batched, and the function that evaluates one batch.
:func:`run_units` does the rest, the same way for every task:

1. it reads the keys the folder already holds (``ctx.run.done_keys()``: damaged lines are the store's business)
   and drops the units whose record is there;
2. it says once how much is already done (``<task>: resuming, 3 of 12 trials already recorded``);
3. it cuts the pending units into batches: consecutive units of one ``batch`` value, at most ``batch_size`` of
   them (or the task's own :attr:`Work.batches`);
4. before the first batch of each ``group`` it calls :attr:`Work.prepare` once (the prompts of a context length,
   a window's FP pass), and hands what it returns to every batch of that group;
5. it appends each record as :attr:`Work.evaluate` yields it (a run killed mid-batch keeps what was yielded),
   checks that every unit of the batch got exactly one record of its key, and advances the progress line.

Nothing else in a task reads ``done_keys`` or appends a record (``tests/test_task_runner.py`` holds it). A unit's
record is a dict with its ``key``; what else it holds is the task's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: :attr:`Unit.tally` when left out: the unit is an item of the resume line on its own
_OWN_KEY: Any = object()


@dataclass(frozen=True)
class Unit(Generic[T]):
    """One record's worth of work.

    ``key``: the record's key. ``item``: what the task evaluates (a trial, a window and a policy, ...).
    ``batch``: units evaluated together share it (a context length and a policy); ``group``: units prepared
    together share it (:attr:`Work.prepare`; a group holds whole batches). ``steps``: how far the unit moves the
    progress bar; ``amount``: what it adds to the rate (tokens). ``tally``: what the resume line counts this unit
    as (an item is already recorded when all its units are; ``None``: not counted); the key when left out.
    """

    key: str
    item: T
    batch: Hashable = None
    group: Hashable = None
    steps: int = 1
    amount: int = 0
    tally: Hashable = field(default=_OWN_KEY)

    def __post_init__(self) -> None:
        if self.tally is _OWN_KEY:
            object.__setattr__(self, "tally", self.key)


@dataclass(frozen=True)
class Work(Generic[T]):
    """How a task's units run.

    ``label``: the progress line's name (``needle (passkey)``); ``noun``: what the resume line counts (``trials``);
    ``rate_unit``: the progress rate's unit (``tok``). ``evaluate(batch, prepared)``: yields one record per unit of
    ``batch`` (a list of units), in any order, as soon as each is ready. ``prepare(group_units)``: called with the
    pending units of a group before its first batch; what it returns is ``prepared`` (None without it).
    ``batch_size``: the most units of a batch (None: no limit), or a function of the ``batch`` value.
    ``batches``: the task's own cut of the pending units into batches, in place of the consecutive runs of one
    ``batch`` value (each batch is then a group of its own). ``amount(unit, record)``: the rate's amount of a
    finished unit, in place of :attr:`Unit.amount` (tokens only known once generated).
    """

    label: str
    noun: str
    evaluate: Callable[[list[Unit[T]], Any], Iterable[dict]]
    prepare: Callable[[list[Unit[T]]], Any] | None = None
    batch_size: int | None | Callable[[Hashable], int | None] = 1
    batches: Callable[[list[Unit[T]]], Iterable[list[Unit[T]]]] | None = None
    rate_unit: str = "tok"
    amount: Callable[[Unit[T], dict], int] | None = None


def pending_units(done: Iterable[str] | Any, units: Sequence[Unit[T]]) -> list[Unit[T]]:
    """The units of ``units`` whose key is not in ``done``, in order."""
    return [u for u in units if u.key not in done]


def resume_line(task: str, noun: str, units: Sequence[Unit], pending: Sequence[Unit]) -> str | None:
    """``<task>: resuming, N of M <noun> already recorded`` when N > 0 counted items are whole (every unit of
    theirs recorded), else None."""
    items = {u.tally for u in units if u.tally is not None}
    whole = len(items - {u.tally for u in pending})
    return f"{task}: resuming, {whole} of {len(items)} {noun} already recorded" if whole else None


def _limit(work: Work, batch: Hashable) -> int | None:
    size = work.batch_size(batch) if callable(work.batch_size) else work.batch_size
    if size is not None and size < 1:
        raise ValueError(f"batch size must be >= 1 or None; got {size}")
    return size


def batches_of(work: Work[T], pending: list[Unit[T]]) -> Iterator[tuple[Hashable, list[Unit[T]]]]:
    """``(group, batch)`` pairs: consecutive pending units of one ``batch`` value, ``batch_size`` at most (or
    :attr:`Work.batches`' cut, each batch a group of its own)."""
    if work.batches is not None:
        for i, batch in enumerate(work.batches(pending)):
            yield ("batch", i), batch
        return
    for (group, key), run in groupby(pending, key=lambda u: (u.group, u.batch)):
        units = list(run)
        size = _limit(work, key) or len(units)
        for first in range(0, len(units), size):
            yield group, units[first:first + size]


def run_units(ctx, task: str, units: Sequence[Unit[T]], work: Work[T]) -> int:
    """Run every unit of ``units`` whose record ``ctx.run`` does not hold yet (see the module docstring); returns
    how many records were appended. ``task``: the task's name, for the resume line. ``ctx``: a
    :class:`kveval.tasks.context.TaskContext` (``run``: the entry's records, ``progress``: the progress line)."""
    keys = [u.key for u in units]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{task}: two units share a record key")
    pending = pending_units(ctx.run.done_keys(), units)
    line = resume_line(task, work.noun, units, pending)
    if line is not None:
        ctx.progress.log(line)
    if not pending:
        return 0
    written = 0
    with ctx.progress.task(work.label, total=sum(u.steps for u in pending), unit=work.rate_unit) as advance:
        prepared_group: Any = object()
        prepared: Any = None
        for group, batch in batches_of(work, pending):
            if work.prepare is not None and group != prepared_group:
                mine = batch if work.batches is not None else [u for u in pending if u.group == group]
                prepared, prepared_group = work.prepare(mine), group
            expected = {u.key: u for u in batch}
            for record in work.evaluate(batch, prepared):
                unit = expected.pop(str(record.get("key")), None)
                if unit is None:
                    raise ValueError(f"{task}: a record of key {record.get('key')!r} that its batch did not ask for "
                                     "(or a second one)")
                ctx.run.append(record)
                written += 1
                advance(work.amount(unit, record) if work.amount else unit.amount, steps=unit.steps)
            if expected:
                raise ValueError(f"{task}: no record for {sorted(expected)[:3]} of its batch")
    return written


__all__ = ["Unit", "Work", "batches_of", "pending_units", "resume_line", "run_units"]
