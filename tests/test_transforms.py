"""K/V transforms as plug-ins (kveval.transforms): one code path for emulation and the real cache.

A toy transform defined and registered here, a random orthogonal ``H`` on head_dim, rotates Q and K together
(q·k unchanged) and V together with the attention output (o = o' Hᵀ). ``keep=True`` keeps the cache rotated and
rotates the query and the output (llama.cpp); ``keep=False`` un-rotates K and V on read (no query/output hooks).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import ClassVar

import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.config import validate
from kveval.errors import KvevalError
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.patch.quantizers import layer_quantizers
from kveval.policy import POLICY_PRESETS, KVPolicy
from kveval.quant import QuantSpec
from kveval.transforms import KVTransform, TransformChain, TransformContext, register


@lru_cache
def _orthogonal(head_dim: int, seed: int) -> torch.Tensor:
    """A random orthogonal ``[head_dim, head_dim]`` float64 matrix."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


@register
@dataclass(frozen=True)
class ToyRotation(KVTransform):
    """x -> xH on head_dim for K and V (``[batch, heads, T, head_dim]``); see the module docstring."""

    name: ClassVar[str] = "toy_rotation"
    seed: int = 0
    keep: bool = True

    def _h(self, x: torch.Tensor) -> torch.Tensor:
        return _orthogonal(x.shape[-1], self.seed).to(x)

    def key_in(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return k @ self._h(k)

    def key_out(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return k if self.keep else k @ self._h(k).T

    def value_in(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return v @ self._h(v)

    def value_out(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return v if self.keep else v @ self._h(v).T

    def query(self, q: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return q @ self._h(q)

    def output(self, o: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return o @ self._h(o).T

    @property
    def has_query_hook(self) -> bool:
        return self.keep

    @property
    def has_output_hook(self) -> bool:
        return self.keep

    @property
    def keeps_keys_transformed(self) -> bool:
        return self.keep

    @property
    def keeps_values_transformed(self) -> bool:
        return self.keep


def emulated(model, ids, policy, prefill_len=0):
    return emulated_logits(model, ids, policy, prefill_len)


def decoded(model, ids, policy, prefill_len=1):
    return decoded_logits(model, ids, policy, prefill_len)[0]


def rotated(policy: KVPolicy, keep: bool = True, seed: int = 1) -> KVPolicy:
    return replace(policy, transforms=(ToyRotation(seed, keep),))


INT4 = QuantSpec(bits=4)
INT4_G8 = QuantSpec(bits=4, mapping="asymmetric", granularity="group", group_size=8)
POLICIES = {
    "token_int4": KVPolicy(key=INT4, value=INT4),
    "group_int4_sinks_residual": KVPolicy(key=INT4_G8, value=QuantSpec(bits=2, mapping="asymmetric"), residual=5,
                                          sink_tokens=2),
    "kivi_block": KVPolicy(key=QuantSpec(bits=2, mapping="asymmetric", granularity="channel"),
                           value=QuantSpec(bits=2, mapping="asymmetric"), residual=8, residual_mode="block"),
    "keys_only": KVPolicy(key=INT4_G8),
    "mixed_layers": KVPolicy.from_config({"key": "int4_g32", "value": "int8", "layers": {"0": {"spec": "none"}}}),
}
MODELS = ["tiny_llama64", "tiny_gemma3_64"]


# --- format none: the rotation is exact -----------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("model_fixture", MODELS)
def test_rotation_with_format_none_leaves_the_logits_unchanged(keep, model_fixture, request):
    model, _ = request.getfixturevalue(model_fixture)
    ids = ids_for(model, 30)
    with torch.no_grad():
        baseline = model(ids).logits
    policy = rotated(KVPolicy(), keep)
    torch.testing.assert_close(emulated(model, ids, policy), baseline, rtol=0, atol=1e-10)
    torch.testing.assert_close(decoded(model, ids, policy), baseline, rtol=0, atol=1e-10)
    torch.testing.assert_close(emulated(model, ids, replace(policy, residual=4, sink_tokens=2), prefill_len=9),
                               baseline, rtol=0, atol=1e-10)


def test_the_query_hook_really_runs_with_format_none(tiny_llama64, monkeypatch):
    """Keys rotated but the query not (the query hook switched off): the logits change, in both paths."""
    model, _ = tiny_llama64
    ids = ids_for(model, 20)
    with torch.no_grad():
        baseline = model(ids).logits
    monkeypatch.setattr(ToyRotation, "query", lambda self, q, ctx: q)
    policy = rotated(KVPolicy())
    assert (emulated(model, ids, policy) - baseline).abs().max() > 1e-3
    assert (decoded(model, ids, policy) - baseline).abs().max() > 1e-3


# --- int4: emulation == the real cache, and the rotation acts -------------------------------------------------------
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("model_fixture", MODELS)
def test_rotated_emulation_equals_real_cache_decoding_float64(name, keep, model_fixture, request):
    model, _ = request.getfixturevalue(model_fixture)
    ids = ids_for(model, 36)
    policy = rotated(POLICIES[name], keep)
    emu = emulated(model, ids, policy)
    torch.testing.assert_close(emu, decoded(model, ids, policy), rtol=0, atol=1e-9)
    plain = emulated(model, ids, POLICIES[name])
    assert (emu - plain).abs().max() > 1e-6, "the rotation must change the quantized result"


@pytest.mark.parametrize("prefill", ["fp", "quantized"])
@pytest.mark.parametrize("model_fixture", MODELS)
def test_rotated_prefill_modes_match(prefill, model_fixture, request):
    model, _ = request.getfixturevalue(model_fixture)
    ids = ids_for(model, 34, seed=1)
    policy = rotated(replace(POLICIES["group_int4_sinks_residual"], prefill=prefill))
    torch.testing.assert_close(emulated(model, ids, policy, prefill_len=11), decoded(model, ids, policy, 11),
                               rtol=0, atol=1e-9)


def test_rotating_the_query_or_unrotating_the_cache_is_the_same_maths(tiny_llama64):
    """(qH)·k̂ = q·(k̂Hᵀ) and o'Hᵀ = softmax·(v̂Hᵀ): both choices give the same logits up to float rounding."""
    model, _ = tiny_llama64
    ids = ids_for(model, 32)
    policy = POLICIES["group_int4_sinks_residual"]
    torch.testing.assert_close(emulated(model, ids, rotated(policy, True)), emulated(model, ids, rotated(policy, False)),
                               rtol=0, atol=1e-9)


@pytest.mark.parametrize("transforms", [("pre_rope", {"name": "toy_rotation", "keep": False}),
                                        ({"name": "toy_rotation", "keep": True}, "pre_rope")])
def test_rotation_composes_with_pre_rope(transforms, tiny_llama64):
    model, _ = tiny_llama64
    ids = ids_for(model, 30)
    policy = KVPolicy.from_config({"key": {"bits": 4, "mapping": "asymmetric", "granularity": "channel"},
                                   "value": "int4_g32", "residual": 8, "residual_mode": "block",
                                   "transforms": list(transforms)})
    assert len(policy.transform_sequence()) == 2
    torch.testing.assert_close(emulated(model, ids, policy), decoded(model, ids, policy), rtol=0, atol=1e-9)


# --- plumbing: nothing extra without hooks, the model restored ------------------------------------------------------
def test_hooks_wrap_the_model_only_while_the_cache_is_passed(tiny_llama64):
    model, _ = tiny_llama64
    original = model.config._attn_implementation
    hooks = len(model._forward_pre_hooks), len(model._forward_hooks)
    plain = QuantizedKVCache(model, rotated(POLICIES["token_int4"], keep=False))
    assert all(layer.implementation is None for layer in plain.layers), "no query/output hooks: nothing wrapped"
    del plain  # (a cache watches the first call's attention mask for left padding until it is collected)
    gc.collect()
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks
    cache = QuantizedKVCache(model, rotated(POLICIES["token_int4"], keep=True))
    ids = ids_for(model, 12)
    with torch.no_grad():
        model(ids, use_cache=True, **cache_kwargs(model, cache))
        assert model.config._attn_implementation == original, "restored after the call"
        with pytest.raises(RuntimeError, match="pass the cache to the model"):
            model.model(ids, use_cache=True, **cache_kwargs(model.model, cache))  # the hooks sit on the top model
    del cache
    gc.collect()
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks, "hooks removed with the cache"


def test_generate_through_a_rotated_cache(tiny_llama64):
    model, _ = tiny_llama64
    ids = ids_for(model, 10)
    kw = dict(max_new_tokens=8, do_sample=False)
    plain = model.generate(ids, **kw)
    same = model.generate(ids, past_key_values=QuantizedKVCache(model, rotated(KVPolicy())), **kw)
    assert torch.equal(plain, same)
    out = model.generate(ids, past_key_values=QuantizedKVCache(model, rotated(POLICIES["token_int4"])), **kw)
    assert out.shape == plain.shape


# --- the policy and its config form ---------------------------------------------------------------------------------
def test_existing_policies_write_no_transform_keys():
    for name in POLICY_PRESETS:
        cfg = KVPolicy.preset(name).to_config()
        # presets that declare transforms (llama.cpp's rotation, channel order, query rounding) write them
        assert ("transforms" in cfg) == ("transforms" in POLICY_PRESETS[name][0])
        assert ("pre_rope" in cfg) == KVPolicy.preset(name).pre_rope
    assert KVPolicy.preset("kvquant4_1pct").to_config()["pre_rope"] is True


def test_transforms_round_trip_and_a_leading_pre_rope_is_the_flag():
    p = KVPolicy.from_config({"spec": "int4_g64", "transforms": [{"name": "toy_rotation", "seed": 3}]})
    assert p.to_config()["transforms"] == [{"name": "toy_rotation", "seed": 3, "keep": True}]
    assert KVPolicy.from_config(p.to_config()) == replace(p, name="custom")
    flag = KVPolicy.from_config({"spec": "int4_g64", "pre_rope": True})
    listed = KVPolicy.from_config({"spec": "int4_g64", "transforms": ["pre_rope"]})
    assert listed == flag and listed.to_config() == flag.to_config()
    assert "toy_rotation" in p.describe()


def one_line_error(cfg) -> str:
    with pytest.raises(KvevalError) as info:
        KVPolicy.from_config(cfg, name="p")
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_bad_transforms_are_one_line_errors():
    msg = one_line_error({"spec": "int4_g64", "transforms": ["toy_rotaton"]})
    assert "p'.transforms[0]" in msg and "unknown transform 'toy_rotaton'" in msg and "did you mean 'toy_rotation'" in msg
    assert "did you mean 'seed'" in one_line_error({"spec": "int8", "transforms": [{"name": "toy_rotation", "sed": 1}]})
    assert "needs 'name'" in one_line_error({"spec": "int8", "transforms": [{"seed": 1}]})
    assert "appears twice" in one_line_error({"spec": "int8", "pre_rope": True, "transforms": ["pre_rope"]})
    msg = one_line_error({"spec": "int8", "pre_rope": True, "transforms": ["toy_rotation"]})
    assert "must come before 'pre_rope'" in msg
    assert "did you mean 'transforms'" in one_line_error({"spec": "int8", "transform": ["pre_rope"]})


def test_bad_transform_name_in_a_run_config_is_one_line():
    raw = {"name": "t", "kv": {"policies": {"rot": {"spec": "int4_g64", "transforms": ["toy_rotaton"]}}},
           "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 256}}]}
    with pytest.raises(KvevalError) as info:
        validate(raw, "c.yaml")
    assert "\n" not in str(info.value) and "did you mean 'toy_rotation'" in str(info.value)


def test_calibrated_scales_are_refused_for_a_rotated_domain():
    policy = KVPolicy(key=QuantSpec(bits=4, granularity="channel"), scales="s.safetensors",
                      transforms=(ToyRotation(),))
    with pytest.raises(KvevalError, match="not available for keys stored after the transforms toy_rotation"):
        layer_quantizers(policy, 0, 4, scales=object())


def test_chains_split_a_sequence_by_tensor():
    seq = KVPolicy(pre_rope=True, transforms=(ToyRotation(keep=False),)).transform_sequence()
    keys, values = TransformChain.of(seq, "key", 0), TransformChain.of(seq, "value", 0)
    assert [t.name for t in keys.transforms] == ["pre_rope", "toy_rotation"]
    assert [t.name for t in values.transforms] == ["toy_rotation"]
    assert keys.scales_kind() is None and TransformChain.of(seq[:1], "key", 0).scales_kind() == "key_pre_rope"
    assert not keys.has_query_hook and not values.has_output_hook and not keys.domain
    x = torch.randn(1, 2, 3, 8)
    assert keys.to_attention(x) is x, "full-precision tokens skip transforms that undo themselves on read"


# --- the attention hook: a transform computing the attention itself -------------------------------------------------
@register
@dataclass(frozen=True)
class ToySoftmaxAttention(KVTransform):
    """softmax(q kᵀ · scaling) v computed by hand in the attention hook, checking the hook's contract on the way:
    the positions a query may see are distinct (emulation's ``[k ; k̂]`` holds every token twice) and form one run
    (causal or sliding-window attention: a wrong position would leave a gap)."""

    name: ClassVar[str] = "toy_softmax_attention"

    def attention(self, q, k, v, allowed, key_positions, scaling, ctx):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        seen = allowed.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        per_position = torch.zeros(*seen.shape[:-1], int(key_positions.max()) + 1, dtype=torch.int64)
        per_position.scatter_add_(-1, key_positions.expand(seen.shape), seen.to(torch.int64))
        assert int(per_position.max()) <= 1, "a query sees two versions of one token"
        visible = per_position > 0
        n_positions = visible.shape[-1]
        first = visible.to(torch.int8).argmax(-1)
        last = n_positions - 1 - visible.flip(-1).to(torch.int8).argmax(-1)
        count = visible.sum(-1)
        assert bool(((count == 0) | (count == last - first + 1)).all()), "the visible positions have a gap"
        scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("model_fixture", MODELS)
def test_an_exact_attention_hook_leaves_the_logits_unchanged(model_fixture, request):
    """Format none with the toy hook: the baseline's logits through both paths (GQA, masks, sliding windows)."""
    model, _ = request.getfixturevalue(model_fixture)
    ids = ids_for(model, 30)
    with torch.no_grad():
        baseline = model(ids).logits
    policy = KVPolicy(transforms=(ToySoftmaxAttention(),))
    torch.testing.assert_close(emulated(model, ids, policy), baseline, rtol=0, atol=1e-10)
    torch.testing.assert_close(decoded(model, ids, policy), baseline, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["token_int4", "group_int4_sinks_residual", "kivi_block"])
@pytest.mark.parametrize("model_fixture", MODELS)
def test_an_attention_hook_sees_what_the_stock_attention_sees(name, model_fixture, request):
    """With quantized K/V (and windows, sinks, KIVI's split schedules: emulation's mixed ``[k ; k̂]`` calls), the
    toy hook gives the logits of the same policy without it, emulated and decoded, float64."""
    model, _ = request.getfixturevalue(model_fixture)
    ids = ids_for(model, 30)
    plain = POLICIES[name]
    hooked = replace(plain, transforms=(ToySoftmaxAttention(),))
    torch.testing.assert_close(emulated(model, ids, hooked, 9), emulated(model, ids, plain, 9), rtol=0, atol=1e-10)
    torch.testing.assert_close(decoded(model, ids, hooked, 9), decoded(model, ids, plain, 9), rtol=0, atol=1e-10)


def test_the_attention_hook_really_runs(tiny_llama64, monkeypatch):
    """Every attention call of both paths goes through the hook (4 layers: one emulated pass, 1 + 9 decode calls)."""
    model, _ = tiny_llama64
    ids = ids_for(model, 10)
    calls = []
    original = ToySoftmaxAttention.attention
    monkeypatch.setattr(ToySoftmaxAttention, "attention",
                        lambda self, *a: calls.append(a[0].shape[-2]) or original(self, *a))
    policy = KVPolicy(key=INT4, value=INT4, transforms=(ToySoftmaxAttention(),))
    emulated(model, ids, policy)
    assert calls == [10] * 4
    calls.clear()
    decoded(model, ids, policy)
    assert calls == [1] * 40


def test_two_attention_hooks_are_one_line_errors():
    msg = one_line_error({"spec": "fp8_e4m3", "transforms": ["toy_softmax_attention", "fa3_fp8_attention"]})
    assert "both replace the attention computation" in msg
    assert "positive integer" in one_line_error({"spec": "int8", "transforms": [{"name": "fa3_fp8_attention",
                                                                                  "block_n": 0}]})
    assert "positive finite" in one_line_error({"spec": "int8", "transforms": [{"name": "query_fp8", "scale": -1}]})


def test_the_attention_hook_belongs_to_the_value_chain():
    seq = KVPolicy(transforms=(ToySoftmaxAttention(),)).transform_sequence()
    keys, values = TransformChain.of(seq, "key", 0), TransformChain.of(seq, "value", 0)
    assert keys.transforms == () and keys.attention_transform is None
    assert values.attention_transform == ToySoftmaxAttention()
    k_q, v_q = layer_quantizers(KVPolicy(transforms=(ToySoftmaxAttention(),)), 0, 4)
    assert v_q.replaces_attention and v_q.hooks_attention and not k_q.hooks_attention


def test_an_attention_hook_refuses_soft_capping():
    from kveval.patch.attention import attention_call

    _, v_q = layer_quantizers(KVPolicy(transforms=(ToySoftmaxAttention(),)), 0, 4)
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(KvevalError, match="cannot compute attention with 'softcap'"):
        attention_call(None, v_q)(torch.nn.Module(), q, q, q, None, softcap=50.0)


def _fa3_out_of_place(q, k, v, allowed, scaling, block_n):
    """FA3's tiles as ``_fa3_tiles`` wrote them out of place (every step a new tensor), over every key at once."""
    import math

    from kveval.transforms.fa3_fp8_attention import LOG2_E, MAX_OFFSET, round_p_to_e4m3, tile_layout

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    allowed = allowed.expand(*allowed.shape[:-2], q.shape[-2], k.shape[-2])
    k, v, allowed, width = tile_layout(k, v, allowed, torch.arange(k.shape[-2]), block_n)
    scores = (q @ k.transpose(-1, -2)).mul_(scaling * LOG2_E).masked_fill_(~allowed, -math.inf)
    scores = scores.unflatten(-1, (-1, width))
    running = scores.amax(-1).flip(-1).cummax(-1).values.flip(-1)
    seen = running > -math.inf
    p = torch.exp2(scores - (torch.where(seen, running, 0.0) - MAX_OFFSET).unsqueeze(-1))
    rescale = torch.where(seen, torch.exp2(running - running[..., :1]), 0.0).unsqueeze(-1)
    row_sum = (p.sum(-1, keepdim=True) * rescale).sum(-2)
    out = round_p_to_e4m3(p).mul_(rescale).flatten(-2) @ v
    return out * torch.where(row_sum > 0, 1.0 / row_sum, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_fa3_tiles_computed_in_place_give_the_bits_of_the_out_of_place_steps(dtype, causal):
    """``fa3_fp8_attention`` computes P in the scores' buffer and rounds it there, and keeps whole tiles unpadded:
    the same bits as every step out of place (``_fa3_out_of_place``), with one row block of 64 queries covering
    the keys (so both see the same tiles), GQA heads, whole and partial tiles."""
    from kveval.transforms.fa3_fp8_attention import fa3_fp8_attention

    gen = torch.Generator().manual_seed(5)
    for n_keys in (256, 200):  # two whole tiles of 128; a partial last tile
        q = torch.randn(2, 6, 64, 32, generator=gen).to(dtype)
        k, v = (torch.randn(2, 2, n_keys, 32, generator=gen).to(dtype) for _ in range(2))
        if causal:
            allowed = torch.ones(64, n_keys, dtype=torch.bool).tril(n_keys - 64)[None, None]
        else:
            allowed = torch.rand(2, 1, 64, n_keys, generator=gen) > 0.3
        got = fa3_fp8_attention(q, k, v, allowed, torch.arange(n_keys), 0.17, 128)
        want = _fa3_out_of_place(q, k, v, allowed, 0.17, 128)
        assert torch.equal(got, want), (n_keys, causal)


def test_round_p_to_e4m3_is_the_cast_on_sampled_float32():
    """The four-pass rounding of FA3's P equals the saturating E4M3 cast on every 97th float32 in [0, 256] (all
    of them were checked once: 1,132,462,081 values, 0 differences), ties and subnormals included, in float64 too."""
    from kveval.transforms.fa3_fp8_attention import round_p_to_e4m3, round_to_e4m3

    top = int(torch.tensor(256.0).view(torch.int32))
    x = torch.arange(0, top + 1, 97, dtype=torch.int32).view(torch.float32)
    ties = torch.tensor([2.0**-10, 3 * 2.0**-10, 2.0**7.5, 136.0, 248.0, 2.0**-6 * (1 + 1 / 16)])
    for v in (x, ties, ties.double()):
        assert torch.equal(round_p_to_e4m3(v), round_to_e4m3(v))
    assert round_p_to_e4m3(ties).tolist()[:4] == [0.0, 2.0**-8, 176.0, 128.0]
    # in place (how FA3's tiles round P in the scores' buffer): the same values, written into the argument
    for v in (x, ties, ties.double(), ties.bfloat16(), (x[::1000] * 0.5).bfloat16()):
        want = round_p_to_e4m3(v)
        buffer = v.clone()
        got = round_p_to_e4m3(buffer, in_place=True)
        assert got is buffer and torch.equal(got, want)
        assert not torch.equal(v, want), "the sample must need rounding"
