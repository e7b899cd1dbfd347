"""The session task (issue #52): sessions and their checkers, hostile session files, the turn-by-turn decoding
through one cache (fp16 reproduces the FP session in every variant; reuse equals reprefill for a policy that
quantizes a prefill as it quantizes decoding), the metrics from records made by hand, and the refusals."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kveval.errors import KvevalError
from kveval.models import load_model
from kveval.policy import KVPolicy
from kveval.results.layout import BASELINE
from kveval.tasks.session import task as session_task
from kveval.tasks.session.aggregate import aggregate
from kveval.tasks.session.params import Params
from kveval.tasks.session.sessions import (
    TOOL_SCHEMA,
    Session,
    Turn,
    builtin_sessions,
    first_json_object,
    load_sessions,
    score_turn,
)

ROOT = Path(__file__).resolve().parent.parent
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---------------------------------------------------------------------------------------------------------------
# Sessions and checkers (pure)
# ---------------------------------------------------------------------------------------------------------------
def test_checkers_score_answers_against_known_values():
    tool = Turn("call", "json_tool", name="get_weather", arguments={"city": "Rome"}, schema=TOOL_SCHEMA)
    good = 'Sure: {"name": "get_weather", "arguments": {"city": "Rome"}} Done.'
    assert score_turn(tool, good, [], suffix="Done.")["tool"] == {"parsed": True, "schema": True, "exact": True}
    wrong_arg = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert score_turn(tool, wrong_arg, [])["tool"] == {"parsed": True, "schema": True, "exact": False}
    bad_schema = '{"name": "get_weather", "arguments": {"city": 3}}'
    assert score_turn(tool, bad_schema, [])["tool"] == {"parsed": True, "schema": False, "exact": False}
    assert score_turn(tool, "{not json", [])["tool"] == {"parsed": False, "schema": False, "exact": False}
    number = Turn("q", "number", "4821")
    assert score_turn(number, "The code is 4821. Done.", [], suffix="Done.") == {
        "correct": True, "persist": True, "tool": None, "expected": "4821"}
    assert score_turn(number, "It is 4820", [], suffix="Done.")["correct"] is False
    assert score_turn(number, "It is 4820", [], suffix="Done.")["persist"] is False
    own = Turn("again?", "own_number", own_from=0)
    assert score_turn(own, "I said 77", ["The answer is 77."])["correct"] is True
    assert score_turn(own, "I said 77", ["no number"])["correct"] is False  # nothing to recall
    assert score_turn(Turn("q", "contains", "Paris"), "it is paris", [])["correct"] is True
    assert score_turn(Turn("q", "exact", "yes"), " yes Done.", [], suffix="Done.")["correct"] is True
    # a JSON object after an unbalanced brace and one inside a string are still found; scanning is bounded
    # a prefix opens the answer: the JSON is read across it, numbers only from the generated text
    opened = Turn("call", "json_tool", name="get_weather", arguments={"city": "Rome"},
                  prefix='{"name": "get_weather", "arguments": {"city": "')
    assert score_turn(opened, 'Rome"}}', [])["tool"]["exact"] is True
    summed = Turn("How many?", "number", "10", prefix="7 + 3 = ")
    assert score_turn(summed, "10 apples.", [])["correct"] is True
    assert score_turn(summed, "11.", [])["correct"] is False
    assert score_turn(Turn("q", "number", "1", prefix="It is"), " 1. And 2.", [], sentences=1)["persist"] is False
    # the builtin instruction: one sentence, ending as a sentence ends
    assert score_turn(number, "The code is 4821.", [], sentences=1)["persist"] is True
    assert score_turn(number, "The code is 4821. It is in the box.", [], sentences=1)["persist"] is False
    assert score_turn(number, "The code is 4821", [], sentences=1)["persist"] is False  # cut off
    assert score_turn(number, "It is 4.5 or 4821!", [], sentences=1)["persist"] is True  # a decimal point
    assert score_turn(number, "The code is 4821. Done.", [], suffix="Done.", sentences=1)["persist"] is False
    assert score_turn(number, "The code is 4821", [])["persist"] is None  # nothing asked
    assert first_json_object('{ oops } then {"a": "}"}') == {"a": "}"}
    assert first_json_object("{" * 100_000) is None


def test_builtin_sessions_are_seeded_and_hold_their_facts():
    filler = [f"Sentence number {i} is here." for i in range(50)]
    a = builtin_sessions(2, filler, [0, 8], seed=3)
    assert [s.id for s in a] == ["c0-0", "c0-1", "c8-0", "c8-1"]
    assert a == builtin_sessions(2, filler, [0, 8], seed=3) and a != builtin_sessions(2, filler, [0, 8], seed=4)
    bare = builtin_sessions(2, filler, [0, 8], seed=3, prefills=False)
    assert all(t.prefix == "" for s in bare for t in s.turns) and [s.context for s in bare] == [s.context for s in a]
    assert all(t.prefix for s in a for t in s.turns)
    for s in a:
        assert s.turns[0].answer in s.context and s.turns[3].answer in s.context
        assert s.turns[2].arguments["city"] in s.context
        assert f"locker number is {s.turns[5].answer}, my desk number is {s.turns[1].answer} and" in s.turns[1].user
        x, y = (int(w) for w in s.turns[4].user.split() if w.isdigit())
        assert s.turns[4].answer == str(x + y) and s.turns[4].prefix == f"{x} + {y} = "
        assert [t.kind for t in s.turns] == ["retrieve_context", "remember_user", "tool_call", "retrieve_context",
                                             "arithmetic", "retrieve_user", "recall_own"]


# ---------------------------------------------------------------------------------------------------------------
# Hostile session files: one line naming file and line, nothing read past the refusal
# ---------------------------------------------------------------------------------------------------------------
GOOD_TURN = {"user": "What is 2 plus 2?", "answer": "4", "checker": "number"}


@pytest.mark.parametrize("line,words", [
    ({"id": "s", "turns": []}, "has no turns"),
    ({"id": "s"}, "has no turns"),
    ({"id": "s", "turns": [{"user": "hi", "answer": "x"}]}, "turn 0: no checker"),
    ({"id": "s", "turns": [{"user": "hi", "checker": "number"}]}, "needs an \"answer\""),
    ({"id": "s", "turns": [{"user": "hi", "checker": "json_tool", "name": "f", "arguments": {},
                            "schema": {"type": 7}}]}, "not a valid JSON schema"),
    ({"id": "s", "turns": [GOOD_TURN, {"user": "again", "checker": "own_number", "own_from": 1}]},
     "index of an earlier turn"),
    ({"id": "s", "turns": [GOOD_TURN], "colour": 1}, "unknown field 'colour'"),
    ({"id": "s", "turns": [GOOD_TURN], "sentences": 0}, "'sentences' is not a whole number"),
    ({"id": "s", "turns": [{**GOOD_TURN, "prefix": 7}]}, "'prefix' is missing or not a string"),
    ({"id": "a b", "turns": [GOOD_TURN]}, "the id is not"),
    ({"id": "s", "turns": [{"user": "\ud800", "answer": "1", "checker": "number"}]}, "lone surrogate"),
])
def test_a_malformed_session_is_one_line_naming_file_and_line(tmp_path, line, words):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"id": "ok", "turns": [GOOD_TURN]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(KvevalError) as err:
        load_sessions(str(path))
    assert words in str(err.value) and f"{path}:2:" in str(err.value) and "\n" not in str(err.value)


def test_duplicate_ids_folders_fifos_and_empty_files_are_refused(tmp_path):
    dup = tmp_path / "dup.jsonl"
    dup.write_text((json.dumps({"id": "a", "turns": [GOOD_TURN]}) + "\n") * 2)
    with pytest.raises(KvevalError, match=r"dup.jsonl:2: the id 'a' is used twice"):
        load_sessions(str(dup))
    with pytest.raises(KvevalError, match="is a folder"):
        load_sessions(str(tmp_path))
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(KvevalError, match="not a regular file"):  # refused before a read that would block
        load_sessions(str(fifo))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(KvevalError, match="holds no session"):
        load_sessions(str(empty))
    with pytest.raises(KvevalError, match="does not exist"):
        load_sessions(str(tmp_path / "missing.jsonl"))


def test_validate_refuses_a_bad_session_file_in_one_line_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "s", "turns": [{"user": "hi", "answer": "1"}]}) + "\n")
    out = tmp_path / "out"
    for verb in ("validate", "run"):
        proc = subprocess.run([sys.executable, "-m", "kveval", verb, "configs/session.yaml", "-o", str(out),
                               "-s", f"tasks[0].session.sessions={bad}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "no checker" in proc.stderr
        assert not out.exists()


def test_depth_buckets_beyond_the_models_context_are_not_a_length_the_run_needs(tmp_path):
    """The default buckets reach 32k; the builtin model reads 8k. Buckets say where turns are counted, so validate
    accepts them (it refused every default session config on the builtin model)."""
    proc = subprocess.run([sys.executable, "-m", "kveval", "validate", "configs/session.yaml", "-o",
                           str(tmp_path / "o"), "-s", "tasks[0].session.depth_buckets=[1024,32768]"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_a_session_longer_than_the_models_context_is_refused_before_the_run_starts(tmp_path):
    long = tmp_path / "long.jsonl"
    turns = [{"user": "word " * 9000 + "What is 2 plus 2?", "answer": "4", "checker": "number"}]
    long.write_text(json.dumps({"id": "long", "turns": turns}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kveval", "run", "configs/session.yaml", "-o", str(out), "-s",
                           "kv=[int8]", "-s", f"tasks[0].session.sessions={long}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "session 'long' needs up to" in proc.stderr
    assert "more than the model's context" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "records.jsonl").exists()


# ---------------------------------------------------------------------------------------------------------------
# Decoding through the cache
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_llama64():
    """tiny-llama in float64 with a ChatML template on a copy of its tokenizer (its own has none), its matrices
    scaled to a spread of 0.2 (from 0.02) so that its greedy tokens depend on the input and a quantized cache
    changes some of them (at 0.02 it answers one token to everything, and no policy's answer ever differs)."""
    import torch

    model, tok = load_model("builtin:tiny-llama", dtype="float64")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    tok = copy.deepcopy(tok)
    tok.chat_template = CHATML
    return model, tok


def _sessions() -> list[Session]:
    turns = (Turn("The blue box holds 4821. What does it hold?", "number", "4821"),
             Turn("My number is 37. Say it.", "number", "37"),
             Turn("And again?", "own_number", own_from=1))
    return [Session(id="a", system="Be brief.", turns=turns, suffix="Done."),
            Session(id="b", system="", turns=turns[:2], context="Some document text. " * 8)]


def _ctx(model, tok, policies, tmp_path: Path):
    from kveval.results.store import RunDir

    run = RunDir.open(tmp_path, {"name": "s"}).task_view()
    progress = SimpleNamespace(log=lambda m: None, task=lambda *a, **k: _bar())
    cfg = SimpleNamespace(seed=0, model=SimpleNamespace(dtype="float64"))
    return SimpleNamespace(model=model, tokenizer=tok, policies=policies, run=run, progress=progress, cache={},
                           cfg=cfg)


class _bar:
    def __enter__(self):
        return lambda *a, **k: None

    def __exit__(self, *exc):
        return False


def _run(ctx, params, sessions, monkeypatch):
    monkeypatch.setattr(session_task, "session_set", lambda c, p: sessions)
    return session_task.run(ctx, params)


def test_fp16_reproduces_the_fp_session_in_every_variant(chat_llama64, tmp_path, monkeypatch):
    model, tok = chat_llama64
    params = Params(variants=["reuse", "reprefill", "fp_history"], max_new_tokens=6, depth_buckets=[64, 256])
    ctx = _ctx(model, tok, {"fp16": KVPolicy.preset("fp16")}, tmp_path)
    metrics = _run(ctx, params, _sessions(), monkeypatch)
    recs = {(r["session"], r["policy"], r["variant"]): r for r in ctx.run.records()}
    for sid in ("a", "b"):
        fp = recs[(sid, BASELINE, "fp")]["turns"]
        for v in params.variants:
            mine = recs[(sid, "fp16", v)]["turns"]
            assert [t["tokens"] for t in mine] == [t["tokens"] for t in fp], (sid, v)
            assert [t["depth"] for t in mine] == [t["depth"] for t in fp], (sid, v)
        assert all(t["kld_mean"] == 0.0 and t["kld_max"] == 0.0 for t in recs[(sid, "fp16", "fp_history")]["turns"])
    for v in params.variants:
        s = metrics["policies"]["fp16"]["session"][v]
        assert s["drop"] == 0.0 and s["accuracy"] == metrics[BASELINE]["session"]["accuracy"]
    # the history grows by every turn's new ids and the answer the model wrote
    a = recs[("a", BASELINE, "fp")]["turns"]
    assert a[1]["depth"] == len(a[0]["fed"]) + len(a[0]["tokens"])
    assert a[1]["fed"][0] == a[0]["tokens"][-1]  # the answer's last token is the next turn's first


def test_reuse_equals_reprefill_where_a_prefill_is_quantized_as_decoding_is(chat_llama64, tmp_path, monkeypatch):
    """vllm_int8_per_token_head quantizes every token alone and its prefill reads the quantized keys, as decoding
    does: the history a turn reads is the same whether it was stored turn by turn or prefilled again (float64:
    the same tokens). int4_g32's prefill reads its own chunk in full precision, so the two may differ."""
    model, tok = chat_llama64
    params = Params(variants=["reuse", "reprefill"], max_new_tokens=6, depth_buckets=[64, 256])
    ctx = _ctx(model, tok, {"pt": KVPolicy.preset("vllm_int8_per_token_head")}, tmp_path)
    _run(ctx, params, _sessions(), monkeypatch)
    recs = {(r["session"], r["variant"]): r for r in ctx.run.records() if r["policy"] == "pt"}
    for sid in ("a", "b"):
        assert [t["tokens"] for t in recs[(sid, "reuse")]["turns"]] == \
            [t["tokens"] for t in recs[(sid, "reprefill")]["turns"]]


HOOKED = ("vllm_fp8_fa3", "llamacpp_q4_0")  # transforms that hook the query or the attention output


@pytest.mark.parametrize("name", ["int4_g32", "kivi2", "int2_g32", *HOOKED])
def test_a_fork_holds_what_its_cache_held_and_shares_the_model(chat_llama64, name):
    """QuantizedKVCache.fork: both go on independently (the trunk's logits are those of a cache never forked), the
    fork decodes as a cache fed the same ids from the start, the attention modules are the model's (deepcopy copied
    them, and a cache whose transforms hook the attention lost its hooks)."""
    import torch

    from kveval.tasks.session.conversation import Conversation

    model, _ = chat_llama64
    policy = KVPolicy.preset(name)
    ids = list(range(5, 45))
    trunk = Conversation.start(model, policy)
    trunk.feed(ids[:30])
    fork = trunk.fork()
    assert all(a.module is b.module for a, b in zip(trunk.cache.layers, fork.cache.layers) if hasattr(a, "module"))
    branch_logits = [fork.feed([t]) for t in (7, 8, 9)]
    trunk_logits = [trunk.feed([t]) for t in ids[30:34]]
    alone = Conversation.start(model, policy)
    alone.feed(ids[:30])
    assert all(torch.equal(a, alone.feed([t])) for a, t in zip(trunk_logits, ids[30:34]))
    again = Conversation.start(model, policy)
    again.feed(ids[:30])
    assert all(torch.equal(a, again.feed([t])) for a, t in zip(branch_logits, (7, 8, 9)))


@pytest.mark.parametrize("name", ["int4_g32", "kivi2", "int2_g32", *HOOKED])
def test_fp_history_answers_are_those_of_separate_decodings_of_the_fp_history(chat_llama64, tmp_path, monkeypatch,
                                                                              name):
    """The baseline and fp_history decoded together (kveval.tasks.session.follow: the policy's answer read off the
    teacher-forced trunk while it agrees with the FP answer, forked where it does not) give the answers and KLDs of
    the plain algorithm: per turn, a fresh cache fed the FP conversation's calls up to the turn, then its own
    greedy answer; the FP side as its own greedy decoding. float64, every policy family with a branch point."""
    from kveval.tasks.session.conversation import Conversation, kld

    model, tok = chat_llama64
    params = Params(variants=["fp_history"], max_new_tokens=8, depth_buckets=[64, 256])
    ctx = _ctx(model, tok, {name: KVPolicy.preset(name)}, tmp_path)
    _run(ctx, params, _sessions(), monkeypatch)
    recs = {(r["session"], r["policy"]): r for r in ctx.run.records()}
    eos = {tok.eos_token_id}
    diverged = 0
    for session in _sessions():
        fp = recs[(session.id, BASELINE)]["turns"]
        mine = recs[(session.id, name)]["turns"]
        trunk, fp_conv = Conversation.start(model, KVPolicy.preset(name)), Conversation.start(model, None)
        for j, turn in enumerate(mine):
            # the KLD along the FP answer: both caches teacher-forced on the FP conversation
            klds = [kld(fp_conv.feed(fp[j]["fed"]), trunk.feed(fp[j]["fed"]))]
            klds += [kld(fp_conv.feed([t]), trunk.feed([t])) for t in fp[j]["tokens"][:-1]]
            assert (turn["kld_mean"], turn["kld_max"]) == (sum(klds) / len(klds), max(klds)), (session.id, j)
            # the answer: a fresh cache fed the FP conversation's calls before turn j, then its own greedy tokens
            conv = Conversation.start(model, KVPolicy.preset(name))
            for earlier in fp[:j]:
                for call in [earlier["fed"], *[[t] for t in earlier["tokens"][:-1]]]:
                    conv.feed(call)
            assert turn["tokens"] == conv.greedy(conv.feed(fp[j]["fed"]), params.max_new_tokens, eos), (session.id, j)
            diverged += turn["tokens"] != fp[j]["tokens"]
    if name in ("int2_g32", "int4_g32"):
        assert diverged, "no answer left the FP answer: the fork was never exercised"


#: the emulation contract across turns, per family of what a cache keeps (short windows, so that a session of the
#: tiny model crosses their boundaries)
CONTRACT = {
    "per_token": "int4_g32",  # prefill: fp, every token quantized when stored
    "kivi_blocks": {"key": {"preset": "int2_channel", "group_size": 16}, "value": "int2_g32", "residual": 16,
                    "residual_mode": {"key": "block", "value": "sliding_lag"}},  # per-channel key blocks, FP window
    "sinks": {"spec": "int2_g32", "sink_tokens": 4, "residual": 8, "residual_mode": "sliding"},
    "rotation": "llamacpp_q4_0",  # Hadamard rotation hooks the query and output; prefill: quantized
}


@pytest.mark.parametrize("name", list(CONTRACT))
def test_the_emulation_contract_holds_across_turns(chat_llama64, tmp_path, monkeypatch, name):
    """The next-token distributions at every position of a session decoded through the real cache (each turn's
    new ids one call onto the history, each answer token one call: the reuse variant's calls) equal those of one
    emulated pass over the session's whole token sequence with the same call boundaries (emulate's prefill_len and
    chunks), float64. Without the chunks the emulation reads later turns as if decoded token by token, which a
    prefill: fp policy does not: the test sees the difference."""
    import torch

    from kveval.patch import QuantizedKVCache, cache_kwargs, emulate

    model, tok = chat_llama64
    cfg = CONTRACT[name]
    policy = KVPolicy.preset(cfg) if isinstance(cfg, str) else KVPolicy.from_config(cfg, name)
    params = Params(variants=["reuse"], max_new_tokens=6, depth_buckets=[64, 256])
    ctx = _ctx(model, tok, {name: policy}, tmp_path)
    _run(ctx, params, _sessions()[:1], monkeypatch)
    turns = next(r for r in ctx.run.records() if r["policy"] == name)["turns"]
    calls = [c for t in turns for c in [t["fed"], *[[x] for x in t["tokens"][:-1]]]]
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    real, pos = [], 0
    with torch.no_grad():
        for c in calls:
            out = model(torch.tensor([c]), use_cache=True, position_ids=torch.arange(pos, pos + len(c))[None], **kw)
            real.append(out.logits[0])
            pos += len(c)
    real_logits = torch.cat(real)
    ids = torch.tensor([[x for c in calls for x in c]])
    starts = [sum(len(c) for c in calls[:i]) for i in range(len(calls))]
    chunks = [(a, a + len(c)) for a, c in zip(starts[1:], calls[1:]) if len(c) > 1]
    assert len(chunks) == len(turns) - 1 and pos > 128  # every later turn one chunk; past the windows
    with torch.no_grad(), emulate(model, policy, prefill_len=len(calls[0]), chunks=chunks):
        emulated = model(ids).logits[0]
    assert torch.allclose(real_logits, emulated, rtol=0, atol=1e-9), float((real_logits - emulated).abs().max())
    # the ends of the calls give the recorded answers' first tokens (greedy)
    ends = [a + len(c) - 1 for a, c in zip(starts, calls) if len(c) > 1]
    assert [int(emulated[e].argmax()) for e in ends] == [t["tokens"][0] for t in turns]
    if policy.prefill == "fp":
        with torch.no_grad(), emulate(model, policy, prefill_len=len(calls[0])):
            as_decoded = model(ids).logits[0]
        assert not torch.allclose(real_logits, as_decoded, rtol=0, atol=1e-6)


def test_emulate_refuses_chunks_that_are_not_rising_calls_after_the_prompt(chat_llama64):
    from kveval.patch import emulate

    model, _ = chat_llama64
    for chunks in ([(3, 8)], [(10, 12), (11, 14)], [(12, 12)], [(20, 24), (12, 14)]):
        with pytest.raises(ValueError, match="rising, non-overlapping"), \
                emulate(model, KVPolicy.preset("int4_g32"), prefill_len=10, chunks=chunks):
            pass


def test_a_session_resumes_to_the_same_metrics(chat_llama64, tmp_path, monkeypatch):
    model, tok = chat_llama64
    params = Params(variants=["reuse", "fp_history"], max_new_tokens=5, depth_buckets=[64, 256])
    policies = {"int4": KVPolicy.preset("int4_g32")}
    whole = _run(_ctx(model, tok, policies, tmp_path / "whole"), params, _sessions(), monkeypatch)
    part = tmp_path / "part"
    _run(_ctx(model, tok, policies, part), params, _sessions(), monkeypatch)
    lines = (part / "records.jsonl").read_text().splitlines()
    (part / "records.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])  # killed
    again = _run(_ctx(model, tok, policies, part), params, _sessions(), monkeypatch)
    assert json.dumps(again, sort_keys=True) == json.dumps(whole, sort_keys=True)


def test_a_model_without_a_chat_template_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kveval", "run", "configs/session.yaml", "-o", str(tmp_path / "o"),
                           "-s", "model.name=builtin:tiny-llama", "-s", "kv=[int4_g32]"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no chat template" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# Metrics from records made by hand
# ---------------------------------------------------------------------------------------------------------------
def _rec(sid, who, variant, correct, depths, tool=None):
    turns = [{"turn": k, "depth": d, "correct": c, "persist": None, "tool": tool if k == 1 else None}
             for k, (c, d) in enumerate(zip(correct, depths))]
    return {"task": "session", "session": sid, "policy": who, "variant": variant, "turns": turns}


def test_accuracy_by_depth_effective_depth_survival_and_the_paired_verdict():
    sessions = [Session(id=s, system="", turns=(Turn("a", "number", "1"),) * 3) for s in ("x", "y")]
    depths = [10, 300, 700]  # buckets 256, 512, 1024
    tool = {"parsed": True, "schema": True, "exact": False}
    records = [_rec("x", BASELINE, "fp", [1, 1, 1], depths, tool), _rec("y", BASELINE, "fp", [1, 1, 0], depths),
               _rec("x", "p", "reuse", [1, 1, 0], depths, tool), _rec("y", "p", "reuse", [1, 0, 0], depths)]
    params = Params(depth_buckets=[256, 512, 1024], max_drop=5.0)
    m = aggregate(records, sessions, ["p"], params)
    base, p = m[BASELINE]["session"], m["policies"]["p"]["session"]["reuse"]
    assert base["by_depth"] == [{"upto": 256, "turns": 2, "accuracy": 1.0}, {"upto": 512, "turns": 2, "accuracy": 1.0},
                                {"upto": 1024, "turns": 2, "accuracy": 0.5}]
    assert [r["accuracy"] for r in p["by_depth"]] == [1.0, 0.5, 0.0]
    assert p["depth_area"] == pytest.approx(0.5) and base["depth_area"] == pytest.approx(2.5 / 3)
    assert p["effective_depth"] == 256  # 512: 50 points below the baseline
    assert p["by_turn"] == [1.0, 0.5, 0.0] and p["survival"] == [1.0, 0.5, 0.0]
    assert p["first_failure"] == {"x": 2, "y": 1} and base["first_failure"] == {"x": None, "y": 2}
    assert p["recovery"] == pytest.approx(100 * 0.5 / (5 / 6))
    assert p["drop"] == pytest.approx(100 * 2 / 6) and p["paired_turns"] == 6
    assert p["tool"]["exact"] == 0.0 and p["tool"]["parsed"] == 1.0 and p["tool"]["turns"] == 1
    # 6 paired turns cannot resolve 5 points: the verdict says so and how many sessions more would decide
    assert p["verdict"] == "inconclusive" and p["more_sessions_to_decide"] > 0


def test_length_area_and_effective_length_as_mrcr_and_ruler_define_them():
    from kveval.stats import effective_length, length_area

    base = {1024: 90.0, 2048: 88.0, 4096: 80.0, 8192: 70.0}
    mine = {1024: 89.0, 2048: 84.0, 4096: 60.0, 8192: 69.0}  # 4k drops 20 points: the effective length is 2k
    assert length_area(mine) == pytest.approx((89 + 84 + 60 + 69) / 4) and length_area({}) is None
    assert effective_length(mine, base, 5.0) == 2048
    assert effective_length(mine, base, 25.0) == 8192
    assert effective_length({1024: 50.0}, base, 5.0) is None
    assert effective_length({1024: 89.0, 2048: None, 4096: 80.0}, base, 5.0) == 4096  # a missing length skipped


def test_needle_reports_the_area_over_lengths_and_the_effective_length():
    from kveval.tasks.needle.task import aggregate as needle_aggregate

    def rec(policy, context, trial, hit):
        return {"task": "needle", "policy": policy, "variant": "passkey", "context": context, "depth": 0.5,
                "trial": trial, "exact_match": hit, "answer_logprob": -1.0, "answer_token_acc": 1.0}

    records = [rec(p, c, t, int(p == BASELINE or c == 64 or t == 0)) for p in (BASELINE, "q") for c in (64, 128)
               for t in range(2)]
    m = needle_aggregate(records, ["q"], max_drop=10.0)
    assert m[BASELINE]["needle_length_area"] == 100.0
    assert m["policies"]["q"]["needle_length_area"] == pytest.approx(75.0)
    assert m["policies"]["q"]["needle_effective_length"] == 64  # 128: 50 points below the baseline


@pytest.mark.integration
def test_the_builtin_session_config_runs_and_reports(tmp_path):
    """configs/session.yaml at a tiny size on the builtin chat model: records per (session, who, variant), the
    metrics, tables/session.csv and the report's Sessions section with its figure; a rerun resumes."""
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "kveval", "run", "configs/session.yaml", "-o", str(out), "--quiet",
           "-s", "kv=[int8]", "-s", "tasks[0].session.sessions_per_size=1", "-s",
           "tasks[0].session.context_sentences=[0]", "-s", "tasks[0].session.max_new_tokens=4",
           "-s", "tasks[0].session.variants=[reuse,fp_history]"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    keys = [json.loads(line)["key"] for line in (out / "records.jsonl").read_text().splitlines()]
    # a session's baseline and fp_history runs are decoded together, then the reuse runs
    assert keys == ["session/c0-0/baseline/fp", "session/c0-0/int8/fp_history", "session/c0-0/int8/reuse"]
    m = json.loads((out / "metrics.json").read_text())
    s = m["policies"]["int8"]["session"]
    assert set(s) == {"reuse", "fp_history"} and len(s["fp_history"]["kld_by_turn"]) == 7
    assert all(k is not None and k >= 0 for k in s["fp_history"]["kld_by_turn"])
    assert (out / "tables" / "session.csv").is_file() and (out / "plots" / "session_depth.png").is_file()
    assert "## Sessions" in (out / "report.md").read_text()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resuming, 3 of 3 session runs already recorded" in again.stdout
    assert json.loads((out / "metrics.json").read_text()) == m
