"""lm-eval generation tasks with several samples per request through the bridge (issue #42): the config's
``repeats`` and ``gen_kwargs``, the shipped sampled task (every sample scored: pass@1, pass@k, maj@k), and the
refusals of repeats that would be wasted (a task that scores the first sample only, greedy decoding, a
log-likelihood task)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from typer.testing import CliRunner  # noqa: E402

from kveval.cli import app  # noqa: E402
from kveval.tasks.lm_eval.bridge import KVEvalLM  # noqa: E402
from kveval.tasks.lm_eval.task import scores_first_sample_only  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks" / "lm_eval"
SAMPLED, GEN, MC = "kveval_qa_sampled", "kveval_qa_gen", "kveval_facts_mc"


def _utils():
    spec = importlib.util.spec_from_file_location("kveval_lm_eval_utils", TASKS_DIR / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("samples, want", [
    (["5", "5", "6", "5"], {"pass@1": 0.75, "pass@k": 1.0, "maj@k": 1.0}),
    (["6", "5", "6", "7"], {"pass@1": 0.25, "pass@k": 1.0, "maj@k": 0.0}),
    (["6", "5"], {"pass@1": 0.5, "pass@k": 1.0, "maj@k": 0.0}),  # a tie: the answer seen first
    (["5", "6"], {"pass@1": 0.5, "pass@k": 1.0, "maj@k": 1.0}),
    (["Five", "4", "4"], {"pass@1": 0.0, "pass@k": 0.0, "maj@k": 0.0}),
    ([" 5.", "5!"], {"pass@1": 1.0, "pass@k": 1.0, "maj@k": 1.0}),  # case, spaces, punctuation ignored
])
def test_sampled_answers_by_hand(samples, want):
    assert _utils().sampled_answers({"answer": "5"}, [samples]) == want


def _config(**fields):
    return SimpleNamespace(**fields)


def test_which_filters_score_the_first_sample_only():
    first = {"name": "a", "filter": [{"function": "regex", "regex_pattern": "x"}, {"function": "take_first"}]}
    vote = {"name": "b", "filter": [{"function": "majority_vote"}, {"function": "take_first"}]}
    top_k = {"name": "c", "filter": [{"function": "take_first_k", "k": 4}, {"function": "majority_vote"}]}
    keep = {"name": "d", "filter": [{"function": "remove_whitespace"}]}
    assert scores_first_sample_only(_config(filter_list=None))  # lm-eval's default: take_first
    assert scores_first_sample_only(_config(filter_list=[first]))
    assert not scores_first_sample_only(_config(filter_list=[first, vote]))
    assert not scores_first_sample_only(_config(filter_list=[top_k]))
    assert not scores_first_sample_only(_config(filter_list=[keep]))


def _write(tmp_path, **params) -> Path:
    raw = {"name": "rep", "model": "builtin:tiny-llama", "kv": ["fp16", "int2_g32"], "output": str(tmp_path / "run"),
           "tasks": [{"lm_eval": {"tasks": [SAMPLED], "include_path": str(TASKS_DIR), "limit": 3, **params}}]}
    path = tmp_path / "rep.yaml"
    path.write_text(json.dumps(raw))
    return path


def test_every_sample_is_generated_and_scored(tmp_path, monkeypatch):
    """The shipped task's 4 repeats, and ``repeats: 2`` over it: that many generation requests per document, each
    through the bridge; fp16 scores what the baseline scores (the same seeded samples through a cache that
    quantizes nothing); pass@1 is a share of the samples."""
    counts: list[int] = []
    original = KVEvalLM.generate_until

    def counting(self, requests, *args, **kwargs):
        counts.append(len(requests))
        return original(self, requests, *args, **kwargs)

    monkeypatch.setattr(KVEvalLM, "generate_until", counting)
    for repeats, params in ((4, {}), (2, {"repeats": 2})):
        counts.clear()
        out = tmp_path / f"r{repeats}"
        out.mkdir()
        result = CliRunner().invoke(app, ["run", str(_write(out, **params))])
        assert result.exit_code == 0, result.output
        assert counts == [3 * repeats] * 3, counts  # baseline, fp16, int2_g32: 3 documents x repeats each
        metrics = json.loads((out / "run" / "metrics.json").read_text())
        base = metrics["baseline"]["lm_eval"][SAMPLED]
        fp16 = metrics["policies"]["fp16"]["lm_eval"][SAMPLED]
        assert {k: fp16[k] for k in ("pass@1", "pass@k", "maj@k")} == {k: base[k] for k in ("pass@1", "pass@k", "maj@k")}
        assert round(base["pass@1"] * 3 * repeats, 9) == int(round(base["pass@1"] * 3 * repeats))
        assert base["pass@1"] <= base["pass@k"]


@pytest.mark.parametrize("params, words", [
    ({"tasks": [GEN], "repeats": 4}, "scores only the first sample"),
    ({"tasks": [MC], "repeats": 4}, "is not a generation task"),
    ({"repeats": 4, "gen_kwargs": {"do_sample": False}}, "decodes greedily"),
])
def test_wasted_repeats_are_one_line_before_anything_is_written(tmp_path, params, words):
    result = CliRunner().invoke(app, ["run", str(_write(tmp_path, **params))])
    assert result.exit_code == 2, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output, lines
    assert not (tmp_path / "run").exists()
