"""The RULER-style suite: every family's prompt (exact length, needles at the requested depth, distractors that
differ from the answer, chains that resolve to the stated answer, word counts that make the answer true), RULER's
string-match scores, determinism from the seed, the aggregation by hand, the figure, and a run through the CLI
with resume on the tiny random model; one integration test on the builtin model."""

from __future__ import annotations

import collections
import json
import re

import pytest
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.data import load_text
from kveval.errors import KvevalError
from kveval.models import byte_tokenizer
from kveval.tasks.common import decoding
from kveval.tasks.common.prompts import SentenceTokens, split_sentences
from kveval.tasks.ruler import task as ruler
from kveval.tasks.ruler.prompts import (
    DEPTH_GRID,
    FAMILIES,
    NOISE,
    Pieces,
    build_sample,
    fwe_counts,
    sample_rng,
)
from kveval.tasks.ruler.reporting import plot_ruler
from kveval.tasks.ruler.scoring import postprocess, score, string_match_all, string_match_any
from kveval.tasks.ruler.task import Params, aggregate
from kveval.tasks.ruler.words import ADJECTIVES, NOUNS, VERBS, WORDS

NIAH = [f for f, fam in FAMILIES.items() if fam.kind == "niah"]
NEEDLE_LINE = re.compile(r"One of the special magic (\w+) for ([\w-]+) is: ([\w-]+)\.")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()  # no chat template


@pytest.fixture(scope="module")
def pieces(tok):
    return Pieces(tok)


@pytest.fixture(scope="module")
def essay(tok):
    return SentenceTokens(tok, split_sentences(load_text("builtin"))[:400])


def build(pieces, essay, family, prompt_tokens=1800, *, depth=None, seed=0, sample=0, length=None):
    rng = sample_rng(seed=seed, family=family, length=length or prompt_tokens, sample=sample)
    return build_sample(pieces, family, rng, prompt_tokens=prompt_tokens, length=length, depth=depth, essay=essay)


def find(seq, sub):
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]


def context_text(tok, s) -> str:
    return tok.decode(s.input_ids[s.context_start : s.context_start + s.context_len])


# ----------------------------------------------------------------------------------------------------- families


def test_families_are_rulers_synthetic_tasks():
    assert list(FAMILIES) == ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                              "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt",
                              "cwe", "fwe"]
    assert {f.metric for f in FAMILIES.values()} == {"all"}  # RULER: string_match_all for every synthetic task
    assert [FAMILIES[f].tokens_to_generate for f in ("niah_single_1", "vt", "cwe", "fwe")] == [128, 30, 120, 50]
    assert DEPTH_GRID[:4] == (0.0, 0.03, 0.05, 0.08) and DEPTH_GRID[-1] == 1.0 and len(DEPTH_GRID) == 40
    assert len(WORDS) == len(set(WORDS)) > 900 and all(w.isalpha() and w.islower() for w in WORDS)
    assert set(ADJECTIVES) | set(NOUNS) | set(VERBS) == set(WORDS)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prompt_tokens", [1800, 2600])
def test_prompt_has_the_requested_length_exactly(pieces, essay, tok, family, prompt_tokens):
    s = build(pieces, essay, family, prompt_tokens)
    assert len(s.input_ids) == prompt_tokens
    assert tok.decode(s.answer_ids) == s.reference and s.reference.startswith(" ")
    text = tok.decode(s.input_ids)
    for answer in s.answers:  # every reference is in the prompt (cwe: as list items; fwe: as coded words)
        assert answer in context_text(tok, s)
    assert text.rstrip().endswith(("is", "are", "are:"))


@pytest.mark.parametrize("family", NIAH)
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_answer_needles_are_at_the_requested_depth(pieces, essay, tok, family, depth):
    s = build(pieces, essay, family, 2000, depth=depth, sample=1)
    fam = FAMILIES[family]
    assert len(s.input_ids) == 2000
    assert len(s.answer_spans) == fam.num_values * fam.num_queries
    spans = sorted(s.answer_spans + s.distractor_spans)
    for start, n in s.answer_spans:  # every needle whole, once
        assert find(s.input_ids, s.input_ids[start : start + n]) == [start]
    # the answer's needles are adjacent, in filler coordinates at the boundary nearest depth x filler
    first = s.answer_spans[0][0]
    assert [a[0] for a in s.answer_spans] == [first + sum(n for _, n in s.answer_spans[:i])
                                              for i in range(len(s.answer_spans))]
    before = sum(n for start, n in spans if start < first)
    units = {"noise": len(pieces("\n" + NOISE)), "essay": max(len(essay[i]) for i in range(len(essay))),
             "needle": 130}[fam.haystack]
    assert abs(first - s.context_start - before - depth * s.filler_tokens) <= units
    assert s.answer_depths[0] == pytest.approx(depth, abs=units / s.filler_tokens)
    # and the needles hold the key asked and the answers
    found = [NEEDLE_LINE.search(tok.decode(s.input_ids[a : a + n])) for a, n in s.answer_spans]
    assert all(m and m.group(2) in s.query for m in found)
    assert sorted(m.group(3) for m in found) == sorted(s.answers)


def test_depths_order_and_extremes(pieces, essay, tok):
    firsts = [build(pieces, essay, "niah_single_1", 2000, depth=d).answer_spans[0][0] for d in (0, .25, .5, .75, 1)]
    assert firsts == sorted(firsts) and len(set(firsts)) == 5
    s0 = build(pieces, essay, "niah_single_2", 2000, depth=0.0)
    s1 = build(pieces, essay, "niah_single_2", 2000, depth=1.0)
    # depth 0: at the first true sentence boundary (after the fragment of the first sentence the cut leaves)
    fragment = tok.decode(s0.input_ids[s0.context_start : s0.answer_spans[0][0]])
    assert fragment.endswith((".", "!", "?")) and len(fragment) <= max(len(s) + 1 for s in essay.sentences)
    assert not re.search(r"[.!?] [A-Z]", fragment[:-1]), "no whole sentence before it"
    assert sum(s1.answer_spans[0]) == s1.context_start + s1.context_len


@pytest.mark.parametrize("family", ["niah_multikey_1", "niah_multikey_2", "niah_multikey_3"])
def test_distractors_differ_from_the_answer(pieces, essay, tok, family):
    for sample in range(3):
        s = build(pieces, essay, family, 2400, sample=sample)
        needles = NEEDLE_LINE.findall(context_text(tok, s))
        asked = [(k, v) for _, k, v in needles if k == s.query]
        others = [(k, v) for _, k, v in needles if k != s.query]
        assert asked == [(s.query, s.answers[0])], "the key asked has one needle, with the answer"
        assert len(others) >= 3 and all(v not in s.answers for _, v in others)
        if family == "niah_multikey_1":
            assert len(s.distractor_spans) == 3 and len({k for k, _ in others}) == 3
        else:  # the haystack is needles
            assert len(others) == len(re.findall("One of the special magic", context_text(tok, s))) - 1
        if family == "niah_multikey_3":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", s.query)


def test_multivalue_and_multiquery(pieces, essay, tok):
    mv = build(pieces, essay, "niah_multivalue", 2400)
    lines = NEEDLE_LINE.findall(context_text(tok, mv))
    assert len(mv.answers) == 4 and len(set(mv.answers)) == 4
    assert sorted(v for _, k, v in lines if k == mv.query) == sorted(mv.answers)
    assert "What are all the special magic numbers for" in tok.decode(mv.input_ids)
    mq = build(pieces, essay, "niah_multiquery", 2400)
    keys = re.fullmatch(r"(\S+), (\S+), (\S+), and (\S+)", mq.query).groups()
    assert {k: v for _, k, v in NEEDLE_LINE.findall(context_text(tok, mq))} == dict(zip(keys, mq.answers))
    single = build(pieces, essay, "niah_single_1", 2000)
    assert "A special magic number is hidden" in tok.decode(single.input_ids)
    assert "What is the special magic number for" in tok.decode(single.input_ids)


def _resolve(lines: list[str]) -> dict[str, str]:
    """Variable -> the number it holds, following ``VAR X = VAR Y`` chains."""
    assign = dict(re.fullmatch(r"VAR (\w+) = (.+)", line.strip()).groups() for line in lines)

    def value(v, seen=()):
        rhs = assign[v]
        return value(rhs[4:], (*seen, v)) if rhs.startswith("VAR ") else rhs

    return {v: value(v) for v in assign}


@pytest.mark.parametrize("sample", range(4))
@pytest.mark.parametrize("depth", [None, 0.0, 0.6, 1.0])
def test_variable_tracking_chain_resolves_to_the_answer(pieces, tok, sample, depth):
    s = build(pieces, None, "vt", 1900, depth=depth, sample=sample)
    lines = [x for x in context_text(tok, s).split("\n") if x.startswith("VAR ")]
    assert len(lines) == 5
    held = _resolve(lines)
    assert sorted(v for v, n in held.items() if n == s.query) == sorted(s.answers)
    assert [re.match(r"VAR (\w+)", x).group(1) for x in lines] == list(s.answers), "the links stay in order"
    assert s.reference == " " + " ".join(s.answers) and re.fullmatch(r"\d{5}", s.query)
    prompt = tok.decode(s.input_ids)
    assert f"5 variables are assigned the value {s.query}, they are:" in prompt
    example = prompt[: prompt.index("Memorize", prompt.index("Memorize") + 1)]  # the worked example: another chain
    ex_lines = [x for x in example.split("\n") if x.startswith("VAR ")]
    assert len(ex_lines) == 5 and not set(_resolve(ex_lines)) & set(s.answers)
    if depth is not None:
        assert s.answer_depths[0] == pytest.approx(depth, abs=len(pieces("\n" + NOISE)) / s.filler_tokens)
        assert all(d >= s.answer_depths[0] for d in s.answer_depths)


@pytest.mark.parametrize("prompt_tokens, common_times, rare_times", [(1800, 6, 1), (2600, 6, 1), (6000, 30, 3)])
def test_common_words_are_the_answer_by_construction(pieces, tok, prompt_tokens, common_times, rare_times):
    s = build(pieces, None, "cwe", prompt_tokens, length=prompt_tokens + 120)
    listed = context_text(tok, s).strip()
    items = re.findall(r"(\d+)\. ([\w-]+)", listed)
    assert [int(i) for i, _ in items] == list(range(1, len(items) + 1)), "numbered 1..N, nothing cut"
    counts = collections.Counter(w for _, w in items)
    assert {w: counts[w] for w in s.answers} == dict.fromkeys(s.answers, common_times)
    assert max(c for w, c in counts.items() if w not in s.answers) <= rare_times
    assert s.reference == " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(dict.fromkeys(
        w for _, w in items if w in s.answers)))
    assert len(s.input_ids) == prompt_tokens and listed.count("\n") == 0


def test_common_words_beyond_the_word_list(pieces, tok):
    s = build(pieces, None, "cwe", 48000, length=48120)  # more distinct words than WORDS: adjective-noun pairs
    items = re.findall(r"(\d+)\. ([\w-]+)", context_text(tok, s))
    counts = collections.Counter(w for _, w in items)
    assert len(counts) > len(WORDS) and any("-" in w for w in counts)
    assert all(counts[w] == 30 for w in s.answers) and sorted(counts.values())[-11] <= 3
    assert len(s.input_ids) == 48000


@pytest.mark.parametrize("prompt_tokens", [1900, 4000])
def test_frequent_words_are_the_answer_by_construction(pieces, tok, prompt_tokens):
    s = build(pieces, None, "fwe", prompt_tokens)
    counts = collections.Counter(context_text(tok, s).split())
    ranked = [w for w, _ in counts.most_common() if w != "..."]
    assert ranked[:3] == list(s.answers) and counts.most_common(1)[0][0] == "..."
    top = [counts[w] for w in ranked[:4]]
    assert top[0] > top[1] > top[2] > top[3]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked)


def test_fwe_counts_are_rulers_zipf():
    # floor(n * k^-2 / zeta(2)), zeta(2) = pi^2 / 6 = 1.6449...
    assert fwe_counts(1000, 6) == [607, 151, 67, 37, 24, 16]


def test_same_seed_same_prompt_other_seed_other_values(tok, essay):
    for family in FAMILIES:
        a = build(Pieces(tok), essay, family, 1900, seed=7, sample=2)
        b = build(Pieces(tok), essay, family, 1900, seed=7, sample=2)
        assert a == b, family
        c = build(Pieces(tok), essay, family, 1900, seed=8, sample=2)
        d = build(Pieces(tok), essay, family, 1900, seed=7, sample=3)
        assert c.answers != a.answers and d.answers != a.answers, family


def test_chat_template_is_used_when_present(essay):
    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    for family in FAMILIES:
        s = build(Pieces(tok), SentenceTokens(tok, essay.sentences), family, 2000)
        text = tok.decode(s.input_ids)
        assert len(s.input_ids) == 2000 and text.startswith("<|user|>"), family
        assert "<|end|><|assistant|>" in text and text.endswith(("is", "are", "are:")), family


def test_too_short_a_prompt_is_one_line(pieces, essay):
    for family in FAMILIES:
        with pytest.raises(KvevalError, match=f"{family}: a prompt of 200 tokens is too short") as info:
            build(pieces, essay, family, 200)
        assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("prediction, references, expect_all, expect_any", [
    ("", ["1234567"], 0.0, 0.0),
    ("   \n", ["1234567"], 0.0, 0.0),
    (" 1234567.", ["1234567"], 1.0, 1.0),
    ("The numbers are 111 and 333.", ["111", "222", "333", "444"], 0.5, 1.0),
    ("none of them", ["111", "222"], 0.0, 0.0),
    ("QUIET-HARBOR and Apple", ["quiet-harbor", "apple", "river"], 2 / 3, 1.0),
    ("12345678", ["1234567"], 1.0, 1.0),  # RULER's substring rule: a longer number contains the answer
    ("1234 567", ["1234567"], 0.0, 0.0),
    ("A\x00B", ["a\nb"], 1.0, 1.0),  # control characters become newlines, as RULER's postprocess_pred
])
def test_string_match_scores(prediction, references, expect_all, expect_any):
    assert string_match_all(prediction, references) == pytest.approx(expect_all)
    assert string_match_any(prediction, references) == expect_any
    assert score(prediction, references, "all") == pytest.approx(expect_all)
    assert score(prediction, references, "any") == expect_any


def test_postprocess_and_empty_references():
    assert postprocess("  \tanswer:\x07 42 \n") == "answer:\n 42"
    with pytest.raises(ValueError):
        string_match_all("x", [])


# ----------------------------------------------------------------------------------------------------- aggregation


def _rec(policy, family, length, sample, score_, lp):
    return {"task": "ruler", "family": family, "length": length, "sample": sample, "policy": policy,
            "score": score_, "answer_logprob": lp, "answer_token_acc": 1.0 if score_ == 1 else 0.0}


def test_aggregate_by_hand():
    params = Params(families=["vt", "cwe"], lengths=[1024, 2048], samples=2, max_drop=5.0)
    records = [
        _rec("baseline", "vt", 1024, 0, 1.0, -0.5), _rec("baseline", "vt", 1024, 1, 0.6, -1.5),
        _rec("baseline", "vt", 2048, 0, 1.0, -1.0), _rec("baseline", "vt", 2048, 1, 1.0, -1.0),
        _rec("baseline", "cwe", 1024, 0, 0.8, -2.0), _rec("baseline", "cwe", 1024, 1, 0.8, -2.0),
        _rec("q", "vt", 1024, 0, 1.0, -0.7), _rec("q", "vt", 1024, 1, 0.6, -1.7),
        _rec("q", "vt", 2048, 0, 1.0, -1.0), _rec("q", "vt", 2048, 1, 0.4, -3.0),
        _rec("q", "cwe", 1024, 0, 0.8, -2.0), _rec("q", "cwe", 1024, 1, 0.7, -2.2),
        {"task": "needle", "policy": "q"},
    ]
    m = aggregate(records, ["q"], params)
    assert m == aggregate(list(reversed(records)), ["q"], params)
    b, q = m["baseline"], m["policies"]["q"]
    assert b["ruler_score"] == pytest.approx(100 * 5.2 / 6) and b["ruler_samples"] == 6
    assert q["ruler_score"] == pytest.approx(100 * 4.5 / 6)
    assert q["ruler_drop"] == pytest.approx(100 * 0.7 / 6)
    assert [(c["family"], c["length"], c["score"], c["drop"]) for c in q["ruler_cells"]] == [
        ("vt", 1024, pytest.approx(80.0), 0.0), ("vt", 2048, pytest.approx(70.0), 30.0),
        ("cwe", 1024, pytest.approx(75.0), 5.0)]
    assert q["ruler_cells"][0]["logprob_delta"] == pytest.approx(-0.2)
    # vt loses 30 points at 2048 > 5, cwe exactly 5 (80 - 75, float rounding aside): with 2 samples per cell
    # neither is decided (the minimum detectable drop is 84 points at vt 2048: paired differences 0 and 60, sd
    # 42.4, 2.80 * 42.4 / sqrt(2); vt 1024 has no spread and takes the binomial sd of a 5-point drop, 21.8:
    # 2.80 * 21.8 / sqrt(2) = 43.2 points, decided at ceil(2 * (43.2 / 5)^2) = 150 samples, 148 more)
    assert q["ruler_families"]["vt"] == {"score": pytest.approx(75.0), "logprob": pytest.approx(-1.6),
                                         "drop": pytest.approx(15.0), "worst_drop": 30.0, "worst_length": 2048,
                                         "verdict": "inconclusive", "more_samples_to_decide": 148}
    assert q["ruler_cells"][1]["drop_mde"] == pytest.approx(2.8016 * 42.426 / 2 ** 0.5, rel=1e-3)
    assert q["ruler_families"]["cwe"]["verdict"] == "inconclusive" and q["ruler_families"]["cwe"]["worst_drop"] == 5.0
    assert q["ruler_verdict"] == "inconclusive" and q["ruler_max_drop"] == 5.0
    assert "ruler_verdict" not in b and set(b["ruler_families"]) == {"vt", "cwe"}
    relaxed = aggregate(records, ["q"], Params(families=["vt", "cwe"], lengths=[1024, 2048], max_drop=30.0))
    assert relaxed["policies"]["q"]["ruler_verdict"] == "inconclusive"
    # decided verdicts (pass, fail) on cells with enough samples: tests/test_llamacpp_stats.py


def test_plot_ruler_from_metrics(tmp_path):
    cells = [{"family": f, "length": n, "samples": 2, "score": 100.0, "logprob": -0.5, "token_acc": 1.0}
             for f in ("niah_single_1", "vt") for n in (1024, 2048)]
    worse = [dict(c, score=50.0, drop=50.0, logprob=-2.0, logprob_delta=-1.5) for c in cells]
    metrics = {"baseline": {"ruler_cells": cells},
               "policies": {"int2 g32": {"ruler_cells": worse, "ruler_max_drop": 5.0,
                                         "ruler_families": {"vt": {"verdict": "fail"}}}, "x": {}}}
    files = plot_ruler(metrics, tmp_path / "plots")
    assert sorted(f.name for f in files) == ["ruler_baseline.png", "ruler_int2_g32.png"]
    assert all(f.stat().st_size > 1000 for f in files)
    assert plot_ruler({"policies": {"x": {}}}, tmp_path / "none") == []


# ----------------------------------------------------------------------------------------------------- the run


def tiny_raw(out, **params) -> dict:
    task = {"families": ["niah_single_2", "vt"], "lengths": [1300], "samples": 1, "max_new_tokens": 32, **params}
    return {"name": "tr", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int2_g32"],
            "tasks": [{"ruler": task}], "output": str(out)}


def test_params_and_bad_input(tmp_path):
    assert Params().families == list(FAMILIES) and Params(lengths=[100, 300]).seq_len == 300
    assert Params(depths=[0.0, 1.0]).depth(3) == 1.0 and Params().depth(3) is None
    assert Params(max_new_tokens=16).budget("cwe") == 16 and Params().budget("cwe") == 120
    for bad, match in (({"families": ["niah_single_9"]}, "niah_single_9"), ({"lengths": [1024, 1024]}, "duplicates"),
                       ({"depths": [1.5]}, "depths"), ({"samples": 0}, "samples")):
        with pytest.raises(KvevalError, match=match):
            validate(tiny_raw(tmp_path / "x", **bad))
    out = tmp_path / "run"
    with pytest.raises(KvevalError) as info:  # the tiny model's context is 2048 tokens
        run_experiment(validate(tiny_raw(out, lengths=[1300, 4096])), quiet=True)
    assert "\n" not in str(info.value) and "4096" in str(info.value) and "2048" in str(info.value)
    with pytest.raises(KvevalError, match="vt answer takes 30 tokens, more than the 8 generated"):
        run_experiment(validate(tiny_raw(out, max_new_tokens=8)), quiet=True)
    with pytest.raises(KvevalError, match="cwe: a prompt of 1180 tokens is too short"):
        run_experiment(validate(tiny_raw(out, families=["cwe"], max_new_tokens=None)), quiet=True)
    assert not out.exists(), "input errors surface before the results folder is touched"


def test_run_through_the_cli_writes_records_metrics_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny_raw(out)))  # JSON is YAML
    first = CliRunner().invoke(app, ["run", str(cfg), "--quiet"])
    assert first.exit_code == 0, first.output
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in records) == ["ruler/niah_single_2/L1300/s0/baseline",
                                                 "ruler/niah_single_2/L1300/s0/int2_g32",
                                                 "ruler/vt/L1300/s0/baseline", "ruler/vt/L1300/s0/int2_g32"]
    assert all(r["prompt_tokens"] == 1300 - 32 and r["max_new_tokens"] == 32 for r in records)
    for r in records:
        assert r["score"] == string_match_all(r["generated"], r["answers"])
    metrics = json.loads((out / "metrics.json").read_text())
    q = metrics["policies"]["int2_g32"]
    assert [(c["family"], c["length"], c["samples"]) for c in q["ruler_cells"]] == [("niah_single_2", 1300, 1),
                                                                                    ("vt", 1300, 1)]
    assert q["ruler_verdict"] in ("pass", "fail", "inconclusive") and set(q["ruler_families"]) == {"niah_single_2", "vt"}
    assert q["bytes_per_token"] > 0  # the memory bill is sized from the longest length
    assert plot_ruler(metrics, tmp_path / "plots")
    # kveval run draws the family x length heatmaps into the run folder
    drawn = sorted((out / "plots").glob("ruler_*.png"))
    assert [p.name for p in drawn] == ["ruler_baseline.png", "ruler_int2_g32.png"]
    assert all(p.stat().st_size > 1000 for p in drawn)
    # the report: a RULER section with the family x length table (scores from metrics.json), the figures, a reading
    report = (out / "report.md").read_text()
    section = report[report.index("## RULER"):]
    cells = {(c["family"], c["length"]): c for c in q["ruler_cells"]}
    base = {(c["family"], c["length"]): c for c in metrics["baseline"]["ruler_cells"]}
    for (family, length), c in cells.items():
        row = f"| {family} | {length} | 1 | {base[(family, length)]['score']:.1f} | {c['score']:.1f} ({-c['drop'] + 0.0:+.1f}) |"
        assert row in section, row
    assert "![RULER int2_g32](plots/ruler_int2_g32.png)" in section
    assert f"RULER score (points, all samples): baseline {metrics['baseline']['ruler_score']:.1f}, int2_g32 " in report
    html = (out / "report.html").read_text()
    assert html.count('alt="RULER ') == 2 and "data:image/png;base64," in html
    csv = (out / "tables" / "ruler.csv").read_text().splitlines()
    assert csv[0] == "run,policy,family,length,samples,score,drop,logprob,logprob_delta,verdict" and len(csv) == 5

    # resume: nothing is recomputed when everything is recorded; a lost record is recomputed alone
    calls = []
    real = ruler.evaluate

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ruler, "evaluate", counting)
    again = CliRunner().invoke(app, ["run", str(cfg), "--quiet"])
    assert again.exit_code == 0 and "resuming, 2 of 2 samples already recorded" in again.output
    assert calls == [] and json.loads((out / "metrics.json").read_text()) == metrics
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-1]))
    third = CliRunner().invoke(app, ["run", str(cfg), "--quiet"])
    assert third.exit_code == 0 and len(calls) == 1
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["policies"]["int2_g32"]["ruler_score"] == q["ruler_score"]
    assert resumed["baseline"]["ruler_answer_logprob"] == pytest.approx(metrics["baseline"]["ruler_answer_logprob"])


@pytest.mark.parametrize("name", ["ruler_quick", "ruler_8k"])
def test_task_presets(name):
    cfg = validate({"name": "t", "kv": ["int8"], "tasks": [name]})
    assert cfg.tasks[0].kind == "ruler"
    assert cfg.tasks[0].params.seq_len == {"ruler_quick": 512, "ruler_8k": 8192}[name]


@pytest.mark.integration
def test_builtin_model_prompts_and_a_short_run(builtin_model, tmp_path):
    _, tok = builtin_model
    pieces, essay = Pieces(tok), SentenceTokens(tok, split_sentences(load_text("builtin")))
    for family in FAMILIES:
        s = build(pieces, essay, family, 1024 - 48, length=1024)
        text = tok.decode(s.input_ids)
        assert len(s.input_ids) == 976 and text.startswith("<|im_start|>system"), family
        assert "<|im_start|>assistant\n" in text and len(s.answer_ids) <= 48, family
    raw = {"name": "rb", "model": "builtin:smollm2-135m", "kv": ["int8"], "output": str(tmp_path / "run"),
           "tasks": [{"ruler": {"families": ["vt"], "lengths": [512], "samples": 1,
                                "max_new_tokens": 24}}]}
    metrics = run_experiment(validate(raw), quiet=True)
    base, int8 = metrics["baseline"], metrics["policies"]["int8"]
    assert base["ruler_samples"] == int8["ruler_samples"] == 1
    # INT8 is near-lossless on this model (KLD ~1e-3): the answers' log-probabilities stay within 0.05 per token
    assert abs(int8["ruler_logprob_delta"]) < 0.05
    assert 0 <= base["ruler_score"] <= 100
    assert int8["ruler_drop"] == pytest.approx(base["ruler_score"] - int8["ruler_score"])


def test_batched_generation_gives_each_sample_the_answer_it_gets_alone(tmp_path, monkeypatch):
    """The 3 samples of a cell generated in batches of 2 (a full and a partial batch) record what batch_size 1
    records (float64: no batch rounding), and generation runs once per batch, not per sample."""
    sizes = []
    real = decoding.generate_answers

    def counting(model, tok, prompts, *a, **k):
        sizes.append(len(prompts))
        return real(model, tok, prompts, *a, **k)

    monkeypatch.setattr(decoding, "generate_answers", counting)
    runs = {}
    for size in (1, 2):
        raw = tiny_raw(tmp_path / f"b{size}", families=["niah_single_2"], lengths=[600], samples=3, batch_size=size)
        raw["model"] = {"name": "builtin:tiny-llama", "dtype": "float64"}
        run_experiment(validate(raw), quiet=True)
        runs[size] = {r["key"]: r for r in map(json.loads, (tmp_path / f"b{size}" / "records.jsonl").open())}
    assert sizes == [1] * 6 + [2, 1, 2, 1]  # (baseline, int2_g32) x 3 samples alone, then 2 batches each
    assert runs[1].keys() == runs[2].keys() and len(runs[1]) == 6
    for key, alone in runs[1].items():
        batched = runs[2][key]
        assert (batched["generated"], batched["score"]) == (alone["generated"], alone["score"]), key
        assert batched["answer_logprob"] == pytest.approx(alone["answer_logprob"], abs=1e-12)


def test_a_hand_edited_ruler_cell_fails_the_report_in_one_line(tmp_path):
    """metrics.json with a RULER score that is not a number, and families that are not a mapping: `kveval report`
    says so in one line, exit 2, and the run's figures and records stay."""
    out = tmp_path / "run"
    run_experiment(validate(tiny_raw(out, families=["niah_single_2"])), quiet=True)
    records = (out / "records.jsonl").read_bytes()
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["policies"]["int2_g32"]["ruler_cells"][0]["score"] = "abc"
    metrics["policies"]["int2_g32"]["ruler_families"] = [1, 2]
    (out / "metrics.json").write_text(json.dumps(metrics))
    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "could not convert string to float: 'abc'" in lines[0], result.stderr
    assert (out / "records.jsonl").read_bytes() == records and (out / "plots" / "ruler_int2_g32.png").is_file()
