"""llama.cpp's K/V transforms (kveval.transforms: hadamard, gguf_order, query_quant) on crafted tensors, and the
``llamacpp_*`` presets' emulation against the real quantized cache in float64 on a tiny Llama with head_dim 64
(where llama.cpp's rotation is active). The comparison with the real library is tests/parity/test_llamacpp.py."""

from __future__ import annotations

import math

import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

import kveval.gguf
from kveval.errors import KvevalError
from kveval.gguf import gguf_permutation, to_gguf_order
from kveval.policy import POLICY_PRESETS, KVPolicy
from kveval.policy.presets import LLAMACPP_SPECS, llamacpp_config
from kveval.quant.rotation import hadamard_matrix, rotate_blocks
from kveval.rope import rotate
from kveval.transforms import GgufOrder, Hadamard, QueryQuant, TransformContext, make_transform
from kveval.transforms.hadamard import llamacpp_block
from kveval.transforms.query_quant import fake_q8_0_x86, quantize_q8_0_x86, vec_dot_query_type

CTX = TransformContext(layer=0, head_dim=8)


# --------------------------------------------------------------------------------------------------- hadamard
def test_hadamard_4x4_by_hand():
    h = hadamard_matrix(4, torch.float64)
    assert h.tolist() == [[0.5, 0.5, 0.5, 0.5], [0.5, -0.5, 0.5, -0.5], [0.5, 0.5, -0.5, -0.5], [0.5, -0.5, -0.5, 0.5]]
    # y = H x on a crafted vector: x = [1, 2, 3, 4] -> [5, -1, -2, 0]
    assert rotate_blocks(torch.tensor([1.0, 2, 3, 4], dtype=torch.float64), 4).tolist() == [5.0, -1.0, -2.0, 0.0]


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128, 256])
def test_hadamard_is_symmetric_orthonormal_and_self_inverse(n):
    h = hadamard_matrix(n, torch.float64)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-14)
    assert torch.equal(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64))
    if n > 1:  # Sylvester order: H_2s = [[H, H], [H, -H]]
        s = n // 2
        assert torch.equal(h[:s, s:], h[:s, :s]) and torch.equal(h[s:, s:], -h[:s, :s])
    # float32: entries +-fl32(1/sqrt(n)), as llama.cpp fills its matrix with 1/sqrtf(n)
    h32 = hadamard_matrix(n)
    assert h32.dtype == torch.float32 and h32[0, 0].item() == (1 / torch.tensor(float(n)).sqrt()).item()


def test_hadamard_rejects_non_powers_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
    with pytest.raises(ValueError, match="does not divide head_dim"):
        rotate_blocks(torch.zeros(48), 32)


@pytest.mark.parametrize("head_dim, key, value", [(64, 64, 64), (128, 128, 64), (192, 64, 64), (256, 256, 64),
                                                  (320, 64, 64), (96, 0, 0), (32, 0, 0)])
def test_llamacpp_block_rule(head_dim, key, value):
    assert llamacpp_block("key", head_dim) == key
    assert llamacpp_block("value", head_dim) == value


def test_rotate_blocks_acts_per_group_and_keeps_dtype():
    x = torch.arange(16, dtype=torch.float64).reshape(1, 1, 1, 16)
    y = rotate_blocks(x, 8)
    h = hadamard_matrix(8, torch.float64)
    assert torch.equal(y[..., :8], x[..., :8] @ h) and torch.equal(y[..., 8:], x[..., 8:] @ h)
    assert rotate_blocks(x.to(torch.bfloat16), 8).dtype == torch.bfloat16


def test_hadamard_transform_hooks_and_sides():
    q, k = torch.randn(1, 2, 3, 128, dtype=torch.float64), torch.randn(1, 1, 3, 128, dtype=torch.float64)
    both = Hadamard()
    # keys (and queries) in blocks of 128, values and outputs in blocks of 64: q.k unchanged, H self-inverse
    assert torch.equal(both.key_in(k, CTX), rotate_blocks(k, 128))
    assert torch.equal(both.value_in(k, CTX), rotate_blocks(k, 64))
    torch.testing.assert_close(both.query(q, CTX)[:, :1] @ both.key_in(k, CTX).transpose(-1, -2),
                               q[:, :1] @ k.transpose(-1, -2), rtol=0, atol=1e-12)
    torch.testing.assert_close(both.output(both.value_in(k, CTX), CTX), k, rtol=0, atol=1e-14)
    assert both.keeps_keys_transformed and both.keeps_values_transformed
    key_only, value_only = Hadamard(on="key"), Hadamard(on="value")
    assert key_only.acts_on("key") and not key_only.acts_on("value")
    assert value_only.acts_on("value") and not value_only.acts_on("key") and not value_only.has_query_hook
    assert Hadamard(block=16).key_in(k, CTX).shape == k.shape
    # head_dim not a multiple of 64: llama.cpp does not rotate, nor does the rule
    small = torch.randn(1, 1, 2, 32)
    assert torch.equal(Hadamard().key_in(small, CTX), small)


def test_hadamard_config_form_and_errors():
    t = make_transform({"name": "hadamard", "on": "value", "block": 64}, "x")
    assert t == Hadamard("value", 64) and t.to_config() == {"name": "hadamard", "on": "value", "block": 64}
    with pytest.raises(KvevalError, match="'on' must be one of"):
        make_transform({"name": "hadamard", "on": "keys"}, "x")
    with pytest.raises(KvevalError, match="power of two"):
        make_transform({"name": "hadamard", "block": 48}, "x")


# --------------------------------------------------------------------------------------------------- gguf_order
def test_gguf_permutation_index_map_on_a_crafted_head():
    assert gguf_permutation(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    head = torch.tensor([10.0, 11, 12, 13, 20, 21, 22, 23])  # HF halves [x1 | x2]
    assert to_gguf_order(head).tolist() == [10.0, 20, 11, 21, 12, 22, 13, 23]
    with pytest.raises(ValueError, match="even head_dim"):
        gguf_permutation(7)
    with pytest.raises(ValueError, match="even head_dim"):
        to_gguf_order(torch.zeros(2, 7))


@pytest.mark.parametrize("shape", [(1, 9, 33, 64), (2, 3, 5, 128), (4, 2), (1, 1, 3, 2)])
def test_to_gguf_order_is_the_index_map_as_a_new_contiguous_tensor(shape):
    """The strided copy equals ``index_select`` with ``gguf_permutation`` bit for bit, on contiguous and
    transposed inputs, and never aliases its input (head_dim 2 is the identity)."""
    x = torch.randn(shape, dtype=torch.float64)
    for src in (x, x.transpose(0, -2) if x.dim() > 2 else x.t().contiguous().t()):
        out = to_gguf_order(src)
        assert torch.equal(out, src.index_select(-1, gguf_permutation(shape[-1])))
        assert out.is_contiguous() and out.data_ptr() != src.data_ptr()


def _convert_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, written independently of kveval."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_order_equals_the_converter_permutation_and_rope_pairs():
    """Projecting with convert_hf_to_gguf's permuted rows = projecting with HF's rows then ``to_gguf_order`` per
    head; and HF's rotate-half RoPE followed by the order = adjacent-pair RoPE (llama.cpp NORM) on permuted q."""
    g = torch.Generator().manual_seed(0)
    n_head, d, hidden = 3, 8, 5
    w = torch.randn(n_head * d, hidden, generator=g, dtype=torch.float64)
    x = torch.randn(4, hidden, generator=g, dtype=torch.float64)
    hf = (x @ w.T).reshape(4, n_head, d)
    gguf = (x @ _convert_permute(w, n_head).T).reshape(4, n_head, d)
    assert torch.equal(to_gguf_order(hf), gguf)
    # RoPE: HF pairs (i, i + d/2) with angle theta_i; llama.cpp NORM pairs (2i, 2i + 1) with the same angle
    theta = torch.rand(d // 2, generator=g, dtype=torch.float64) * 3
    cos, sin = torch.cat([theta.cos(), theta.cos()]), torch.cat([theta.sin(), theta.sin()])
    roped = rotate(hf.permute(1, 0, 2)[None], cos.expand(1, 4, d), sin.expand(1, 4, d))[0].permute(1, 0, 2)
    a, b = gguf[..., 0::2], gguf[..., 1::2]
    norm = torch.stack([a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()], -1).reshape(gguf.shape)
    torch.testing.assert_close(to_gguf_order(roped), norm, rtol=0, atol=1e-14)


def test_gguf_order_moves_q_and_k_together():
    t = GgufOrder()
    q, k = torch.randn(1, 2, 3, 8, dtype=torch.float64), torch.randn(1, 1, 3, 8, dtype=torch.float64)
    assert torch.equal(t.key_in(k, CTX), to_gguf_order(k)) and torch.equal(t.key_out(k, CTX), k)
    torch.testing.assert_close(t.query(q, CTX) @ t.key_in(k, CTX).transpose(-1, -2), q @ k.transpose(-1, -2),
                               rtol=0, atol=1e-14)
    assert t.keeps_keys_transformed and not t.acts_on("value") and t.to_config() == "gguf_order"


# --------------------------------------------------------------------------------------------------- query_quant
def test_q8_0_query_rounds_half_to_even_with_127_over_amax():
    """amax = 127/32 -> 127/amax = 32 exactly and d = 1/32: x = k/64 lands on k/2; ties go to even (0, 2, 2, 4,
    -2), where ggml's reference roundf (ties away from zero) would give 1, 2, 3, 3, -3."""
    x = torch.zeros(32)
    x[0] = 127 / 32
    x[1:6] = torch.tensor([1, 3, 5, 7, -5]) / 64
    x[6] = -1 / 64  # -0.5 -> -0 -> stored as +0
    codes, d = quantize_q8_0_x86(x)
    assert codes[0, :7].tolist() == [127, 0, 2, 2, 4, -2, 0] and not torch.signbit(codes[0, 6])
    assert d.dtype == torch.float16 and d.item() == 1 / 32
    assert fake_q8_0_x86(x)[:6].tolist() == [127 / 32, 0.0, 2 / 32, 2 / 32, 4 / 32, -2 / 32]


def test_q8_0_query_multiplier_is_127_over_amax_not_one_over_d():
    """amax = 1.375: fl(127/amax) = 92.36363983 but fl(1/fl(amax/127)) = 92.36363220. For x = fl(1.5/92.36363983)
    x86 computes x*127/amax = 1.5 exactly (a tie: code 2) where the reference computes 1.49999988 (code 1); gguf's
    q8_0 (kveval's ``q8_0``) gives 1, the x86 format ``q8_0_x86`` and the query 2."""
    from kveval.quant import fake_quantize, preset

    amax = torch.tensor(1.375)
    mul_x86, mul_ref = torch.tensor(127.0) / amax, 1 / (amax / 127)
    assert mul_x86.item() != mul_ref.item()
    x = torch.zeros(32)
    x[0], x[1] = amax, torch.tensor(1.5) / mul_x86
    assert (x[1] * mul_x86).item() == 1.5 and (x[1] * mul_ref).item() < 1.5
    codes, d = quantize_q8_0_x86(x)
    assert codes[0, 1].item() == 2.0
    d32 = d.float().item()
    assert fake_quantize(x.reshape(1, 1, 1, 32), preset("q8_0_x86"))[0, 0, 0, 1].item() == 2 * d32
    assert fake_quantize(x.reshape(1, 1, 1, 32), preset("q8_0"))[0, 0, 0, 1].item() == 1 * d32


def test_q8_0_query_blocks_zero_block_and_dtype():
    x = torch.zeros(1, 1, 2, 64, dtype=torch.float64)
    x[..., 40] = 2.0
    y = QueryQuant().query(x, CTX)
    d = torch.tensor(2.0 / 127, dtype=torch.float32).to(torch.float16).float()  # the stored scale
    assert y.dtype == torch.float64 and y[..., :32].abs().sum() == 0 and y[0, 0, 0, 40] == (127 * d).item()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0_x86(torch.zeros(48))


def test_f16_query_rounding():
    q = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 70000.0], dtype=torch.float64)  # ties to even; overflow to inf
    assert QueryQuant("f16").query(q, CTX).tolist() == [1.0, 1 + 2**-9, math.inf]
    assert QueryQuant("q8_1").query(q[:2].repeat(16), CTX).tolist() == QueryQuant("q8_0").query(q[:2].repeat(16), CTX).tolist()


def test_vec_dot_query_types_follow_ggml_cpu_type_traits():
    assert {t: vec_dot_query_type(t) for t in ("q8_0", "q4_0", "q5_0", "iq4_nl", "q4_1", "q5_1", "f16", "f32")} == {
        "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1",
        "f16": "f16", "f32": None}
    with pytest.raises(ValueError, match="unknown llama.cpp K cache type"):
        vec_dot_query_type("q2_K")
    with pytest.raises(KvevalError, match="'type' must be one of"):
        make_transform({"name": "query_quant", "type": "q4_0"}, "x")


def test_query_quant_must_follow_the_domain_transforms():
    with pytest.raises(KvevalError, match="must come before"):
        KVPolicy.from_config({"spec": "q4_0", "transforms": [{"name": "query_quant"}, "gguf_order"]})


# --------------------------------------------------------------------------------------------------- presets
LLAMACPP_PRESETS = sorted(n for n in POLICY_PRESETS if n.startswith("llamacpp_"))


def test_llamacpp_presets_and_config():
    assert {"llamacpp_q8_0", "llamacpp_q4_0", "llamacpp_q4_1", "llamacpp_q5_0", "llamacpp_q5_1", "llamacpp_iq4_nl",
            "llamacpp_q8_0_norot", "llamacpp_q4_0_norot"} <= set(LLAMACPP_PRESETS)
    p = KVPolicy.preset("llamacpp_q4_1")
    assert p.key.ggml == "q4_1" and p.prefill == "quantized"
    assert p.transforms == (GgufOrder(), Hadamard(), QueryQuant("q8_1"))
    assert KVPolicy.preset("llamacpp_q8_0_norot").transforms == (GgufOrder(), QueryQuant("q8_0"))
    assert KVPolicy.preset("llamacpp_q8_0").key.ggml == "q8_0_x86"
    mixed = KVPolicy.from_config(llamacpp_config("f16", "q4_0"))
    assert mixed.key.is_none and mixed.transforms == (GgufOrder(), Hadamard("value"), QueryQuant("f16"))
    assert KVPolicy.from_config(llamacpp_config("q4_0", "f16", gguf_order=False)).transforms == (
        Hadamard("key"), QueryQuant("q8_0"))
    for name in LLAMACPP_PRESETS:
        assert "llama-cpp-python 0.3.36" in POLICY_PRESETS[name][1]
        policy = KVPolicy.preset(name)
        assert KVPolicy.from_config(policy.to_config(), name=name) == policy
    with pytest.raises(ValueError, match="unknown llama.cpp cache type"):
        llamacpp_config("q4_K", "q4_0")


@pytest.fixture(scope="module")
def tiny_llama_hd64():
    """A tiny random Llama in float64 with head_dim 64 (llama.cpp rotates K and V in blocks of 64)."""
    from transformers import AutoModelForCausalLM

    from kveval.models import tiny_model_config

    cfg = tiny_model_config("tiny-llama")
    cfg.head_dim = 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(torch.float64).eval().requires_grad_(False)


MIXED = [("f16", "q4_0"), ("q4_0", "f16"), ("q8_0", "q4_1"), ("iq4_nl", "q5_0")]


@pytest.mark.parametrize("name", LLAMACPP_PRESETS + [f"{k}/{v}" for k, v in MIXED])
def test_llamacpp_emulation_equals_real_cache_float64(name, tiny_llama_hd64):
    """Emulation (one pass) and token-by-token decoding through the real cache agree to 1e-9 in float64: the
    query/output hooks and the rotated domain go through the same transforms in both paths."""
    model = tiny_llama_hd64
    if "/" in name:
        k, v = name.split("/")
        policy = KVPolicy.from_config(llamacpp_config(k, v), name=name)
    else:
        policy = KVPolicy.preset(name)
    ids = ids_for(model, 24)
    with torch.no_grad():
        baseline = model(ids).logits
    emulated = emulated_logits(model, ids, policy)
    assert (emulated - baseline).abs().max() > 1e-6
    for prefill in (1, 9):
        decoded, _ = decoded_logits(model, ids, policy, prefill_len=prefill)
        torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)
    torch.testing.assert_close(emulated_logits(model, ids, policy, prefill_len=9), emulated, rtol=0, atol=1e-12)


def test_rotation_changes_the_result_only_where_llamacpp_rotates(tiny_llama_hd64):
    """With rotation the quantization error differs (the rotation acts); format none with every transform of a
    llama.cpp policy leaves the logits unchanged up to the f16 query rounding (f16 keys)."""
    model = tiny_llama_hd64
    ids = ids_for(model, 20)
    rot = emulated_logits(model, ids, KVPolicy.preset("llamacpp_q4_0"))
    norot = emulated_logits(model, ids, KVPolicy.preset("llamacpp_q4_0_norot"))
    assert (rot - norot).abs().max() > 1e-4
    with torch.no_grad():
        baseline = model(ids).logits
    f16 = emulated_logits(model, ids, KVPolicy.from_config(llamacpp_config("f16", "f16")))
    assert 0 < (f16 - baseline).abs().max() < 1e-2


def test_every_llamacpp_type_has_a_spec():
    from kveval.quant import preset

    assert preset(LLAMACPP_SPECS["q8_0"]).ggml == "q8_0_x86"
    assert all(LLAMACPP_SPECS[t] == "none" or preset(LLAMACPP_SPECS[t]).ggml is not None for t in LLAMACPP_SPECS)


def test_gguf_order_acts_only_on_families_whose_gguf_is_permuted(tiny_llama64, tiny_gemma3_64, monkeypatch):
    """llama.cpp converts Llama/Mistral/Mixtral Q/K rows to its interleaved order, other families (Gemma, Qwen)
    keep HF's: a llama.cpp preset leaves ``gguf_order`` out of a Gemma model's chains, and its numbers then equal
    those of the same policy written without it (on a head_dim-64 Gemma, where the order would matter)."""
    from transformers import AutoModelForCausalLM

    from kveval.models import tiny_model_config
    from kveval.patch.quantizers import layer_quantizers, model_type_of

    (llama, _), (gemma, _) = tiny_llama64, tiny_gemma3_64
    assert (model_type_of(llama), model_type_of(gemma)) == ("llama", "gemma3_text")
    policy = KVPolicy.preset("llamacpp_q4_0")

    def names(model_type):
        k, _ = layer_quantizers(policy, 0, 4, model_type=model_type)
        return [t.name for t in k.transforms.transforms]

    assert "gguf_order" in names("llama") and "gguf_order" in names("mistral")
    assert "gguf_order" not in names("gemma3_text") and "gguf_order" not in names("qwen3")
    assert "gguf_order" in names(None)  # unknown family: as the preset says

    cfg = tiny_model_config("tiny-gemma3")
    cfg.head_dim = 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gemma64 = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    gemma64 = gemma64.to(torch.float64).eval().requires_grad_(False)
    config = policy.to_config()
    config["transforms"] = [t for t in config["transforms"] if t != "gguf_order"]
    without = KVPolicy.from_config(config)
    ids = ids_for(gemma64, 24)
    got = emulated_logits(gemma64, ids, policy)
    assert torch.equal(got, emulated_logits(gemma64, ids, without))
    # were Gemma's GGUF permuted, the 32-wide blocks would hold other channels and the numbers would differ
    monkeypatch.setattr(kveval.gguf, "PERMUTED_MODEL_TYPES", frozenset({"gemma3_text"}))
    assert (emulated_logits(gemma64, ids, policy) - got).abs().max() > 1e-6
