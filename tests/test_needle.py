"""Needle / passkey retrieval: prompt construction (depth, exact length, nothing truncated), exact-match scoring,
teacher-forced scores against the unpatched model, input errors, the run with resume, aggregation, plots."""

import json
import math
from pathlib import Path

import pytest
import torch

from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.errors import KvevalError
from kveval.policy import KVPolicy
from kveval.tasks.common import decoding
from kveval.tasks.common.decoding import generate_answer
from kveval.tasks.common.teacher import score_answer
from kveval.tasks.needle import task as needle
from kveval.tasks.needle.prompts import (
    PASSKEY_FILLER,
    SentenceTokens,
    build_prompt,
    exact_match,
    make_spec,
    split_sentences,
    trial_rng,
)
from kveval.tasks.needle.reporting import plot_needle
from kveval.tasks.needle.task import Params, aggregate, trial_prompt

CORPUS = (
    "The interpreter reads a line of input. It then parses the line into a syntax tree!\n\n"
    "Every object has an identity, a type and a value. Is the identity ever changed after creation? "
    "It never changes once an object has been created.\n\n"
    ">>> print(1)\nx\n\nA module is a file containing definitions and statements."
)


def sentences_for(variant, tok):
    if variant == "passkey":
        return SentenceTokens(tok, PASSKEY_FILLER)
    from kveval.data import load_text

    return SentenceTokens(tok, split_sentences(load_text("builtin"))[:400])


def find(seq, sub):
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]


@pytest.mark.parametrize("variant", ["passkey", "needle"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.77, 1.0])
def test_needle_is_at_the_requested_depth(tiny_llama, variant, depth):
    _, tok = tiny_llama
    sents = sentences_for(variant, tok)
    for context in (600, 1500):
        params = Params(variant=variant, context_lengths=[context], depths=[depth], trials=1)
        spec, p = trial_prompt(tok, params, sents, seed=3, context=context, depth=depth, trial=0)
        assert len(p.input_ids) == context - params.max_new_tokens
        assert find(p.input_ids, p.needle_ids) == [p.needle_start], "the needle is whole and appears once"
        assert spec.answer in tok.decode(p.needle_ids)
        # within one sentence of depth x (haystack filler), in tokens of the prompt
        longest = max(len(sents[i]) for i in range(len(sents)))
        pos = p.needle_start - p.haystack_start
        assert abs(pos - depth * p.filler_tokens) <= longest
        # and at a sentence boundary: the text before it ends a sentence (or is the start of the haystack)
        before = tok.decode(p.input_ids[p.haystack_start : p.needle_start]).rstrip()
        assert before == "" or before[-1] in ".!?"


def test_depth_extremes_and_order(tiny_llama):
    _, tok = tiny_llama
    sents = SentenceTokens(tok, PASSKEY_FILLER)
    spec = make_spec("passkey", trial_rng(seed=0, variant="passkey", context=800, depth=0.0, trial=0))
    starts = [build_prompt(tok, spec, prompt_tokens=800, depth=d, sentences=sents).needle_start
              for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert starts == sorted(starts) and len(set(starts)) == 5
    p0 = build_prompt(tok, spec, prompt_tokens=800, depth=0.0, sentences=sents)
    p1 = build_prompt(tok, spec, prompt_tokens=800, depth=1.0, sentences=sents)
    assert p0.needle_start == p0.haystack_start
    assert p1.needle_start + p1.needle_len == p1.haystack_start + p1.haystack_len


def test_chat_template_is_used_when_present():
    from kveval.models import byte_tokenizer

    tok = byte_tokenizer()  # a fresh one: the shared fixture's tokenizer stays without a template
    tok.chat_template = (
        "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    spec = make_spec("passkey", trial_rng(seed=0, variant="passkey", context=700, depth=0.5, trial=0))
    p = build_prompt(tok, spec, prompt_tokens=700, depth=0.5, sentences=PASSKEY_FILLER)
    text = tok.decode(p.input_ids)
    assert len(p.input_ids) == 700
    assert text.startswith("<|user|>There is an important")
    assert text.endswith("What is the pass key?<|end|><|assistant|>The pass key is")
    plain = build_prompt(tok, spec, prompt_tokens=700, depth=0.5, sentences=PASSKEY_FILLER, chat_template=False)
    assert "<|assistant|>" not in tok.decode(plain.input_ids)


def test_answer_never_truncated_by_the_context_cap(tiny_llama):
    model, tok = tiny_llama
    limit = model.config.max_position_embeddings
    sents = SentenceTokens(tok, PASSKEY_FILLER)
    params = Params(context_lengths=[limit], depths=[1.0], trials=3)
    for trial in range(3):
        spec, p = trial_prompt(tok, params, sents, seed=0, context=limit, depth=1.0, trial=trial)
        assert len(p.input_ids) + len(p.answer_ids) <= limit
        assert len(p.input_ids) + params.max_new_tokens == limit
        assert tok.decode(p.answer_ids).strip() == spec.answer
        assert spec.answer in tok.decode(p.needle_ids)
    # an answer longer than the generation budget is an error, never a silent cut
    with pytest.raises(KvevalError, match="max_new_tokens"):
        trial_prompt(tok, Params(max_new_tokens=3), sents, seed=0, context=600, depth=0.5, trial=0)
    # a context too short for instruction + needle + question
    with pytest.raises(KvevalError, match="cannot hold"):
        trial_prompt(tok, Params(), sents, seed=0, context=120, depth=0.5, trial=0)


def test_values_are_seeded_per_cell_and_trial(tiny_llama):
    _, tok = tiny_llama
    answers = {
        (c, d, t): make_spec("passkey", trial_rng(seed=0, variant="passkey", context=c, depth=d, trial=t)).answer
        for c in (1024, 2048) for d in (0.0, 0.5) for t in range(3)
    }
    assert len(set(answers.values())) == len(answers)
    again = make_spec("passkey", trial_rng(seed=0, variant="passkey", context=2048, depth=0.5, trial=2)).answer
    assert again == answers[(2048, 0.5, 2)]
    assert make_spec("needle", trial_rng(seed=1, variant="needle", context=1, depth=0.0, trial=0)).answer.isdigit()


@pytest.mark.parametrize("text, answer, hit", [
    ("The pass key is 71432.", "71432", True),
    (" 71432", "71432", True),
    ("I think it is 71,432, yes", "71432", True),
    ("The pass key is 714320.", "71432", False),
    ("The pass key is 17432.", "71432", False),
    ("It was 71432 71432 71432", "71432", True),
    ("", "71432", False),
    ("the magic word is Dolores Park, on a sunny day.", "dolores park", True),
    ("The magic word is DOLORES\n  park!", "Dolores Park", True),
    ("The magic word is Doloresparks.", "Dolores Park", False),
])
def test_exact_match_inside_a_sentence(text, answer, hit):
    assert exact_match(text, answer) is hit


def test_split_sentences_keeps_prose():
    s = split_sentences(CORPUS)
    assert "The interpreter reads a line of input." in s
    assert "Is the identity ever changed after creation?" in s
    assert not any(x.startswith(">>>") for x in s)


def _prompt(tok, context=400, depth=0.5, variant="passkey"):
    params = Params(variant=variant, context_lengths=[context], depths=[depth], trials=1)
    return trial_prompt(tok, params, SentenceTokens(tok, PASSKEY_FILLER), seed=0, context=context, depth=depth,
                        trial=0)


def test_teacher_forced_none_policy_equals_unpatched_model(tiny_llama):
    model, tok = tiny_llama
    _, p = _prompt(tok)
    plain = score_answer(model, p.input_ids, p.answer_ids)
    none = score_answer(model, p.input_ids, p.answer_ids, KVPolicy.preset("fp16"))
    assert none == plain
    # and against a plain full forward pass, computed independently
    ids = torch.tensor([p.input_ids + p.answer_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n, P = len(p.answer_ids), len(p.input_ids)
    ref = [float(logp[P - 1 + i, a]) for i, a in enumerate(p.answer_ids)]
    assert math.isclose(plain["answer_logprob_sum"], sum(ref), rel_tol=1e-5, abs_tol=1e-5)
    assert plain["answer_tokens"] == n
    int2 = score_answer(model, p.input_ids, p.answer_ids, KVPolicy.preset("int2_g32"))
    assert int2["answer_logprob"] != plain["answer_logprob"]


def test_generation_under_none_policy_equals_plain_generate(tiny_llama):
    model, tok = tiny_llama
    _, p = _prompt(tok)
    assert generate_answer(model, tok, p.input_ids, 6) == generate_answer(model, tok, p.input_ids, 6,
                                                                             KVPolicy.preset("fp16"))


def tiny_config(out: Path, **params) -> dict:
    task = {"context_lengths": [400], "depths": [0.0, 1.0], "trials": 1, "max_new_tokens": 8, **params}
    return {"name": "tn", "model": "builtin:tiny-llama", "kv": ["int2_g32"], "tasks": [{"needle": task}],
            "output": str(out)}


def test_context_beyond_the_model_is_one_line_error(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KvevalError) as info:
        run_experiment(validate(tiny_config(out, context_lengths=[1024, 4096])), quiet=True)
    msg = str(info.value)
    assert "\n" not in msg and "4096" in msg and "2048" in msg
    assert not out.exists(), "input errors surface before the results folder is touched"
    with pytest.raises(KvevalError, match="depths"):
        validate(tiny_config(out, depths=[0.5, 1.5]))
    with pytest.raises(KvevalError, match="duplicates"):
        validate(tiny_config(out, depths=[0.5, 0.5]))


def test_run_records_metrics_plots_and_resume(tmp_path, monkeypatch):
    out = tmp_path / "run"
    metrics = run_experiment(validate(tiny_config(out)), quiet=True)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2  # 2 trials (1 context x 2 depths x 1 trial) x (baseline + int2_g32)
    assert len({r["key"] for r in records}) == len(records)
    assert all(r["prompt_tokens"] == 392 for r in records)
    for entry in (metrics["baseline"], metrics["policies"]["int2_g32"]):
        for field in ("needle_accuracy", "needle_answer_logprob", "needle_token_acc", "needle_cells"):
            assert field in entry, field
        assert [(c["context"], c["depth"]) for c in entry["needle_cells"]] == [(400, 0.0), (400, 1.0)]
    assert "needle_lost" in metrics["policies"]["int2_g32"]
    assert metrics["policies"]["int2_g32"]["bytes_per_token"] > 0  # memory bill sized from the needle context
    plots = {p.name for p in (out / "plots").iterdir()}  # the report adds its own beside them
    assert {"needle_baseline.png", "needle_int2_g32.png", "needle_int2_g32_diff.png"} <= plots

    # resume: nothing is recomputed when everything is recorded; a lost record is recomputed alone
    calls = []
    real = needle.evaluate

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(needle, "evaluate", counting)
    again = run_experiment(validate(tiny_config(out)), quiet=True)
    assert calls == [] and again == metrics
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-1]))
    third = run_experiment(validate(tiny_config(out)), quiet=True)
    assert len(calls) == 1
    assert third["policies"]["int2_g32"]["needle_answer_logprob"] == pytest.approx(
        metrics["policies"]["int2_g32"]["needle_answer_logprob"], rel=1e-6)


def test_aggregate_is_pure_and_paired():
    def rec(policy, depth, trial, em, lp):
        return {"task": "needle", "variant": "passkey", "context": 1024, "depth": depth, "trial": trial,
                "policy": policy, "exact_match": em, "answer_logprob": lp, "answer_token_acc": float(em)}

    records = [rec("baseline", 0.0, 0, 1, -0.1), rec("baseline", 0.0, 1, 1, -0.3), rec("baseline", 1.0, 0, 0, -2.0),
               rec("q", 0.0, 0, 0, -1.1), rec("q", 0.0, 1, 1, -0.5), rec("q", 1.0, 0, 1, -1.0),
               {"task": "perplexity", "policy": "q"}]
    m = aggregate(records, ["q"])
    assert m == aggregate(list(reversed(records)), ["q"])
    b, q = m["baseline"], m["policies"]["q"]
    assert b["needle_accuracy"] == pytest.approx(2 / 3) and q["needle_accuracy"] == pytest.approx(2 / 3)
    assert q["needle_answer_logprob"] == pytest.approx(-2.6 / 3)
    assert q["needle_lost"] == pytest.approx(1 / 3)
    assert q["needle_logprob_delta"] == pytest.approx(-2.6 / 3 + 2.4 / 3)
    assert q["needle_cells"][0] == {"variant": "passkey", "context": 1024, "depth": 0.0, "trials": 2,
                                    "accuracy": 0.5, "logprob": pytest.approx(-0.8), "token_acc": 0.5}


def test_plot_needle_from_metrics(tmp_path):
    cells = [{"variant": "passkey", "context": c, "depth": d, "trials": 1, "accuracy": 1.0, "logprob": -0.5,
              "token_acc": 1.0} for c in (1024, 2048) for d in (0.0, 0.5, 1.0)]
    worse = [dict(c, accuracy=0.0, logprob=-3.0) for c in cells]
    metrics = {"baseline": {"needle_cells": cells}, "policies": {"int2 g32": {"needle_cells": worse}, "x": {}}}
    files = plot_needle(metrics, tmp_path / "plots")
    assert sorted(f.name for f in files) == ["needle_baseline.png", "needle_int2_g32.png", "needle_int2_g32_diff.png"]
    assert all(f.stat().st_size > 1000 for f in files)


@pytest.mark.parametrize("name", ["needle_quick", "passkey_quick", "passkey_long", "needle_long"])
def test_task_presets(name):
    cfg = validate({"name": "t", "kv": ["int2_g32"], "tasks": [name]})
    assert cfg.tasks[0].kind == "needle"


@pytest.mark.integration
def test_builtin_prompt_exact_length_with_chat_template(builtin_model):
    _, tok = builtin_model
    from kveval.data import load_text

    for variant, sents in (("passkey", PASSKEY_FILLER), ("needle", split_sentences(load_text("builtin"))[:2000])):
        st = SentenceTokens(tok, sents)
        for context in (1024, 4096):
            for depth in (0.0, 0.5, 1.0):
                params = Params(variant=variant, context_lengths=[context], depths=[depth])
                spec, p = trial_prompt(tok, params, st, seed=0, context=context, depth=depth, trial=1)
                assert len(p.input_ids) == context - params.max_new_tokens
                assert find(p.input_ids, p.needle_ids) == [p.needle_start]
                text = tok.decode(p.input_ids)
                assert text.startswith("<|im_start|>system") and text.endswith(f"assistant\n{spec.answer_prefix}")
                longest = max(len(st[i]) for i in range(len(st)))
                assert abs(p.needle_start - p.haystack_start - depth * p.filler_tokens) <= longest


def test_batched_generation_gives_each_trial_the_answer_it_gets_alone(tmp_path, monkeypatch):
    """Trials of one context generated in batches of 4 (6 trials: a full and a partial batch) record what
    batch_size 1 records (float64: no batch rounding), and generation runs once per batch, not per trial."""
    sizes = []
    real = decoding.generate_answers

    def counting(model, tok, prompts, *a, **k):
        sizes.append(len(prompts))
        return real(model, tok, prompts, *a, **k)

    monkeypatch.setattr(decoding, "generate_answers", counting)
    runs = {}
    for size in (1, 4):
        raw = tiny_config(tmp_path / f"b{size}", depths=[0.0, 0.5, 1.0], trials=2, batch_size=size)
        raw["model"] = {"name": "builtin:tiny-llama", "dtype": "float64"}
        run_experiment(validate(raw), quiet=True)
        runs[size] = {r["key"]: r for r in map(json.loads, (tmp_path / f"b{size}" / "records.jsonl").open())}
    assert sizes == [1] * 12 + [4, 2, 4, 2]  # (baseline, int2_g32) x 6 trials alone, then 2 batches each
    assert runs[1].keys() == runs[4].keys() and len(runs[1]) == 12
    for key, alone in runs[1].items():
        batched = runs[4][key]
        assert batched["generated"] == alone["generated"] and batched["exact_match"] == alone["exact_match"], key
        assert batched["answer_logprob"] == pytest.approx(alone["answer_logprob"], abs=1e-12)
