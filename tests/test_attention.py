"""``kveval.patch.attention.grouped_sdpa``: transformers' SDPA function without the copies of grouped heads, the
same numbers bit for bit, and every call it does not cover handed to transformers unchanged."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from twopaths import emulated_logits, ids_for

from kveval.models.builtin import build_tiny_model
from kveval.patch import attention
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec


@pytest.fixture
def stock_calls(monkeypatch) -> list[int]:
    """How many calls ``grouped_sdpa`` handed to transformers' function (one entry per call)."""
    calls: list[int] = []

    def spy(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    return calls


def _inputs(batch, heads, kv_heads, q_len, k_len, dim, v_dim, dtype, seed=0, mask_batch=1, mask_heads=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, k_len, dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, k_len, v_dim, generator=gen).to(dtype)
    mask = torch.rand(mask_batch, mask_heads, q_len, k_len, generator=gen) > 0.4
    mask[..., 0] = True
    return q, k, v, mask


CASES = [  # (batch, heads, kv_heads, q_len, k_len, dim, v_dim, mask batch, mask heads)
    (1, 9, 3, 256, 2048, 64, 64, 1, 1),  # the builtin model's chunk of decoded queries
    (1, 9, 3, 256, 700, 64, 64, 1, 1),
    (2, 8, 2, 33, 97, 40, 40, 2, 1),  # a mask per row (left padding)
    (2, 4, 1, 300, 300, 128, 128, 1, 1),
    (1, 8, 2, 768, 1900, 80, 80, 1, 1),
    (1, 8, 2, 7, 9, 192, 128, 1, 1),  # key and value head sizes differ
    (1, 4, 2, 40, 52, 32, 32, 1, 1),  # the tiny models
    (2, 6, 2, 20, 30, 16, 16, 2, 6),  # a mask per row and head
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_grouped_sdpa_equals_transformers_sdpa_bit_for_bit(case, dtype, stock_calls):
    """Where transformers expands the key/value heads (GQA, a bool mask, several queries, CPU), ``grouped_sdpa``
    computes without the expansion and gives the same output, bit for bit, for every dtype, head size, length and
    mask layout here; transformers' function was not called."""
    *shape, mask_batch, mask_heads = case
    q, k, v, mask = _inputs(*shape, dtype, mask_batch=mask_batch, mask_heads=mask_heads)
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=True)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.125)
    got, weights = attention.grouped_sdpa(module, q, k, v, mask, dropout=0.0, scaling=0.125, position_ids=None)
    assert stock_calls == [], "the grouped call must not go through transformers' function"
    assert weights is None and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.isfinite(got.float()).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_sdpa_is_the_same_with_one_and_two_threads(threads, stock_calls):
    q, k, v, mask = _inputs(1, 9, 3, 256, 1024, 64, 64, torch.float32, seed=1)
    module = SimpleNamespace(num_key_value_groups=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, _ = attention.grouped_sdpa(module, q, k, v, mask, scaling=None)
        want, _ = sdpa_attention_forward(module, q, k, v, mask)
    finally:
        torch.set_num_threads(before)
    assert stock_calls == [] and torch.equal(got, want)


def _float_mask(mask):
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


FALLBACKS = {  # name: (change to the inputs, keyword arguments)
    "no mask (causal: transformers already uses enable_gqa)": (lambda q, k, v, m: (q, k, v, None), {}),
    "one query (transformers packs the heads)": (lambda q, k, v, m: (q[:, :, :1], k, v, m[:, :, :1]), {}),
    "a float mask": (lambda q, k, v, m: (q, k, v, _float_mask(m)), {}),
    "no grouping": (lambda q, k, v, m: (q[:, :2], k, v, m), {}),
    "dropout": (lambda q, k, v, m: (q, k, v, m), {"dropout": 0.5}),
    "position bias": (lambda q, k, v, m: (q, k, v, m), {"position_bias": torch.zeros(1, 4, 40, 52)}),
    "sinks": (lambda q, k, v, m: (q, k, v, m), {"s_aux": torch.zeros(4)}),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_calls_grouped_sdpa_does_not_cover_go_to_transformers_unchanged(name, stock_calls):
    """Every other call runs transformers' own function with the arguments it got (dropout drawn from the same
    seed gives the same output; the rest are deterministic)."""
    change, kwargs = FALLBACKS[name]
    q, k, v, mask = change(*_inputs(1, 4, 2, 40, 52, 32, 32, torch.float32))
    groups = q.shape[1] // k.shape[1]
    module = SimpleNamespace(num_key_value_groups=groups)
    torch.manual_seed(0)
    got, _ = attention.grouped_sdpa(module, q, k, v, mask, **kwargs)
    assert stock_calls == [1]
    torch.manual_seed(0)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, **kwargs)
    assert torch.equal(got, want)


def test_a_torch_older_than_the_checked_one_gets_transformers_call(monkeypatch, stock_calls):
    monkeypatch.setattr(attention, "_GROUPED", False)
    q, k, v, mask = _inputs(1, 4, 2, 40, 52, 32, 32, torch.float32)
    got, _ = attention.grouped_sdpa(SimpleNamespace(num_key_value_groups=2), q, k, v, mask)
    assert stock_calls == [1]
    assert torch.equal(got, sdpa_attention_forward(SimpleNamespace(num_key_value_groups=2), q, k, v, mask)[0])


def test_softcap_is_refused_as_transformers_refuses_it(stock_calls):
    q, k, v, mask = _inputs(1, 4, 2, 40, 52, 32, 32, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        attention.grouped_sdpa(SimpleNamespace(num_key_value_groups=2), q, k, v, mask, softcap=30.0)
    assert stock_calls == [1]


SPLIT_KIVI = KVPolicy(key=QuantSpec(bits=2, mapping="asymmetric", granularity="channel"),
                      value=QuantSpec(bits=2, mapping="asymmetric"), residual=6, sink_tokens=2,
                      residual_mode={"key": "block", "value": "sliding"})
RESIDUAL_INT4 = KVPolicy.from_config({"key": "int4_g32", "value": "int4_g32", "residual": 8})


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3", "tiny-qwen3", "tiny-falcon-h1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulation_logits_are_the_same_with_the_grouped_call(family, dtype, monkeypatch, stock_calls):
    """A policy with full-precision tokens attends chunk by chunk with an explicit mask: with ``grouped_sdpa`` the
    logits equal bit for bit those of transformers' own function (GQA with full attention, sliding-window layers, QK
    norm, a hybrid with Mamba layers), and the grouped call did the chunks' attention."""
    model = build_tiny_model(family, dtype=dtype)
    ids = ids_for(model, 40, seed=2)
    with torch.no_grad():
        plain = model(ids).logits
        grouped = {name: emulated_logits(model, ids, p) for name, p in
                   (("kivi", SPLIT_KIVI), ("int4", RESIDUAL_INT4))}
        grouped_stock_calls = len(stock_calls)
        monkeypatch.setattr(attention, "grouped_sdpa", sdpa_attention_forward)
        stock = {name: emulated_logits(model, ids, p) for name, p in (("kivi", SPLIT_KIVI), ("int4", RESIDUAL_INT4))}
    layers = len(attention.attention_modules(model))
    assert grouped_stock_calls < layers, "the chunks must go through the grouped call"
    for name in grouped:
        assert (grouped[name].float() - plain.float()).abs().max() > 1e-3, f"{name} must change the logits"
        assert torch.equal(grouped[name], stock[name]), name
