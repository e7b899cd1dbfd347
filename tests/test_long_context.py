"""Long contexts (issue #20): batched generation through the real cache with left padding (each row exactly as if
it were decoded alone), emulation without ``[T, T]`` masks (query chunks over per-query thresholds), the cache's
preallocated buffers (bytes == bill after every call), and perplexity windows with KLD by absolute position."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.patch.cache import LayerHoldings, left_padding_of
from kveval.patch.quantizers import layer_quantizers
from kveval.policy import KVPolicy
from kveval.stats import compare_logits
from kveval.tasks.common.decoding import generate_answer, generate_answers, greedy_tokens, left_padded

EMULATE = importlib.import_module("kveval.patch.emulate")  # the module (kveval.patch.emulate is the function)
PERPLEXITY = importlib.import_module("kveval.tasks.perplexity.scorer")

CHANNEL2 = {"bits": 2, "granularity": "channel", "mapping": "asymmetric"}
POLICIES = {
    # sinks are each row's first real tokens; the residual counts real tokens
    "sliding_sinks": {"spec": "int4_g32", "residual": 3, "sink_tokens": 2},
    # per-channel key blocks counted from each row's sinks (statistics never see padding), KIVI's lagging values
    "kivi_blocks_sinks": {"key": CHANNEL2, "value": "int2_g32", "residual": 4, "sink_tokens": 1,
                          "residual_mode": {"key": "block", "value": "sliding_lag"}},
    # transformers' schedule: blocks counted from each row's own prompt end; prompt queries read the cache
    "prompt_block_quantized": {"key": "int2_g32", "value": "int4_g32", "residual": 4,
                               "residual_mode": "prompt_block", "prefill": "quantized"},
}
PROMPT_LENGTHS = (13, 7, 10, 3)  # left padding 0, 6, 3, 10 in one batch


def _prompts(model, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------------------------
# Batched generation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("model_fixture", ["tiny_llama64", "tiny_gemma3_64"])
def test_batched_generation_equals_each_prompt_alone_and_the_emulated_argmax(name, model_fixture, request):
    """Greedy tokens of a left-padded batch through one cache == each prompt generated alone == the argmax
    continuation of one emulated pass over prompt + generated tokens (float64; tiny-gemma3 has sliding layers)."""
    model, _ = request.getfixturevalue(model_fixture)
    policy = KVPolicy.from_config(POLICIES[name])
    prompts = _prompts(model)
    batched = greedy_tokens(model, prompts, 10, policy)
    assert batched == [greedy_tokens(model, [p], 10, policy)[0] for p in prompts]
    for prompt, tokens in zip(prompts, batched):
        assert tokens, "the model generated nothing; the comparison would prove nothing"
        ids = torch.tensor([prompt + tokens[:-1]])
        logits = emulated_logits(model, ids, policy, prefill_len=len(prompt))
        assert logits[0, len(prompt) - 1:].argmax(-1).tolist() == tokens


@torch.no_grad()
def test_a_one_token_row_in_a_prefill_reads_as_a_decode_step(tiny_llama64):
    """With ``prefill: fp`` a multi-token first call answers its tokens in full precision; a row whose part of it is
    a single real token answers what the schedule reads (quantized here: no residual, no sinks), as that row
    decoded alone does (its first call brings one token)."""
    model, _ = tiny_llama64
    policy = KVPolicy.preset("int4_g32")
    prompts = _prompts(model, (9, 1), seed=2)
    ids, mask = left_padded(prompts, 0)
    cache = QuantizedKVCache(model, policy, left_padding=[0, 8])
    batched = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
                    **cache_kwargs(model, cache)).logits
    alone, _ = decoded_logits(model, torch.tensor([prompts[1]]), policy, prefill_len=1)
    fp = model(torch.tensor([prompts[1]])).logits
    assert (alone - fp).abs().max() > 1e-6, "the quantized read must differ from the full-precision one"
    torch.testing.assert_close(batched[1, -1:], alone[0], rtol=0, atol=1e-12)


def test_plain_batched_generation_equals_each_prompt_alone(tiny_llama64):
    model, _ = tiny_llama64
    prompts = _prompts(model)
    assert greedy_tokens(model, prompts, 8) == [greedy_tokens(model, [p], 8)[0] for p in prompts]


def test_generation_is_greedy_whatever_the_checkpoint_asks_for():
    """A checkpoint's generation_config.json may ask for beam search, a repetition penalty or n-gram blocking; the
    tasks' answers stay the argmax of the model's logits (baseline and policy alike), the real cache is never asked
    to reorder beams, and the model's own generation_config is back afterwards, also after an error."""
    from kveval.models import build_tiny_model

    model = build_tiny_model("tiny-llama", dtype="float64")
    gen = model.generation_config
    gen.num_beams, gen.repetition_penalty, gen.no_repeat_ngram_size = 3, 5.0, 1
    policy = KVPolicy.from_config(POLICIES["sliding_sinks"])
    prompts = _prompts(model, (9, 4), seed=3)
    plain, quantized = greedy_tokens(model, prompts, 6), greedy_tokens(model, prompts, 6, policy)
    assert model.generation_config is gen and gen.num_beams == 3
    for prompt, tokens, q_tokens in zip(prompts, plain, quantized):
        assert len(set(tokens)) < len(tokens), "a repeated token: what the checkpoint's n-gram blocking forbids"
        with torch.no_grad():
            fp = model(torch.tensor([prompt + tokens[:-1]])).logits
        assert fp[0, len(prompt) - 1:].argmax(-1).tolist() == tokens
        emu = emulated_logits(model, torch.tensor([prompt + q_tokens[:-1]]), policy, prefill_len=len(prompt))
        assert emu[0, len(prompt) - 1:].argmax(-1).tolist() == q_tokens
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")  # NaN logits: generation stops with one KvevalError line
    with pytest.raises(KvevalError, match="NaN"):
        greedy_tokens(model, prompts, 2, policy)
    assert model.generation_config is gen


def test_generate_answers_keeps_the_order_and_equals_generate_answer(tiny_llama64):
    model, tok = tiny_llama64
    policy = KVPolicy.from_config(POLICIES["sliding_sinks"])
    prompts = _prompts(model, (5, 12, 8), seed=1)
    answers = generate_answers(model, tok, prompts, 6, policy, batch_size=2)
    assert answers == [generate_answer(model, tok, p, 6, policy) for p in prompts]


# ---------------------------------------------------------------------------------------------------------------
# Left padding and the bill
# ---------------------------------------------------------------------------------------------------------------
def test_left_padding_of_worked_example_and_right_padding_refused():
    assert left_padding_of(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])) == [2, 0]
    with pytest.raises(KvevalError, match="not left padding"):
        left_padding_of(torch.tensor([[1, 1, 0], [1, 1, 1]]))


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("model_fixture", ["tiny_llama64", "tiny_gemma3_64"])
@torch.no_grad()
def test_batched_cache_holds_the_sum_of_the_rows_bills_after_every_call(name, model_fixture, request):
    """A left-padded prefill, then single-token steps: after every call, per layer and part, the cache holds
    exactly the sum over rows of each row's own bill (its real tokens, its prompt; padding is not held), and every
    piece of quantized storage reads back what attention reads."""
    model, _ = request.getfixturevalue(model_fixture)
    policy = KVPolicy.from_config(POLICIES[name])
    arch = Arch.from_model(model)
    prompts = _prompts(model)
    ids, mask = left_padded(prompts, 0)
    pads = [ids.shape[1] - len(p) for p in prompts]
    cache = QuantizedKVCache(model, policy, left_padding=pads)
    kw = cache_kwargs(model, cache)
    step = torch.randint(4, model.config.vocab_size, (len(prompts), 1), generator=torch.Generator().manual_seed(3))
    for call in range(12):
        if call:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers a left-padded batch
        x = ids if call == 0 else step
        model(x, attention_mask=mask, position_ids=positions[:, -x.shape[1]:], use_cache=True, **kw)
        bills = [kv_bytes(arch, policy, len(p) + call, fp_bytes=8, prompt=len(p)) for p in prompts]
        for i, layer in enumerate(cache.layers):
            held = layer.nbytes()
            parts = [b.per_layer[i][0] + b.per_layer[i][1] for b in bills]
            want = tuple(sum(getattr(p, f) for p in parts) for f in ("codes", "scales", "residual"))
            assert (held["codes"], held["scales"], held["residual"]) == want, (i, call)
        assert cache.nbytes()["total"] == sum(b.total for b in bills)
    for layer in cache.layers:
        view = LayerHoldings(layer)
        for run in (*view.chunks("key"), *view.chunks("value")):
            assert torch.equal(run.read(), run.read_storage())


def test_padding_is_read_from_the_attention_mask_of_generate(tiny_gemma3_64):
    model, _ = tiny_gemma3_64
    policy = KVPolicy.from_config(POLICIES["kivi_blocks_sinks"])
    prompts = _prompts(model)
    ids, mask = left_padded(prompts, 0)
    cache = QuantizedKVCache(model, policy)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False,
                         pad_token_id=0)
    assert cache.left_padding == [ids.shape[1] - len(p) for p in prompts]
    assert cache.layers[0].pads == cache.left_padding
    want = greedy_tokens(model, prompts, 8, policy, pad_id=0)
    got = [row[: len(w)] for row, w in zip(out[:, ids.shape[1]:].tolist(), want)]
    assert got == want
    with pytest.raises(KvevalError, match="not left padding"):
        right = torch.ones_like(mask)
        right[0, -2:] = 0
        model.generate(ids, attention_mask=right, past_key_values=QuantizedKVCache(model, policy), max_new_tokens=2,
                       do_sample=False, pad_token_id=0)


# ---------------------------------------------------------------------------------------------------------------
# The read buffers
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_read_buffers_grow_by_doubling_and_sliding_layers_stay_at_their_window(tiny_gemma3_64):
    """The buffered read path, token by token from a 3-token prompt to 60 tokens, no size hint: full-attention layers
    double their buffers
    (16 -> 32 -> 64 positions), sliding-window layers (window 8) drop the evicted front and keep 16; the bytes
    equal the bill after every call and the logits equal one emulated pass."""
    model, _ = tiny_gemma3_64
    policy = KVPolicy.from_config({"key": "int4_g32", "value": "int8", "residual": 3, "sink_tokens": 2})
    arch = Arch.from_model(model)
    ids = ids_for(model, 60, seed=4)
    cache = QuantizedKVCache(model, policy, read="buffered")
    kw = cache_kwargs(model, cache)
    logits = []
    for start, stop in [(0, 3), *((t, t + 1) for t in range(3, 60))]:
        logits.append(model(ids[:, start:stop], use_cache=True, **kw).logits)
        assert cache.nbytes()["total"] == kv_bytes(arch, policy, stop, fp_bytes=8, prompt=3).total
    assert [layer.capacity for layer in cache.layers] == [16, 64, 16, 64]
    emulated = emulated_logits(model, ids, policy, prefill_len=3)
    torch.testing.assert_close(torch.cat(logits, dim=1), emulated, rtol=0, atol=1e-12)


def test_reserved_buffers_are_allocated_once(tiny_llama64):
    model, _ = tiny_llama64
    policy = KVPolicy.preset("int4_g32")
    cache = QuantizedKVCache(model, policy, max_length=50, read="buffered")
    model.generate(ids_for(model, 30), past_key_values=cache, max_new_tokens=20, do_sample=False,
                   min_new_tokens=20)
    assert {layer.capacity for layer in cache.layers} == {50}
    assert cache.get_seq_length() == 49


# ---------------------------------------------------------------------------------------------------------------
# Emulation without [T, T] masks
# ---------------------------------------------------------------------------------------------------------------
SCHEDULES = {
    "sliding": {"spec": "int4_g32", "residual": 5, "sink_tokens": 2},
    "sliding_lag": {"spec": "int4_g32", "residual": 5, "residual_mode": "sliding_lag"},
    "block": {"spec": "int4_g32", "residual": 6, "sink_tokens": 3, "residual_mode": "block"},
    "prompt_block": {"spec": "int4_g32", "residual": 4, "sink_tokens": 1, "residual_mode": "prompt_block"},
    "kivi": {"key": CHANNEL2, "value": "int2_g32", "residual": 4, "residual_mode": {"key": "block",
                                                                                   "value": "sliding_lag"}},
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("P", "prefill"), [(0, "fp"), (13, "fp"), (13, "quantized"), (40, "fp")])
def test_threshold_rows_equal_the_full_precision_mask(name, P, prefill):
    """Rows [start, stop) built from per-query thresholds == the same rows of KVPolicy.full_precision_mask, on
    every causal entry, for keys and values."""
    policy = replace(KVPolicy.from_config(SCHEDULES[name]), prefill=prefill)
    T = 37
    k_q, v_q = layer_quantizers(policy, 0, 1)
    state = EMULATE.LayerEmulation(0, k_q, v_q, policy, "sdpa", prefill_len=P)
    for start, stop in [(0, T), (0, 5), (5, 17), (30, T)]:
        mk, mv = state.full_precision_rows(T, start, stop, "cpu")
        causal = torch.ones(T, T, dtype=torch.bool).tril()[start:stop, :stop]
        for kind, rows in (("key", mk), ("value", mk if mv is None else mv)):
            full = policy.full_precision_mask(T, T, P, kind=kind)[start:stop, :stop]
            assert torch.equal(rows & causal, full & causal), (kind, start, stop)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("P", [0, 13])
@pytest.mark.parametrize("model_fixture", ["tiny_llama64", "tiny_gemma3_64"])
def test_chunked_masks_equal_one_mask_and_decoding(name, P, model_fixture, request, monkeypatch):
    """Queries in chunks of 3 rows (small MASK_ELEMENTS) == one [T, 2T] mask (the path before chunking) to 1e-12,
    and == token-by-token decoding through the real cache to 1e-9 (float64)."""
    model, _ = request.getfixturevalue(model_fixture)
    policy = KVPolicy.from_config(SCHEDULES[name])
    ids = ids_for(model, 40, seed=5)
    one_mask = emulated_logits(model, ids, policy, prefill_len=P)
    monkeypatch.setattr(EMULATE, "MASK_ELEMENTS", 3 * 4 * 40)
    chunked = emulated_logits(model, ids, policy, prefill_len=P)
    torch.testing.assert_close(chunked, one_mask, rtol=0, atol=1e-12)
    decoded, _ = decoded_logits(model, ids, policy, prefill_len=max(P, 1))
    torch.testing.assert_close(chunked, decoded, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# Perplexity: long windows, KLD by absolute position
# ---------------------------------------------------------------------------------------------------------------
def test_compare_in_row_slices_equals_one_call(monkeypatch):
    g = torch.Generator().manual_seed(0)
    base, logits = torch.randn(37, 50, generator=g), torch.randn(37, 50, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    monkeypatch.setattr(PERPLEXITY, "COMPARE_ROWS", 8)
    sliced, whole = PERPLEXITY._compare(base, logits, targets), compare_logits(base, logits, targets)
    for k in whole:
        assert torch.equal(sliced[k], whole[k]), k


def test_baseline_terms_kept_for_a_window_give_the_same_numbers_as_recomputing(monkeypatch):
    """``BaseTerms``: the baseline's softmax is computed at a window's first comparison and reused by the next
    policies' (the same slice objects), and every metric equals the recomputed one bit for bit; a batch over the
    budget recomputes (keeps nothing)."""
    g = torch.Generator().manual_seed(1)
    base, targets = torch.randn(37, 50, generator=g), torch.randint(0, 50, (37,), generator=g)
    monkeypatch.setattr(PERPLEXITY, "COMPARE_ROWS", 8)
    terms = PERPLEXITY.BaseTerms(keep=True)
    for seed in range(3):
        logits = torch.randn(37, 50, generator=torch.Generator().manual_seed(seed))
        kept, fresh = PERPLEXITY._compare(base, logits, targets, terms), PERPLEXITY._compare(base, logits, targets)
        assert all(torch.equal(kept[k], fresh[k]) for k in fresh)
    assert terms.slices is not None and len(terms.slices) == 5 and terms.get(base) is terms.slices
    spent = PERPLEXITY.BaseTerms(keep=False)
    spent.get(base)
    assert spent.slices is None


def test_a_window_at_the_model_context_bins_kld_by_absolute_position(tmp_path, monkeypatch):
    """One 2048-token window (the tiny model's context) with chunked masks and sliced comparisons: the task's
    kld_by_position equals an independent computation binned by absolute position in the window."""
    from kveval.commands.run import run_experiment
    from kveval.config import validate
    from kveval.data import load_tokens
    from kveval.models import load_model

    monkeypatch.setattr(EMULATE, "MASK_ELEMENTS", 1 << 16)  # 16-row query chunks at 2048 tokens
    monkeypatch.setattr(PERPLEXITY, "COMPARE_ROWS", 300)
    spec = {"spec": "int4_g32", "residual": 64, "sink_tokens": 4}
    cfg = {"name": "long", "model": {"name": "builtin:tiny-llama", "dtype": "float64"}, "data": "builtin",
           "kv": {"policies": {"windowed": spec}},
           "tasks": [{"perplexity": {"seq_len": 2048, "max_tokens": 2048, "position_bins": 4, "bootstrap": 0,
                                     "diagnostics": False}}],
           "output": str(tmp_path / "long")}
    metrics = run_experiment(validate(cfg), quiet=True)
    got = metrics["policies"]["windowed"]
    assert got["position_bin_edges"] == [0, 512, 1024, 1536, 2048]
    model, tok = load_model("builtin:tiny-llama", dtype="float64")
    ids = load_tokens("builtin", tok)[:2048][None]
    with torch.no_grad():
        base = model(ids).logits[0, :-1]
    policy = KVPolicy.from_config(spec, name="windowed")
    kld = compare_logits(base, emulated_logits(model, ids, policy)[0, :-1], ids[0, 1:])["kld"]
    want = [float(kld[lo:hi].mean()) for lo, hi in [(0, 512), (512, 1024), (1024, 1536), (1536, 2047)]]
    assert got["kld_by_position"] == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_one_emulated_pass_at_32k_tokens_needs_memory_linear_in_the_context():
    """The live peak of one emulated forward pass over 32,768 tokens of builtin:tiny-llama under vllm_fp8_fa3 (an
    attention hook, which builds a bool mask of its queries x keys: it used to be one 32k x 32k mask, 1 GiB, plus
    its padded copy) stays under a bound linear in T computed from the shapes: eight float32 copies of a layer's
    widest activations per token (hidden, the MLP's gate and up, the query and the key/value heads), plus 16 MiB."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_long_context import live_peak_bytes, one_pass, tiny

    model = tiny("tiny-llama")
    c = model.config
    T = 32768
    per_token = 4 * 8 * (c.hidden_size + 2 * c.intermediate_size + 2 * c.num_attention_heads * c.head_dim
                         + 2 * c.num_key_value_heads * c.head_dim)
    bound = 16 * 2**20 + T * per_token
    assert bound < T * T  # a T x T bool mask (1 GiB) alone would break it
    ids = torch.randint(4, c.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    peak = live_peak_bytes(one_pass(model, ids, "vllm_fp8_fa3"))
    assert 0 < peak <= bound, (peak / 2**20, bound / 2**20)


def test_the_long_context_bench_measures_every_preset_it_can_and_says_why_not_the_others():
    """`bench/bench_long_context.py` on short lengths: a preset whose groups fit the model's heads is measured
    (with --head-dim 64, int4_g64), one that does not is a skipped line with the reason, a `scales: auto` preset is
    calibrated first and measured, and the growth table holds every measured preset."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "bench" / "bench_long_context.py"), "--lengths", "64,256",
                           "--presets", "int4_g64,int4_g128,trtllm_int8", "--head-dim", "64"],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tiny-llama, head_dim 64 (float32")
    measured = {(p[0], p[1]): float(p[4]) for p in (line.split() for line in lines) if len(p) == 6 and p[0].isdigit()}
    assert set(measured) == {(n, p) for n in ("64", "256") for p in ("int4_g64", "trtllm_int8")}
    assert all(r >= 0.99 for r in measured.values())
    assert any("int4_g128" in line and "skipped: policy 'int4_g128': group_size 128 does not divide head_dim 64"
               in line for line in lines)
    growth = lines[lines.index(next(line for line in lines if line.startswith("growth"))) + 1:]
    assert sorted(line.split()[0] for line in growth) == ["int4_g64", "trtllm_int8"]
