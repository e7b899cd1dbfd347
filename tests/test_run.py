"""`kveval run` end to end on a tiny model: results folder, independent PPL check, resume after SIGKILL,
determinism, bad input (one line, exit 2, nothing recorded lost)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.data import load_tokens, token_windows
from kveval.models import load_model

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(out: Path, **ppl) -> dict:
    params = {"seq_len": 64, "max_tokens": 640, "bootstrap": 200, "noise_windows": 1, **ppl}
    return {
        "name": "tiny",
        "model": "builtin:tiny-llama",
        "data": "builtin",
        "kv": ["int8", "int2_g32"],
        "tasks": [{"perplexity": params}],
        "output": str(out),
    }


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_run_writes_results_folder(tmp_path):
    out = tmp_path / "run"
    metrics = run_experiment(validate(tiny_config(out)), quiet=True)
    for name in ("config.resolved.yaml", "env.json", "records.jsonl", "metrics.json"):
        assert (out / name).is_file(), name
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert on_disk["run"] == "tiny" and on_disk["model"] == "builtin:tiny-llama"
    for name in ("int8", "int2_g32"):
        p = on_disk["policies"][name]
        for field in ("ppl", "delta_ppl", "delta_ppl_pct", "kld_mean", "kld_ci95", "top1_agree", "verdict"):
            assert field in p, field
        assert p["kld_ci95"][0] <= p["kld_mean"] <= p["kld_ci95"][1]
        assert len(p["loss_by_position"]) == 8 and p["layers_quantized"] == 4
    pol = on_disk["policies"]
    assert pol["int2_g32"]["kld_mean"] > pol["int8"]["kld_mean"] > 0
    assert pol["int8"]["top1_agree"] > pol["int2_g32"]["top1_agree"]
    env = json.loads((out / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["finished"]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    tokens = load_tokens("builtin", load_model("builtin:tiny-llama")[1])
    n_windows = len(list(token_windows(tokens, 64, max_tokens=640)))
    assert sum(r["task"] == "perplexity" for r in records) == n_windows * 3  # baseline + 2 policies per window
    assert sum(r["task"] == "perplexity_noise" for r in records) == 3  # one noise window, 3 paths
    assert len({r["key"] for r in records}) == len(records)


@pytest.mark.parametrize("stride,start", [(None, 0), (24, 0), (None, 1000)])
def test_baseline_ppl_equals_plain_hf_loss(tmp_path, stride, start):
    out = tmp_path / "run"
    cfg = validate(tiny_config(out, stride=stride, max_tokens=400, start_token=start))
    metrics = run_experiment(cfg, quiet=True)
    model, tok = load_model("builtin:tiny-llama")
    tokens = load_tokens("builtin", tok)[start:]
    starts = [r["start"] for r in _records(out) if r.get("task") == "perplexity"]
    assert min(starts) == start and max(starts) < start + 400  # records hold corpus positions
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in token_windows(tokens, 64, stride=stride, max_tokens=400):
            labels = w.input_ids.clone()
            labels[: w.score_from] = -100
            loss = model(w.input_ids[None], labels=labels[None]).loss
            nll += float(loss) * w.n_scored
            n += w.n_scored
    independent = float(torch.tensor(nll / n, dtype=torch.float64).exp())
    assert metrics["baseline"]["tokens"] == n
    assert abs(metrics["baseline"]["ppl"] / independent - 1) < 1e-5


def test_same_config_same_metrics_and_rerun_skips(tmp_path):
    a = run_experiment(validate(tiny_config(tmp_path / "a")), quiet=True)
    b = run_experiment(validate(tiny_config(tmp_path / "b")), quiet=True)
    assert a["policies"] == b["policies"] and a["baseline"] == b["baseline"]
    lines = (tmp_path / "a" / "records.jsonl").read_text()
    again = run_experiment(validate(tiny_config(tmp_path / "a")), quiet=True)
    assert (tmp_path / "a" / "records.jsonl").read_text() == lines, "a rerun of a finished run records nothing new"
    assert again["policies"] == a["policies"]


def _cli(args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kveval", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def test_resume_after_sigkill_equals_uninterrupted(tmp_path):
    big = {"max_tokens": 64 * 120}
    cfg_path = write(tmp_path / "c.yaml", tiny_config(tmp_path / "killed", **big))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kveval", "run", str(cfg_path), "--quiet"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    records = tmp_path / "killed" / "records.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:
        if records.exists() and records.read_text().count("\n") >= 30:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = records.read_text().count("\n")
    assert 30 <= partial < 121 * 3, "the run was killed part-way"
    assert not (tmp_path / "killed" / "metrics.json").exists()

    done = _cli(["run", str(cfg_path), "--quiet"])
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stdout
    keys = [json.loads(line)["key"] for line in records.read_text().splitlines()]
    assert len(keys) == len(set(keys)), "no record is duplicated"

    clean = run_experiment(validate(tiny_config(tmp_path / "clean", **big)), quiet=True)
    resumed = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    assert resumed == json.loads(json.dumps(clean))


def _one_line_exit_2(result, *needles):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def finished_run(tmp_path):
    out = tmp_path / "run"
    path = write(tmp_path / "c.yaml", tiny_config(out, max_tokens=200))
    run_experiment(validate(tiny_config(out, max_tokens=200)), quiet=True)
    return path, out, (out / "records.jsonl").read_text()


def test_bad_input_unknown_preset(tmp_path):
    cfg = tiny_config(tmp_path / "x")
    cfg["kv"] = ["int4_g46"]
    result = CliRunner().invoke(app, ["run", str(write(tmp_path / "c.yaml", cfg))])
    _one_line_exit_2(result, "int4_g46", "did you mean")


def test_bad_input_dataset_offline(tmp_path, monkeypatch, finished_run):
    path, out, before = finished_run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    result = CliRunner().invoke(app, ["run", str(path), "-s", "data.source=wikitext2", "--overwrite"])
    _one_line_exit_2(result, "wikitext2")
    assert (out / "records.jsonl").read_text() == before, "nothing recorded is lost"


def test_bad_input_seq_len_beyond_context(finished_run):
    path, out, before = finished_run
    cfg = yaml.safe_load(path.read_text())
    cfg["tasks"][0]["perplexity"]["seq_len"] = 4096
    result = CliRunner().invoke(app, ["run", str(write(path, cfg)), "--overwrite"])
    _one_line_exit_2(result, "seq_len 4096", "2048")
    assert (out / "records.jsonl").read_text() == before, "nothing recorded is lost"


def test_bad_input_output_holds_other_config(finished_run):
    path, out, before = finished_run
    result = CliRunner().invoke(app, ["run", str(path), "-s", "seed=7"])
    _one_line_exit_2(result, "different config", "--overwrite")
    assert (out / "records.jsonl").read_text() == before, "nothing recorded is lost"


def test_cli_validate_and_ls():
    result = CliRunner().invoke(app, ["validate", str(ROOT / "configs" / "int4_g64.yaml")])
    assert result.exit_code == 0 and "ok" in result.output
    listed = ""
    for kind in ("presets", "formats", "models", "tasks"):
        result = CliRunner().invoke(app, ["ls", kind])
        assert result.exit_code == 0
        listed += result.output
    for name in ("kivi2", "q4_0", "int4_g64", "builtin:smollm2-135m", "perplexity", "ppl_quick"):
        assert name in listed


def test_missing_config_file_is_one_line():
    _one_line_exit_2(CliRunner().invoke(app, ["run", "nope.yaml"]), "nope.yaml")


@pytest.mark.integration
def test_main_job_on_builtin_model(tmp_path):
    """The README's main job, shortened: INT8 barely moves PPL, INT2 breaks it (sanity of the signal)."""
    cfg = yaml.safe_load((ROOT / "configs" / "int4_g64.yaml").read_text())
    cfg["kv"] = ["int8", "int2_g32"]
    cfg["tasks"] = [{"perplexity": {"seq_len": 512, "max_tokens": 1024}}]
    cfg["output"] = str(tmp_path / "main")
    metrics = run_experiment(validate(cfg), quiet=True)
    assert 8 < metrics["baseline"]["ppl"] < 30
    assert abs(metrics["policies"]["int8"]["delta_ppl_pct"]) < 0.5
    assert metrics["policies"]["int2_g32"]["delta_ppl_pct"] > 50




def test_a_dependency_outside_the_tested_range_is_named_in_the_run(tmp_path, monkeypatch, capsys):
    """transformers beyond kveval's bound (installed by hand, ``--no-deps``) may change the cache layers kveval
    subclasses: the run says so on stderr and in env.json, and still runs."""
    import importlib.metadata

    import transformers

    from kveval.results.store import untested_dependencies

    have = transformers.__version__
    assert untested_dependencies([f"transformers>={have}", "torch>=2.4", f'transformers<{have}; extra == "x"',
                                  "not-a-package-kveval-needs>=1"]) == []
    below = f"transformers<{have}"
    assert untested_dependencies([below]) == [f"transformers {have} is outside kveval's tested range <{have}"]
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: [below] if name == "kveval" else [])
    out = tmp_path / "run"
    run_experiment(validate({**tiny_config(out), "kv": ["int8"]}), quiet=True)
    assert f"transformers {have} is outside kveval's tested range" in capsys.readouterr().err
    env = json.loads((out / "env.json").read_text())
    assert env["untested_dependencies"] == [f"transformers {have} is outside kveval's tested range <{have}"]
    assert json.loads((out / "metrics.json").read_text())["policies"]["int8"]["kld_mean"] > 0
