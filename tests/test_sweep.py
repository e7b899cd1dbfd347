"""``kveval sweep``: grid expansion (pure), validation of every run before anything starts, and sweeps on a local
Ray with tiny models: a failing run reported while the others finish, a run killed midway (SIGKILL of its
``kveval run`` process) resumed by a rerun to the metrics of an uninterrupted run, finished runs skipped.

The Ray tests share one local Ray session (a module fixture: starting Ray takes seconds) and are skipped, with the
reason, where ray is not installed (``pip install 'kveval[sweep]'``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml
from sweep_reference import uninterrupted_metrics
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.sweep import finished_before
from kveval.errors import KvevalError
from kveval.models import smollm2_gguf
from kveval.sweep.expand import SweepFile, expand, label_of
from kveval.sweep.load import load_sweep, resolved_yaml
from kveval.sweep.runner import error_line

TASK = {"perplexity": {"seq_len": 32, "max_tokens": 96, "bootstrap": 20, "noise_windows": 0}}


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _sweep(tmp_path: Path, **extra) -> dict:
    return {"name": "s", "output": str(tmp_path / "sweep"), "base": {"data": "builtin", "tasks": [TASK]}, **extra}


# --------------------------------------------------------------------------------------------- expansion (no Ray)


def test_grid_expands_models_x_policies_x_tasks_with_names_from_labels():
    sweep = SweepFile.model_validate({
        "name": "g", "grid": {"models": ["builtin:tiny-llama", {"name": "builtin:tiny-gemma3", "dtype": "float64"}],
                              "policies": {"eight": ["int8"], "mixed": {"policies": {"k4v8": {"key": "int4_g32",
                                                                                             "value": "int8"}}}},
                              "tasks": {"short": [TASK], "quick": "ppl_quick"}}})
    runs = expand(sweep, {"model": {"dtype": "float32", "device": "cpu"}, "seed": 3}, [])
    assert [r.name for r in runs] == [
        "tiny-llama__eight__short", "tiny-llama__eight__quick", "tiny-llama__mixed__short", "tiny-llama__mixed__quick",
        "tiny-gemma3__eight__short", "tiny-gemma3__eight__quick", "tiny-gemma3__mixed__short",
        "tiny-gemma3__mixed__quick"]
    gemma = runs[4].raw
    assert gemma["model"] == {"dtype": "float64", "device": "cpu", "name": "builtin:tiny-gemma3"}  # merged on base
    assert gemma["seed"] == 3 and gemma["kv"] == ["int8"] and gemma["tasks"] == [TASK]
    assert runs[1].raw["tasks"] == ["ppl_quick"] and runs[1].axes == {"model": "tiny-llama", "policies": "eight",
                                                                     "tasks": "quick"}


@pytest.mark.parametrize(("value", "label"), [
    ("builtin:tiny-llama", "tiny-llama"), ("HuggingFaceTB/SmolLM2-135M", "SmolLM2-135M"),
    ("/models/x/model.Q8_0.gguf", "model.Q8_0"), ({"name": "org/My Model"}, "My_Model"), (["int8"], None),
])
def test_labels_of_unlabelled_values(value, label):
    assert label_of(value) == label


def test_overrides_apply_in_order_sweep_then_run_then_command_line(tmp_path):
    _write(tmp_path / "one.yaml", {"name": "ignored", "model": "builtin:tiny-llama", "kv": ["int8"], "tasks": [TASK],
                                   "output": "elsewhere"})
    path = _write(tmp_path / "s.yaml", _sweep(tmp_path, set=["seed=5", "tasks[0].perplexity.max_tokens=64"], runs=[
        {"config": str(tmp_path / "one.yaml"), "set": ["seed=6"]},
        {"name": "inline", "config": {"model": "builtin:tiny-gemma3", "kv": ["int4_g32"]}}]))
    plan = load_sweep(path, ["tasks[0].perplexity.seq_len=16"])
    one, inline = plan.runs
    assert (one.name, inline.name) == ("one", "inline")
    assert one.cfg.seed == 6 and inline.cfg.seed == 5
    assert one.cfg.tasks[0].params.max_tokens == 64 and inline.cfg.tasks[0].params.seq_len == 16
    assert one.cfg.name == "one" and one.folder == tmp_path / "sweep" / "runs" / "one"  # the sweep places runs
    assert one.resolved["output"] == str(tmp_path / "sweep" / "runs" / "one")


@pytest.mark.parametrize(("extra", "needle"), [
    ({"grid": {"models": ["builtin:tiny-llama", "./x/tiny-llama"], "policies": ["int8"]}},
     "two runs are named 'tiny-llama__int8'"),
    ({"grid": {"models": {"a": "builtin:tiny-llama", "b": "builtin:tiny-llama"}, "policies": ["int8"]}},
     "runs 'a__int8' and 'b__int8' are the same experiment"),
    ({"grid": {"models": ["builtin:tiny-llama"], "policies": [["int8", "int4_g32"]]}},
     "grid.policies[0]: this entry needs a label"),
    ({"grid": {"models": ["builtin:tiny-llama"], "polices": ["int8"]}}, "grid.polices: unknown key; did you mean "
                                                                         "'policies'?"),
    ({"grid": {"models": ["builtin:tiny-llama"], "policies": ["int8"]}, "resources": {"memory": "lots"}},
     "resources.memory: bad memory size"),
    ({}, "a sweep needs a grid"),
    ({"grid": {"models": ["builtin:tiny-llama"], "policies": ["int8"]}, "base": {"output": "x", "tasks": [TASK]}},
     "base.output: the sweep names each run"),
    ({"grid": {"models": ["builtin:tiny-llama"], "policies": ["int4_g48"]}},
     "run 'tiny-llama__int4_g48' (grid): unknown KV policy 'int4_g48'"),
    ({"grid": {"models": ["builtin:tiny-llama"], "policies": ["int8"]}, "set": ["tasks[0].perplexity.seq_len=4096"]},
     "seq_len 4096 is longer than the model's context"),
])
def test_bad_sweeps_are_one_line_before_anything_starts(tmp_path, extra, needle):
    """Every run's config goes through kveval run's loader (schema, then what it names on this machine); the
    first problem is one line naming the sweep file and the run, exit status 2, and nothing is written."""
    data = _sweep(tmp_path, **extra)
    if "base" in extra:
        data["base"] = extra["base"]
    path = _write(tmp_path / "s.yaml", data)
    with pytest.raises(KvevalError) as info:
        load_sweep(path)
    assert needle in str(info.value) and str(info.value).startswith(str(path)), str(info.value)
    result = CliRunner().invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert [line for line in result.stderr.splitlines() if line.strip()] == [f"error: {info.value}"]
    assert not (tmp_path / "sweep").exists()


def test_an_unreachable_cluster_is_one_line(tmp_path):
    """Ray retries an address that answers nothing for minutes; the sweep says so at once."""
    pytest.importorskip("ray", reason="kveval sweep needs ray: pip install 'kveval[sweep]'")
    path = _write(tmp_path / "s.yaml", _sweep(tmp_path, grid={"models": ["builtin:tiny-llama"], "policies": ["int8"]}))
    index = tmp_path / "sweep" / "sweep.json"  # what an earlier sweep recorded (a failed run, its error)
    index.parent.mkdir()
    earlier = json.dumps({"sweep": "s", "runs": [{"name": "tiny-llama__int8", "status": "failed", "error": "x"}]})
    index.write_text(earlier)
    result = CliRunner().invoke(app, ["sweep", str(path), "--address", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: cannot reach the Ray cluster at 127.0.0.1:1 (Connection refused)")
    assert index.read_text() == earlier


@pytest.mark.parametrize(("where", "override", "needle"), [
    ("command line", "output=/tmp/elsewhere", "-s output=/tmp/elsewhere: the sweep names each run and puts it in "
                                              "<sweep folder>/runs/<run>, so every run would get this output; set "
                                              "the sweep's folder with -o DIR on the command line"),
    ("command line", "name = same", "-s name = same: the sweep names each run and puts it in <sweep folder>/runs/"
                                    "<run>, so every run would get this name; a run's name comes from its grid "
                                    "labels or its runs[].name"),
    ("sweep set", "output=x", "run 'tiny-llama__int8' (grid): set: output=x: the sweep names each run"),
    ("run set", "name=x", "run 'one' (runs[0]): set: name=x: the sweep names each run"),
])
def test_an_override_of_what_the_sweep_owns_is_one_line(tmp_path, where, override, needle):
    """`kveval sweep S -s output=DIR` (meaning the sweep's folder) put every run into DIR: each run then found the
    folder locked by another, or holding another run's config. A run's name and output are the sweep's; the line
    says to use -o."""
    data = _sweep(tmp_path, **({"runs": [{"name": "one", "config": {"model": "builtin:tiny-llama", "kv": ["int8"]},
                                          "set": [override]}]} if where == "run set" else
                               {"grid": {"models": ["builtin:tiny-llama"], "policies": ["int8"]}}))
    if where == "sweep set":
        data["set"] = [override]
    path = _write(tmp_path / "s.yaml", data)
    result = CliRunner().invoke(app, ["sweep", str(path), "--dry-run",
                                      *(["-s", override] if where == "command line" else [])])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert needle in line and "Traceback" not in result.output, line
    assert not (tmp_path / "sweep").exists()


def test_output_option_moves_the_whole_sweep_and_is_in_its_command(tmp_path):
    path = _write(tmp_path / "s.yaml", _sweep(tmp_path, grid={"models": ["builtin:tiny-llama"], "policies": ["int8"]}))
    plan = load_sweep(path, output=str(tmp_path / "other folder"))
    assert plan.output == tmp_path / "other folder"
    assert [r.folder for r in plan.runs] == [tmp_path / "other folder" / "runs" / "tiny-llama__int8"]
    result = CliRunner().invoke(app, ["sweep", str(path), "--dry-run", "-o", str(tmp_path / "other folder")])
    assert result.exit_code == 0 and "other folder" in result.output, result.output


def test_dry_run_lists_the_runs_and_starts_nothing(tmp_path):
    path = _write(tmp_path / "s.yaml", _sweep(tmp_path, grid={"models": ["builtin:tiny-llama", "builtin:tiny-gemma3"],
                                                              "policies": ["int8", "int4_g32"]}))
    result = CliRunner().invoke(app, ["sweep", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.count("to run") == 4 and "tiny-gemma3__int4_g32" in result.output
    assert not (tmp_path / "sweep").exists()


def test_a_run_lost_after_its_metrics_is_run_again_and_resumes_to_its_report(tmp_path):
    """A run whose ``kveval run`` was lost between its metrics.json and its report (its node went down; CI saw it
    on the two-node cluster) is not skipped by the next sweep when the last sweep.json says it failed; run again,
    it resumes from its records (none recomputed) and writes its report. Without that entry (a run finished by
    hand) metrics.json alone still counts as finished."""
    path = _write(tmp_path / "s.yaml", _sweep(tmp_path, runs=[
        {"name": "a", "config": {"model": "builtin:tiny-llama", "kv": ["int8"]}}]))
    (run,) = load_sweep(path).runs
    config = _write(tmp_path / "a.yaml", {**yaml.safe_load(resolved_yaml(run.resolved)), "output": str(run.folder)})
    first = CliRunner().invoke(app, ["run", str(config), "-q"])
    assert first.exit_code == 0, first.output
    records = (run.folder / "records.jsonl").read_bytes()
    metrics = json.loads((run.folder / "metrics.json").read_text())
    for name in ("report.md", "report.html"):  # lost while drawing the report
        (run.folder / name).unlink()

    dry = CliRunner().invoke(app, ["sweep", str(path), "--dry-run"])
    assert dry.exit_code == 0 and "finished (would skip)" in dry.output, dry.output  # no sweep.json: metrics count
    sweep_json = tmp_path / "sweep" / "sweep.json"
    for status, state in (("failed", "to run"), ("interrupted", "to run"), ("finished", "finished (would skip)")):
        sweep_json.write_text(json.dumps({"runs": [{"name": "a", "status": status, "returncode": 0}]}))
        dry = CliRunner().invoke(app, ["sweep", str(path), "--dry-run"])
        assert dry.exit_code == 0 and state in dry.output, (status, dry.output)
        assert finished_before(run, {"status": status}) == (state != "to run")

    again = CliRunner().invoke(app, ["run", str(config), "-q"])  # what the sweep's task runs
    assert again.exit_code == 0, again.output
    assert (run.folder / "records.jsonl").read_bytes() == records  # resumed: nothing recomputed
    assert json.loads((run.folder / "metrics.json").read_text())["policies"] == metrics["policies"]
    assert (run.folder / "report.md").is_file() and (run.folder / "report.html").is_file()


@pytest.mark.parametrize(("log", "rc", "line"), [
    ("kveval t: loading\nerror: policy 'g': group_size 64 does not divide head_dim 32\n", 2,
     "policy 'g': group_size 64 does not divide head_dim 32"),
    ("Traceback (most recent call last):\n  File x\nRuntimeError: boom\n", 1, "RuntimeError: boom"),
    ("perplexity: 3/10\n", -9, "killed by SIGKILL; rerun the sweep to resume it"),
    ("", 130, "interrupted; rerun the sweep to resume it"),
])
def test_the_error_line_of_a_failed_run(log, rc, line):
    assert error_line(log, rc) == line


# --------------------------------------------------------------------------------------------- on Ray


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray (2 CPUs) for every test of this module; skipped where ray is not installed."""
    pytest.importorskip("ray", reason="kveval sweep needs ray: pip install 'kveval[sweep]'")
    from kveval.sweep.runner import ray_session

    with ray_session(num_cpus=2) as ray:
        yield ray


def _kill_when_recording(folder: Path, min_records: int, killed: dict) -> None:
    """SIGKILL the ``kveval run`` process that holds ``folder`` once its records.jsonl has ``min_records`` lines
    (the pid is the one its lock file names); records what was on disk just after."""
    deadline = time.monotonic() + 300
    records = folder / "records.jsonl"
    while time.monotonic() < deadline:
        try:
            lines = records.read_text().count("\n") if records.exists() else 0
            if lines >= min_records:
                pid = json.loads((folder / ".kveval.lock").read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.5)
                killed.update(pid=pid, records=records.read_text().splitlines(), metrics=(folder / "metrics.json")
                              .exists())
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)


def test_failed_and_killed_runs_are_reported_then_resumed_and_finished_runs_skipped(tmp_path, ray_local):
    """Sweep 1: a good run finishes, a run with a group size the model cannot take fails at model time with its
    one-line error (a GGUF file: its shape is known only once loaded, so kveval validate cannot refuse it first), a run killed midway (SIGKILL) is reported killed; exit status 1, sweep.json and the report
    say so. Sweep 2 (the same command): the finished run is skipped, the killed run resumes from its records to
    exactly the metrics of an uninterrupted run, the bad run fails again."""
    long_task = {"perplexity": {"seq_len": 64, "max_tokens": 8192, "bootstrap": 20, "noise_windows": 0}}
    path = _write(tmp_path / "s.yaml", _sweep(tmp_path, runs=[
        {"name": "good", "config": {"model": "builtin:tiny-gemma3", "kv": ["int8"]}},
        {"name": "bad_group", "config": {"model": str(smollm2_gguf()), "kv": ["int4_g128"]}},
        {"name": "killed", "config": {"model": "builtin:tiny-llama", "kv": ["int4_g32"], "tasks": [long_task]}},
    ]))
    sweep = tmp_path / "sweep"
    killed: dict = {}
    killer = threading.Thread(target=_kill_when_recording, args=(sweep / "runs" / "killed", 8, killed), daemon=True)
    killer.start()
    first = CliRunner().invoke(app, ["sweep", str(path)])
    killer.join(timeout=5)
    assert first.exit_code == 1, first.output
    assert killed and not killed["metrics"], "the run finished before it could be killed"
    index = json.loads((sweep / "sweep.json").read_text())
    status = {r["name"]: (r["status"], r["error"]) for r in index["runs"]}
    assert status["good"] == ("finished", None)
    import ray

    nodes = {r["node"] for r in index["runs"] if r["status"] == "finished"}
    assert nodes == {ray.get_runtime_context().get_node_id()}  # the Ray node each run ran on (one here)
    assert status["bad_group"] == ("failed", "policy 'int4_g128': group_size 128 does not divide head_dim 64")
    assert status["killed"] == ("failed", "killed by SIGKILL; rerun the sweep to resume it")
    assert index["counts"] == {"finished": 1, "failed": 2}
    report = (sweep / "report.md").read_text()
    assert "| good | builtin:tiny-gemma3 | int8 | int8 | 8.50 |" in report  # a listed run: its model and policies
    assert "bad_group: failed: policy 'int4_g128'" in report and (sweep / "plots" / "quality_vs_memory.png").is_file()
    assert "good" in (sweep / "tables" / "sweep_summary.csv").read_text()
    good_metrics = (sweep / "runs" / "good" / "metrics.json").read_bytes()
    good_wall = next(r["wall_s"] for r in index["runs"] if r["name"] == "good")

    second = CliRunner().invoke(app, ["sweep", str(path)])
    assert second.exit_code == 1, second.output
    index = json.loads((sweep / "sweep.json").read_text())
    status = {r["name"]: r["status"] for r in index["runs"]}
    assert status == {"good": "skipped", "bad_group": "failed", "killed": "finished"}
    assert (sweep / "runs" / "good" / "metrics.json").read_bytes() == good_metrics  # not rerun
    assert next(r["wall_s"] for r in index["runs"] if r["name"] == "good") == good_wall > 0  # its first sweep's
    records = (sweep / "runs" / "killed" / "records.jsonl").read_text().splitlines()
    whole_before = [line for line in killed["records"] if line.endswith("}")][:-1]  # the last may have been torn
    assert records[: len(whole_before)] == whole_before  # kept, not recomputed
    keys = [json.loads(line)["key"] for line in records]  # a torn last line was cut before the resume appended
    assert len(keys) == len(set(keys)) > len(whole_before)  # each unit of work once

    # the same run, uninterrupted, in this process with the thread count Ray gave the run (1 CPU)
    expected = uninterrupted_metrics(sweep / "configs" / "killed.yaml", tmp_path / "reference")
    resumed = json.loads((sweep / "runs" / "killed" / "metrics.json").read_text())
    for section in ("baseline", "policies"):
        got, want = resumed[section], json.loads(json.dumps(expected[section]))
        if section == "policies":
            got, want = got["int4_g32"], want["int4_g32"]
        for key in ("ppl", "delta_ppl_pct", "kld_mean", "kld_ci95", "top1_agree", "tokens"):
            if key in want:
                assert got[key] == want[key], (section, key)


def test_ctrl_c_stops_the_runs_cleanly_and_exits_130(tmp_path, ray_local):
    """SIGINT to a ``kveval sweep`` process (its own local Ray) while a run works: the run's ``kveval run`` gets
    the clean interrupt too (its log ends with kveval's "interrupted" line: Ray's workers block SIGINT, which the
    runner unblocks for its children), the sweep exits 130 with kveval's one line, sweep.json marks the run
    interrupted, and no process holds the run's folder any more."""
    import subprocess
    import sys

    from kveval.results.lock import holder

    long_task = {"perplexity": {"seq_len": 64, "max_tokens": 65536, "bootstrap": 20, "noise_windows": 0}}
    path = _write(tmp_path / "s.yaml", _sweep(tmp_path, ray={"num_cpus": 1}, runs=[
        {"name": "long", "config": {"model": "builtin:tiny-llama", "kv": ["int8"], "tasks": [long_task]}}]))
    folder = tmp_path / "sweep" / "runs" / "long"
    # SIGINT as a terminal gives it, even where this test runs in a background job (which ignores SIGINT)
    sweep = subprocess.Popen([sys.executable, "-m", "kveval", "sweep", str(path), "--quiet"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and sweep.poll() is None:
        records = folder / "records.jsonl"
        if records.exists() and records.read_text().count("\n") >= 4:
            break
        time.sleep(0.05)
    sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, (out, err)
    assert [line for line in err.splitlines() if line.strip()][-1].startswith("interrupted; rerun the same command")
    entry = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"][0]
    assert entry["status"] == "interrupted" and "rerun it to resume" in entry["error"]
    log = (tmp_path / "sweep" / "logs" / "long.log").read_text().strip().splitlines()
    assert log[-1].startswith("interrupted; rerun the same command")  # kveval run's own clean exit
    assert holder(folder) is None and not (folder / "metrics.json").exists()


def test_a_local_sweep_starts_its_own_ray_whatever_a_stale_cluster_file_says(monkeypatch):
    """A Ray killed earlier leaves /tmp/ray/ray_current_cluster; `ray.init()` without an address would try to join
    that dead cluster (and refuse num_cpus): a local session asks for address "local"."""
    ray = pytest.importorskip("ray")
    from kveval.sweep import runner

    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(KvevalError, match="cannot start a local Ray: stop here"):
        with runner.ray_session(num_cpus=1):
            pass
    assert calls and calls[0]["address"] == "local" and calls[0]["num_cpus"] == 1
