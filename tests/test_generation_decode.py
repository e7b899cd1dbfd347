"""The generation task's lockstep decoding loop (issue #42): one model, the FP cache and a policy's real quantized
cache, the same prefix at every step. Its greedy tokens are ``generate``'s (plain and through the real cache), the
policy's per-step distributions are the emulation's over the finished sequence (the emulation contract on the
model's own output), nothing quantized means KLD exactly 0, seeded samples are reproducible and independent of
the batch, and NaN stops it with one line."""

from __future__ import annotations

import copy

import pytest
import torch

from kveval.errors import KvevalError
from kveval.models.builtin import TINY_FAMILIES, build_tiny_model
from kveval.patch import emulate
from kveval.policy import KVPolicy
from kveval.tasks.common.decoding import greedy_tokens
from kveval.tasks.common.lockstep import Sampling, lockstep_generate, sample_token

EOS = {2}
PAD = 0
CHANNEL2 = {"bits": 2, "granularity": "channel", "mapping": "asymmetric"}
# KIVI's schedule (per-channel key blocks, lagging values) with a residual short enough to flush while decoding
KIVI_SHORT = {"key": CHANNEL2, "value": "int2_g32", "residual": 4, "sink_tokens": 1,
              "residual_mode": {"key": "block", "value": "sliding_lag"}}
LENGTHS = (13, 7, 10)  # left padding 0, 6, 3


def _prompts(model, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _run(model, prompts, policy, driver, n, **kwargs):
    return lockstep_generate(model, prompts, policy, driver=driver, max_new_tokens=n, eos_ids=EOS, pad_id=PAD,
                             **kwargs)


@pytest.mark.parametrize("name", ["int4_g32", "llamacpp_q4_0"])
def test_fp_driver_greedy_equals_plain_generate(tiny_llama64, name):
    """The FP model's tokens, whatever the policy's cache beside it does (llamacpp_q4_0's rotation hooks the
    attention of exactly the calls that receive the quantized cache, never the FP cache's)."""
    model, _ = tiny_llama64
    prompts = _prompts(model)
    policy = KVPolicy.preset(name)
    rows = _run(model, prompts, policy, "fp", 12)
    assert [r.tokens for r in rows] == greedy_tokens(model, prompts, 12)
    assert all(len(r.kld) == len(r.tokens) and all(k > 0 for k in r.kld[1:]) for r in rows)
    # with prefill: fp the prompt's queries read it in full precision: the first step agrees (llama.cpp's do not)
    assert all((r.kld[0] == 0.0) == (policy.prefill == "fp") for r in rows)


@pytest.mark.parametrize("policy", [KVPolicy.preset("int4_g32"), KVPolicy.preset("kivi2"),
                                    KVPolicy.preset("llamacpp_q4_0"),
                                    KVPolicy.from_config(KIVI_SHORT, name="kivi_short")], ids=lambda p: p.name)
def test_policy_driver_greedy_equals_generate_through_the_real_cache(tiny_llama64, policy):
    model, _ = tiny_llama64
    prompts = _prompts(model)
    rows = _run(model, prompts, policy, "policy", 12)
    assert [r.tokens for r in rows] == greedy_tokens(model, prompts, 12, policy)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama64"])
@pytest.mark.parametrize("driver", ["policy", "fp"])
def test_nothing_quantized_gives_the_fp_tokens_and_zero_kld(fixture, driver, request):
    """The fp16 policy (spec none) through the real cache, and policy None (two DynamicCaches): FP's tokens, every
    step's KLD exactly 0, in float32 and float64."""
    model, _ = request.getfixturevalue(fixture)
    prompts = _prompts(model)
    want = greedy_tokens(model, prompts, 10)
    for policy in (KVPolicy.preset("fp16"), None):
        rows = _run(model, prompts, policy, driver, 10)
        assert [r.tokens for r in rows] == want
        assert all(k == 0.0 for r in rows for k in r.kld) and all(len(r.kld) == 10 for r in rows)
        assert [r.ended for r in rows] == ["length"] * 3


@pytest.mark.parametrize("config", [{"spec": "int4_g32", "residual": 3, "sink_tokens": 2}, KIVI_SHORT],
                         ids=["sliding_sinks", "kivi_short"])
def test_per_step_distributions_are_the_emulated_pass_over_the_own_output(tiny_llama64, config):
    """The emulation contract on the policy's own trajectory: the log-probs the loop saw at each step, and its KLD
    list, equal those of ONE teacher-forced pass over prompt + generated tokens under ``emulate`` (prefill = the
    prompt) against one unpatched pass, for the unpadded row and for a padded one (each alone there)."""
    model, _ = tiny_llama64
    policy = KVPolicy.from_config(config, name="p")
    prompts = _prompts(model, (12, 7), seed=1)
    rows = _run(model, prompts, policy, "policy", 16, record_logprobs=True)
    for prompt, row in zip(prompts, rows):
        n = len(row.tokens)
        assert n == 16 and len(row.logprobs) == n
        ids = torch.tensor([prompt + row.tokens[:-1]])
        with torch.no_grad():
            with emulate(model, policy, prefill_len=len(prompt)):
                emulated = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:], dim=-1)
            fp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:], dim=-1)
        torch.testing.assert_close(torch.stack(row.logprobs), emulated, rtol=0, atol=1e-10)
        want = (fp.exp() * (fp - emulated)).sum(-1).tolist()
        assert max(want) > 1e-6, "the policy must differ from FP, or the comparison proves nothing"
        assert row.kld == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_sampling_is_seeded_per_row(tiny_llama, tiny_llama64):
    model, _ = tiny_llama
    policy = KVPolicy.preset("int4_g32")
    prompts = _prompts(model)
    plain = Sampling(temperature=1.0, top_p=1.0, seeds=[1, 2, 3])
    first = [r.tokens for r in _run(model, prompts, policy, "policy", 16, sampling=plain)]
    assert first == [r.tokens for r in _run(model, prompts, policy, "policy", 16, sampling=plain)]
    other = [r.tokens for r in _run(model, prompts, policy, "policy", 16, sampling=Sampling(1.0, 1.0, [4, 5, 6]))]
    assert all(a != b for a, b in zip(first, other))
    assert first != [r.tokens for r in _run(model, prompts, policy, "policy", 16)], "samples, not the argmax"

    model, _ = tiny_llama64  # a row's samples do not depend on its batch (float64: no rounding flips a draw)
    nucleus = Sampling(temperature=0.8, top_p=0.9, seeds=[7, 8, 9])
    for driver in ("policy", "fp"):
        batched = _run(model, prompts, policy, driver, 16, sampling=nucleus)
        for r, prompt in enumerate(prompts):
            alone = _run(model, [prompt], policy, driver, 16, sampling=Sampling(0.8, 0.9, [nucleus.seeds[r]]))[0]
            assert alone.tokens == batched[r].tokens
            assert alone.kld == pytest.approx(batched[r].kld, rel=1e-9, abs=1e-15)


def test_sample_token_keeps_the_nucleus_and_its_proportions():
    """top_p 0.7 over (0.5, 0.3, 0.15, 0.05): the nucleus is the two most likely tokens (0.5 < 0.7 <= 0.8),
    renormalised to (0.625, 0.375); temperature 1 keeps the distribution."""
    scores = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)
    draws = [sample_token(scores, Sampling(1.0, 0.7, [0]), g) for _ in range(4000)]
    assert set(draws) == {0, 1}
    assert draws.count(0) / len(draws) == pytest.approx(0.625, abs=0.03)
    g = torch.Generator().manual_seed(0)
    draws = [sample_token(scores, Sampling(1.0, 1.0, [0]), g) for _ in range(4000)]
    assert draws.count(3) / len(draws) == pytest.approx(0.05, abs=0.015)


def test_rows_end_at_eos_or_stop_and_the_others_go_on(tiny_llama64):
    model, _ = tiny_llama64
    prompts = _prompts(model)
    policy = KVPolicy.preset("int4_g32")
    free = _run(model, prompts, policy, "policy", 12)
    eos = free[1].tokens[4]  # row 1 ends at its 5th token
    cut = lockstep_generate(model, prompts, policy, driver="policy", max_new_tokens=12, eos_ids={eos}, pad_id=PAD)
    for f, c in zip(free, cut):
        end = f.tokens.index(eos) + 1 if eos in f.tokens else len(f.tokens)
        assert c.tokens == f.tokens[:end] and c.kld == f.kld[:end]
        assert c.ended == ("eos" if eos in f.tokens else "length")
    assert cut[1].ended == "eos" and len(cut[1].tokens) <= 5
    stopped = _run(model, prompts, policy, "policy", 12, stop=lambda tokens: len(tokens) >= 3 + tokens[0] % 4)
    for f, s in zip(free, stopped):
        assert s.ended == "stop" and s.tokens == f.tokens[:3 + f.tokens[0] % 4]


def test_nan_weights_stop_the_loop_with_one_line(tiny_llama):
    model = copy.deepcopy(tiny_llama[0])
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    for policy in (KVPolicy.preset("int4_g32"), None):
        with pytest.raises(KvevalError, match="NaN") as info:
            _run(model, _prompts(model), policy, "policy", 4, where="prompt 3")
        assert "\n" not in str(info.value) and "prompt 3" in str(info.value)
        assert "without any KV quantization" in str(info.value), "the model's own fault, not the policy's"


def test_arguments_are_checked(tiny_llama):
    model, _ = tiny_llama
    with pytest.raises(ValueError, match="driver"):
        _run(model, [[5, 6]], None, "both", 2)
    with pytest.raises(ValueError, match="one seed per prompt"):
        _run(model, [[5, 6]], None, "fp", 2, sampling=Sampling(1.0, 1.0, [1, 2]))
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, 0.0, [1])


@pytest.mark.parametrize("driver", ["policy", "fp"])
def test_without_kld_only_the_driver_runs_and_its_tokens_are_the_same(tiny_llama64, driver):
    """``measure_kld=False`` (samples, the baseline): the driver's tokens and log-probs as with both caches, and no
    KLD; seeded samples too."""
    model, _ = tiny_llama64
    prompts = _prompts(model)
    policy = KVPolicy.from_config(KIVI_SHORT, name="kivi_short")
    for sampling in (None, Sampling(0.8, 0.9, [1, 2, 3])):
        both = _run(model, prompts, policy, driver, 12, sampling=sampling, record_logprobs=True)
        alone = _run(model, prompts, policy, driver, 12, sampling=sampling, record_logprobs=True, measure_kld=False)
        assert [r.tokens for r in alone] == [r.tokens for r in both]
        assert all(r.kld == [] for r in alone)
        if driver == "policy":  # with both caches the kept log-probs are the policy's: the driver's here
            for a, b in zip(alone, both):
                torch.testing.assert_close(torch.stack(a.logprobs), torch.stack(b.logprobs), rtol=0, atol=0)


@pytest.mark.parametrize("policy", [KVPolicy.from_config({"spec": "int4_g32", "residual": 3, "sink_tokens": 2},
                                                         name="sliding_sinks"),
                                    KVPolicy.from_config(KIVI_SHORT, name="kivi_short"),
                                    KVPolicy.preset("llamacpp_q4_0")], ids=lambda p: p.name)
@pytest.mark.parametrize("driver", ["fp", "policy"])
def test_the_kld_of_one_teacher_forced_pass_is_the_real_caches_while_decoding(tiny_llama64, policy, driver):
    """The task's KLD along a path (the FP model's greedy output for ``fp_path``, the policy's own for ``greedy``)
    from ONE teacher-forced pass, FP and emulated, equals at every step the KLD the lockstep loop measures while the
    real cache decodes that path token by token beside the FP model's cache (float64)."""
    from kveval.tasks.common.teacher import path_kld

    model, _ = tiny_llama64
    prompts = _prompts(model, (12, 7), seed=2)
    rows = _run(model, prompts, policy, driver, 16)
    for prompt, row in zip(prompts, rows):
        got = path_kld(model, prompt, row.tokens, {"p": policy, "fp16": KVPolicy.preset("fp16")})
        assert max(row.kld) > 1e-6, "the policy must differ from FP, or the comparison proves nothing"
        assert got["p"] == pytest.approx(row.kld, rel=1e-9, abs=1e-15)
        assert got["fp16"] == [0.0] * len(row.tokens)  # nothing quantized: the same pass, exactly 0


def test_the_fp_path_pass_works_in_chunks(tiny_llama64, monkeypatch):
    """The log-softmaxes of a long trajectory are formed a chunk at a time: the same numbers as in one piece."""
    from kveval.tasks.common import teacher

    model, _ = tiny_llama64
    prompt, = _prompts(model, (9,), seed=3)
    tokens = _run(model, [prompt], None, "fp", 20, measure_kld=False)[0].tokens
    policy = {"p": KVPolicy.preset("int4_g32")}
    whole = teacher.path_kld(model, prompt, tokens, policy)["p"]
    monkeypatch.setattr(teacher, "CHUNK", 3)
    assert teacher.path_kld(model, prompt, tokens, policy)["p"] == whole
    assert len(whole) == len(tokens) == 20 and all(v > 0 for v in whole[1:])


def test_both_read_paths_give_the_same_generation(tiny_llama64):
    """The lean read path (a transient buffer per step) and the buffered one (a resident buffer) are two ways to
    read the same stored cache: the same tokens and KLDs (float64), on a policy that flushes while decoding."""
    model, _ = tiny_llama64
    prompts = _prompts(model)
    policy = KVPolicy.from_config(KIVI_SHORT, name="kivi_short")
    lean = _run(model, prompts, policy, "policy", 14, read="lean")
    buffered = _run(model, prompts, policy, "policy", 14, read="buffered")
    assert [r.tokens for r in lean] == [r.tokens for r in buffered]
    for a, b in zip(lean, buffered):
        assert a.kld == pytest.approx(b.kld, rel=1e-12, abs=1e-15) and max(a.kld) > 1e-6


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_one_cache_decoding_gives_generate_s_tokens_on_every_family(family):
    """The loop copies ``generate``'s position ids and mask handling (transformers 5.25): on every tiny attention
    family, a left-padded batch decoded through one cache (the task's mode, ``measure_kld=False``) gives
    ``generate``'s greedy tokens, plain and through the real quantized cache, so a transformers upgrade that
    changes them shows here. A family whose design the real cache refuses is refused by both in one line."""
    model = build_tiny_model(family)
    prompts = _prompts(model)
    eos = set()  # random weights: no row ends early, every step compared
    for policy in (None, KVPolicy.preset("int4_g32")):
        try:
            expected = greedy_tokens(model, prompts, 6, policy, pad_id=PAD, eos_ids=eos)
        except KvevalError as refused:
            with pytest.raises(KvevalError) as again:
                lockstep_generate(model, prompts, policy, driver="policy", max_new_tokens=6, eos_ids=eos, pad_id=PAD,
                                  measure_kld=False)
            assert str(again.value) == str(refused) and "\n" not in str(refused)
            continue
        rows = lockstep_generate(model, prompts, policy, driver="fp" if policy is None else "policy",
                                 max_new_tokens=6, eos_ids=eos, pad_id=PAD, measure_kld=False)
        assert [r.tokens for r in rows] == expected, (family, policy and policy.name)
