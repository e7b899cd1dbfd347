"""env.json records the machine's CPU and torch's CPU capability (issue 54: the same commit and config gave other
numbers on two x86 machines, and env.json could not say which machine a run came from; docs/findings.md)."""

from __future__ import annotations

import json

import torch


def test_env_json_records_the_cpu_and_its_capability(finished_run):
    _, out, _ = finished_run
    env = json.loads((out / "env.json").read_text())
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "cpu" in env
    assert env["cpu"] is None or (isinstance(env["cpu"], str) and env["cpu"].strip())
