"""The generation task end to end on a tiny model: the fp16 policy never departs, a resumed run equals an
uninterrupted one, the report shows the section, and bad parameters are one line before anything is written."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.errors import KvevalError
from kveval.tasks.generation.aggregate import first_difference

PARAMS = {"tasks_per_kind": 1, "continuations": 2, "continuation_tokens": 16, "max_new_tokens": 12, "samples": 2,
          "batch_size": 4}


def config(tmp_path, **params) -> dict:
    return {"name": "gen", "model": {"name": "builtin:tiny-llama", "dtype": "float64"}, "data": "builtin",
            "kv": ["fp16", "int2_g32"],
            "tasks": [{"generation": {**PARAMS, **params}}], "output": str(tmp_path / "run")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    metrics = run_experiment(validate(config(tmp)), quiet=True)
    return tmp, metrics


def test_fp16_never_departs_and_the_fields_are_there(finished):
    tmp, metrics = finished
    fp16 = metrics["policies"]["fp16"]
    assert fp16["gen_diverged"] == 0 and fp16["gen_divergence_median"] is None
    assert fp16["gen_kld_mean"] == 0 and fp16["gen_kld_fp_mean"] == 0 and fp16["gen_similarity"] == 1
    assert fp16["gen_survival"]["survival"] in ([], [1.0] * len(fp16["gen_survival"]["steps"]))
    base, low = metrics["baseline"], metrics["policies"]["int2_g32"]
    assert base["gen_prompts"] >= 3 and 0 <= base["gen_eos_rate"] <= 1
    assert low["gen_kld_mean"] > 0 and 0 <= low["gen_diverged"] <= 1
    assert set(low["gen_kld"]) >= {"edges", "mean", "count", "slope"}
    records = [json.loads(line) for line in (tmp / "run" / "records.jsonl").read_text().splitlines()]
    by = {(r["prompt"], r["policy"], r["unit"]): r for r in records if r.get("task") == "generation"}
    for (prompt, who, unit), r in by.items():
        if who == "fp16" and unit != "fp_path":  # nothing quantized: the baseline's tokens, sample by sample
            assert r["tokens"] == by[(prompt, "baseline", unit)]["tokens"] and set(r["kld"]) <= {0.0}


def test_the_report_shows_the_section(finished):
    tmp, _ = finished
    report = (tmp / "run" / "report.md").read_text()
    assert "## Long generations" in report and "gen KLD" in report  # the section and its summary column
    assert (tmp / "run" / "tables" / "generation.csv").is_file()
    assert (tmp / "run" / "plots" / "generation_survival.png").is_file()


def test_a_resumed_run_equals_an_uninterrupted_one(finished, tmp_path):
    _, metrics = finished
    cfg = validate(config(tmp_path))
    run_experiment(cfg, quiet=True)
    records = tmp_path / "run" / "records.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    records.write_text("".join(lines[: len(lines) // 2]) + lines[len(lines) // 2][:7])  # killed mid-write
    again = run_experiment(cfg, quiet=True)
    assert again["policies"] == metrics["policies"] and again["baseline"] == metrics["baseline"]
    assert len(records.read_text().splitlines()) >= len(lines)


def test_first_difference_by_hand():
    assert first_difference([1, 2, 3], [1, 2, 3]) == (None, 3)
    assert first_difference([1, 2, 3], [1, 5, 3]) == (1, 1)
    assert first_difference([1, 2], [1, 2, 7]) == (2, 2)  # one ended, the other went on


@pytest.mark.parametrize("bad, words", [
    ({"samples": 0}, "samples"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"thinking": True, "chat_template": False}, "thinking needs chat_template"),
    ({"max_new_tokens": 32000}, "the model's context (2048 tokens)"),
])
def test_bad_parameters_are_one_line_before_anything_is_written(tmp_path, bad, words):
    path = tmp_path / "gen.yaml"
    path.write_text(json.dumps(config(tmp_path, **bad)))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "run" / "records.jsonl").exists()


@pytest.mark.parametrize("line, words", [
    ('{"prompt": ""}', "empty"),
    ('{"prompt": "Say hi."}', "none in"),  # samples (PARAMS: 2) on a file without answers
])
def test_validate_refuses_a_prompt_file_kveval_cannot_use(tmp_path, line, words):
    """``kveval validate`` (no model loaded) reads the prompt file as the run would: one line, exit 2."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(line + "\n")
    path = tmp_path / "gen.yaml"
    path.write_text(json.dumps(config(tmp_path, prompts=str(prompts))))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output, lines
    assert not (tmp_path / "run").exists()


def test_a_prompt_file_kveval_cannot_use_is_refused_by_the_check(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": ""}\n')
    with pytest.raises(KvevalError):
        run_experiment(validate(config(tmp_path, prompts=str(bad))), quiet=True)
    assert not (tmp_path / "run" / "records.jsonl").exists()


def test_the_shipped_prompt_file_loads_from_any_directory(tmp_path, monkeypatch):
    """``prompts: tasks/generation/word_problems.jsonl`` (configs/generation_reasoning.yaml) names kveval's example
    file wherever the run starts; each answer passes its checker in the form the prompt asks for."""
    from kveval.tasks.generation.checkers import check_answer
    from kveval.tasks.generation.prompts import load_jsonl

    monkeypatch.chdir(tmp_path)
    prompts = load_jsonl("tasks/generation/word_problems.jsonl")
    assert len(prompts) == 12 and {p.checker for p in prompts} == {"boxed"}
    for p in prompts:
        assert check_answer(f"So the answer is \\boxed{{{p.answer}}}.", p.answer, p.checker)
        assert not check_answer(f"\\boxed{{{int(p.answer) + 1}}}", p.answer, p.checker)
    with pytest.raises(KvevalError, match="no/such.jsonl"):
        load_jsonl("tasks/no/such.jsonl")


def test_the_console_table_of_a_run_without_perplexity_names_no_ppl_threshold(finished):
    """The closing table's verdict and its ΔPPL threshold are perplexity's: a generation-only run shows its own
    columns, without them."""
    from rich.console import Console

    from kveval.report.console import summary_table

    tmp, metrics = finished
    console = Console(record=True, width=200)
    console.print(summary_table(metrics, validate(config(tmp))))
    text = console.export_text()
    assert "gen KLD" in text and "gen acc %" in text
    assert "ΔPPL" not in text and "verdict" not in text and "PPL" not in text


@pytest.mark.parametrize("tokens", [[], "abc", [1, -5], [10 ** 9], [1.5]])
def test_a_damaged_fp_path_record_is_one_line_and_nothing_is_lost(tmp_path, tokens):
    """A resumed run reads the baseline's greedy output back to score the policies along it: damaged token ids
    there are one line naming the record, and the records file is left as it was."""
    cfg = validate(config(tmp_path))
    run_experiment(cfg, quiet=True)
    records = tmp_path / "run" / "records.jsonl"
    lines = records.read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    keep = [r for r in rows if not (r.get("policy") == "int2_g32" and r.get("unit") == "fp_path")]
    for r in keep:
        if r.get("policy") == "baseline" and r.get("unit") == "greedy":
            r["tokens"] = tokens
            break
    records.write_text("".join(json.dumps(r) + "\n" for r in keep))
    before = records.read_text()
    with pytest.raises(KvevalError) as info:
        run_experiment(cfg, quiet=True)
    assert "\n" not in str(info.value) and "baseline's greedy record" in str(info.value)
    assert records.read_text() == before
