"""The one unit runner of every task (kveval.tasks.common.runner): resume, batching, groups, progress, the records'
keys; and the rule that no task module reads done keys or appends records itself."""

import ast
import json
from pathlib import Path

import pytest

from kveval.results.store import RunDir
from kveval.tasks.common.runner import Unit, Work, batches_of, resume_line, run_units

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "kveval" / "tasks"


class _Log:
    def __init__(self):
        self.lines: list[str] = []
        self.advanced: list[tuple[int, int]] = []
        self.totals: list[int] = []

    def log(self, message: str) -> None:
        self.lines.append(message)

    def task(self, description, total, unit="tok"):
        from contextlib import contextmanager

        self.totals.append(total)

        @contextmanager
        def bar():
            yield lambda units=0, steps=1: self.advanced.append((units, steps))

        return bar()


class _Ctx:
    def __init__(self, folder: Path):
        self.run = RunDir.open(folder, {"name": "t"}).task_view()
        self.progress = _Log()


def _units():
    # two context lengths x two policies x three trials; batches of one (context, policy)
    return [Unit(f"k/{c}/{p}/{t}", (c, p, t), batch=(c, p), group=c, amount=c, tally=(c, t))
            for c in (8, 16) for p in ("baseline", "int4") for t in range(3)]


def _evaluate(calls):
    def evaluate(batch, prepared):
        calls.append(([u.key for u in batch], prepared))
        for u in reversed(batch):  # any order
            yield {"key": u.key, "value": u.item[2] * 10 + u.item[0]}
    return evaluate


def test_batches_are_runs_of_one_batch_value_cut_to_the_size():
    cuts = [(g, [u.key for u in b]) for g, b in batches_of(Work("x", "y", _evaluate([]), batch_size=2), _units())]
    assert cuts == [
        (8, ["k/8/baseline/0", "k/8/baseline/1"]), (8, ["k/8/baseline/2"]),
        (8, ["k/8/int4/0", "k/8/int4/1"]), (8, ["k/8/int4/2"]),
        (16, ["k/16/baseline/0", "k/16/baseline/1"]), (16, ["k/16/baseline/2"]),
        (16, ["k/16/int4/0", "k/16/int4/1"]), (16, ["k/16/int4/2"]),
    ]
    sized = Work("x", "y", _evaluate([]), batch_size=lambda b: None if b[1] == "int4" else 1)
    assert [len(b) for _, b in batches_of(sized, _units())] == [1, 1, 1, 3, 1, 1, 1, 3]


def test_a_run_writes_every_record_once_prepares_each_group_once_and_resumes(tmp_path):
    ctx, calls, prepared = _Ctx(tmp_path / "run"), [], []

    def prepare(group):
        prepared.append(sorted({u.item[0] for u in group}))
        return f"prompts of {group[0].group}"

    work = Work("demo", "trials", _evaluate(calls), prepare=prepare, batch_size=2)
    assert run_units(ctx, "demo", _units(), work) == 12
    records = ctx.run.records()
    assert sorted(r["key"] for r in records) == sorted(u.key for u in _units())
    assert {r["key"]: r["value"] for r in records}["k/16/int4/2"] == 36
    assert prepared == [[8], [16]] and {p for _, p in calls} == {"prompts of 8", "prompts of 16"}
    assert ctx.progress.totals == [12] and sum(s for _, s in ctx.progress.advanced) == 12
    assert sum(u for u, _ in ctx.progress.advanced) == 6 * 8 + 6 * 16
    assert ctx.progress.lines == []

    # a second run on the same folder: nothing to do, and says so
    again = _Ctx(tmp_path / "run")
    assert run_units(again, "demo", _units(), Work("demo", "trials", _evaluate(calls := []))) == 0
    assert calls == [] and again.progress.lines == ["demo: resuming, 6 of 6 trials already recorded"]


def test_a_resume_runs_only_the_missing_units_and_counts_whole_items(tmp_path):
    folder = tmp_path / "run"
    first = _Ctx(folder)
    units = _units()
    for u in units[:4] + units[6:7]:  # trials 0, 1 of (8, baseline); (8, int4) trial 0 of the second policy
        first.run.append({"key": u.key, "value": -1})
    ctx, calls = _Ctx(folder), []
    assert run_units(ctx, "demo", units, Work("demo", "trials", _evaluate(calls), batch_size=8)) == 7
    assert [keys for keys, _ in calls][0] == ["k/8/int4/1", "k/8/int4/2"]  # (8, baseline) is done
    # trial (8, 0) is whole (both policies); (8, 1) misses int4; the rest miss everything
    assert ctx.progress.lines == ["demo: resuming, 1 of 6 trials already recorded"]
    assert ctx.progress.totals == [7]
    assert {r["key"]: r["value"] for r in ctx.run.records()}["k/8/baseline/0"] == -1  # kept, not recomputed


def test_a_record_of_a_key_its_batch_did_not_ask_for_or_a_missing_one_stops_the_run(tmp_path):
    units = _units()[:2]

    def stray(batch, _):
        yield {"key": "k/other"}

    with pytest.raises(ValueError, match="did not ask for"):
        run_units(_Ctx(tmp_path / "a"), "demo", units, Work("demo", "trials", stray))

    def short(batch, _):
        return []

    with pytest.raises(ValueError, match="no record for"):
        run_units(_Ctx(tmp_path / "b"), "demo", units, Work("demo", "trials", short))
    with pytest.raises(ValueError, match="share a record key"):
        run_units(_Ctx(tmp_path / "c"), "demo", units + units[:1], Work("demo", "trials", short))


def test_a_run_killed_mid_batch_keeps_what_was_yielded(tmp_path):
    folder = tmp_path / "run"

    def dies(batch, _):
        yield {"key": batch[0].key, "value": 1}
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_units(_Ctx(folder), "demo", _units(), Work("demo", "trials", dies, batch_size=3))
    kept = [json.loads(line)["key"] for line in (folder / "records.jsonl").read_text().splitlines()]
    assert kept == ["k/8/baseline/0"]


def test_the_task_s_own_cut_and_units_that_count_for_nothing():
    units = [Unit("a", 1, tally=None), Unit("b", 1), Unit("c", 2)]
    work = Work("x", "cells", _evaluate([]), batches=lambda pending: [pending[:2], pending[2:]])
    assert [[u.key for u in b] for _, b in batches_of(work, units)] == [["a", "b"], ["c"]]
    assert resume_line("x", "cells", units, units[1:]) is None  # "a" is done but counts for nothing
    assert resume_line("x", "cells", units, units[2:]) == "x: resuming, 1 of 2 cells already recorded"


def _calls_in(path: Path) -> set[str]:
    """Attribute names called in ``path`` (``x.done_keys()`` -> ``done_keys``), with the receiver's text."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            out.add(f"{ast.unparse(node.func.value)}.{node.func.attr}")
    return out


def test_no_task_module_reads_done_keys_or_appends_records_itself():
    """The unit runner owns resume and appending: a task yields its records."""
    offenders = []
    for path in sorted(TASKS.rglob("*.py")):
        if path == TASKS / "common" / "runner.py":
            continue
        for call in _calls_in(path):
            if call.endswith(".done_keys") or call.endswith("run.append"):
                offenders.append(f"{path.relative_to(ROOT)}: {call}()")
    assert offenders == []
    # and the rule is not vacuous: the runner itself does both
    assert {"ctx.run.done_keys", "ctx.run.append"} <= _calls_in(TASKS / "common" / "runner.py")
