"""A resumed run's report states the whole run's time (issue 53: after a resume the report said "Run: ..., 0 s")."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta

from test_run import tiny_config

from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.report.render import _duration
from kveval.results.store import RunDir


def test_a_resumed_run_adds_its_parts_and_keeps_the_first_start(tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(out, max_tokens=192)
    run_experiment(validate(cfg), quiet=True)
    first = json.loads((out / "env.json").read_text())
    assert first["parts"] == 1 and first["first_started"] == first["started"]
    # the first part as if it had taken 10 minutes (a real one: too slow for a test)
    first["started"] = (datetime.fromisoformat(first["finished"]) - timedelta(minutes=10)).isoformat()
    first["first_started"], first["seconds"] = first["started"], 600.0
    (out / "env.json").write_text(json.dumps(first))
    run_experiment(validate(cfg), quiet=True)  # everything recorded: the resumed part takes seconds
    env = json.loads((out / "env.json").read_text())
    this = (datetime.fromisoformat(env["finished"]) - datetime.fromisoformat(env["started"])).total_seconds()
    assert env["parts"] == 2 and env["first_started"] == first["started"]
    assert abs(env["seconds"] - (600.0 + this)) < 1e-2
    line = _duration(env)
    assert line.startswith(f"Run: {datetime.fromisoformat(first['started']):%Y-%m-%d %H:%M} UTC, 10.")
    assert "in 2 parts (the last, resumed: " in line
    assert line in (out / "report.md").read_text()


def test_an_interrupted_part_counts_until_its_last_record(tmp_path):
    run = RunDir(tmp_path)
    started = datetime(2026, 1, 1, 12, 0, 0).astimezone()
    (tmp_path / "env.json").write_text(json.dumps({"started": started.isoformat(), "finished": None}))
    (tmp_path / "records.jsonl").write_text("{}\n")
    t = (started + timedelta(seconds=90)).timestamp()
    os.utime(tmp_path / "records.jsonl", (t, t))
    before = run.worked_before()
    assert before == {"first_started": started.isoformat(), "seconds": 90.0, "parts": 1}


def test_an_unreadable_env_is_a_new_run(tmp_path):
    run = RunDir(tmp_path)
    assert run.worked_before() == {}
    (tmp_path / "env.json").write_text("{not json")
    assert run.worked_before() == {}
    os.remove(tmp_path / "env.json")
    os.mkfifo(tmp_path / "env.json")  # never opened: read_regular_bytes refuses it before it blocks
    assert run.worked_before() == {}
    os.remove(tmp_path / "env.json")
    (tmp_path / "env.json").write_text(json.dumps({"started": "2026-01-01T00:00:00+00:00", "finished": None,
                                                   "seconds": -5, "parts": True}))
    assert run.worked_before() == {"first_started": "2026-01-01T00:00:00+00:00", "seconds": 0.0, "parts": 1}
    (tmp_path / "env.json").write_text(json.dumps({"started": "2026-01-01T00:00:00+00:00", "finished": None,
                                                   "seconds": 1e300, "parts": 10**30, "first_started": 7}))
    assert run.worked_before() == {"first_started": "2026-01-01T00:00:00+00:00", "seconds": 0.0, "parts": 1}
