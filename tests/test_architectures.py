"""The architecture matrix: one tiny random model per attention family kveval models (kveval.models.builtin
TINY_FAMILIES: plain GQA, QKV bias, QK norm, fused QKV, sliding windows, partial rotary, learned sinks, chunked
attention with a NoPE layer, MLA, linear-attention and Mamba hybrids) under every registered format's first preset,
the main engine presets and the RoPE-dependent transforms. Each pair either works (float64 emulation == the real
cache, bill == the bytes the cache holds, state included) or is refused in one line naming why."""

from __future__ import annotations

import re

import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import Arch, check_design, fp16_bytes, kv_bytes
from kveval.models import build_tiny_model
from kveval.models.builtin import TINY_FAMILIES
from kveval.patch import QuantizedKVCache, resident_nbytes
from kveval.policy import KVPolicy
from kveval.quant import preset, preset_names
from kveval.quant.formats.registry import format_names


def _first_presets() -> list[str]:
    """The first QuantSpec preset of every registered format (``none`` excluded: it quantizes nothing)."""
    first: dict[str, str] = {}
    for name in preset_names():
        spec = preset(name)
        first.setdefault(spec.ggml or spec.format, name)
    missing = [f for f in format_names() if f not in first and f != "int"]
    assert not missing, f"formats without a preset: {missing}"
    return [n for f, n in first.items() if f != "none"]


ENGINES = ["vllm_fp8", "vllm_fp8_fa3", "llamacpp_q8_0", "llamacpp_q4_0", "hf_quanto_int4", "hf_hqq_int4", "kivi2",
           "vllm_nvfp4", "vllm_turboquant_k8v4", "vllm_int4_per_token_head", "sglang_fp4_e2m1", "vllm_fp8_ds_mla",
           "vllm_nvfp4_ds_mla"]
TRANSFORMS = {"pre_rope": {"spec": "int4_g32", "pre_rope": True}, "hadamard": {"spec": "int4_g32", "rotate": "hadamard"}}
POLICIES = _first_presets() + ENGINES + list(TRANSFORMS)

_SLIDING = {"tiny-gemma3", "tiny-mistral", "tiny-cohere2", "tiny-gpt-oss"}
_WINDOWED = _SLIDING | {"tiny-llama4"}
_STATE = {"tiny-qwen3-next", "tiny-falcon-h1", "tiny-granite-hybrid"}
_MLA = {"tiny-deepseek-v3"}
_PER_HEAD_ONLY = {"vllm_fp8_fa3", "llamacpp_q8_0", "llamacpp_q4_0", "vllm_nvfp4", "vllm_turboquant_k8v4",
                  "vllm_int4_per_token_head", "sglang_fp4_e2m1"}

#: (families, policies, why): the pairs kveval refuses, and the words of the refusal
REFUSALS = [
    (set(TINY_FAMILIES) - _MLA, {"vllm_fp8_ds_mla", "vllm_nvfp4_ds_mla"}, "supports an MLA latent cache only"),
    (_WINDOWED | _STATE, {"hf_quanto_int4", "hf_hqq_int4"}, "supports per-head K/V, an MLA latent cache, learned "
                                                             "attention sinks only; this model has"),
    (set(TINY_FAMILIES) - _MLA - _WINDOWED - _STATE, {"hf_quanto_int4", "hf_hqq_int4"},
     "group_size 64 does not divide head_dim 32"),
    (_MLA, _PER_HEAD_ONLY, "this model has an MLA latent cache"),
    ({"tiny-gpt-oss"}, {"vllm_fp8_fa3"}, "this model has learned attention sinks"),
    (_WINDOWED, {"kivi2"}, "blocks of 128 tokens, longer than the 8-token"),
    (_MLA, {"kivi2"}, "different schedules cannot be emulated on an MLA latent"),
    (_MLA, {"pre_rope", "hadamard"}, "not modelled on an MLA model"),
    ({"tiny-glm4-moe", "tiny-qwen3-next"}, {"pre_rope"}, "partial rotary"),
    ({"tiny-llama4"}, {"pre_rope"}, "layers without RoPE"),
    # refused by the RoPE capture at the first forward pass (one line, before any number is computed)
    ({"tiny-cohere2"}, {"pre_rope"}, "not the rotate-half form"),
    ({"tiny-gpt-oss"}, {"pre_rope"}, "rotary dimension 16 != head_dim 32"),
    ({"tiny-granite-hybrid"}, {"pre_rope"}, "no rotary position embeddings"),
]


def _expected_refusal(family: str, policy: str) -> str | None:
    found = [why for fams, pols, why in REFUSALS if family in fams and policy in pols]
    assert len(found) <= 1, (family, policy, found)
    return found[0] if found else None


def _policy(name: str) -> KVPolicy:
    return KVPolicy.from_config(TRANSFORMS[name], name=name) if name in TRANSFORMS else KVPolicy.preset(name)


T, PROMPT = 8, 3  # tokens per sequence, and the prompt the real cache takes in one call


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_architecture_matrix(family):
    model = build_tiny_model(family, dtype="float64")
    arch = Arch.from_model(model)
    ids = ids_for(model, T)
    with torch.no_grad():
        fp = model(ids).logits
    fp16 = KVPolicy.preset("fp16")  # how far one pass and step-by-step decoding differ with nothing quantized
    base_gap = float((emulated_logits(model, ids, fp16) - decoded_logits(model, ids, fp16, PROMPT)[0]).abs().max())
    worked, refused = [], []
    for name in POLICIES:
        policy, why = _policy(name), _expected_refusal(family, name)
        try:
            check_design(arch, policy)
            emu = emulated_logits(model, ids, policy, prefill_len=PROMPT)
        except KvevalError as exc:
            msg = str(exc)
            assert why is not None, f"{family} x {name} was refused: {msg}"
            assert "\n" not in msg and re.search(why, msg), f"{family} x {name}: {msg!r} does not say {why!r}"
            with pytest.raises(KvevalError, match=re.escape(msg)):  # the real cache refuses it in the same words
                decoded_logits(model, ids, policy, prefill_len=PROMPT)
            refused.append(name)
            continue
        assert why is None, f"{family} x {name} should be refused ({why})"
        dec, cache = decoded_logits(model, ids, policy, prefill_len=PROMPT)
        gap, effect = float((emu - dec).abs().max()), float((emu - fp).abs().max())
        bill = kv_bytes(arch, policy, T, fp_bytes=8, prompt=PROMPT)
        held = cache.nbytes()
        assert held["total"] == bill.total and held.get("state", 0) == bill.state, (family, name, held, bill)
        # and it holds nothing else (the lean read path: no full-precision copy of the quantized tokens)
        # (pre-RoPE keys: and the (cos, sin) of each held position, QuantizedKVCache.rope_table_nbytes)
        assert resident_nbytes(cache) == bill.total + bill.state + cache.rope_table_nbytes(), (family, name, bill)
        if bill.codes:  # something was quantized in these T tokens (KIVI's 128-token residual: nothing)
            # the emulation reproduces the real cache to 1e-4 of the quantization effect, beyond what one pass and
            # step-by-step decoding differ by unquantized (float64; families with float32 internals, norms, MoE
            # routers, Mamba scans, differ by ~1e-8 there)
            assert effect > 0 and gap <= 1e-4 * effect + 10 * base_gap, (family, name, gap, effect, base_gap)
        else:
            assert gap <= 1e-12 + 10 * base_gap and effect == 0.0, (family, name, gap, effect)
        worked.append(name)
    assert len(worked) + len(refused) == len(POLICIES)
    assert len(worked) >= len(POLICIES) // 2, (family, refused)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_generate_with_the_real_cache(family):
    model = build_tiny_model(family)
    ids = ids_for(model, 9)
    policy = KVPolicy.preset("int4_g32")
    cache = QuantizedKVCache(model, policy)
    out = model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape[1] == 14
    n = cache.get_seq_length()  # the cache holds every token but the last generated one
    bill = kv_bytes(Arch.from_model(model), policy, n, fp_bytes=4, prompt=9)
    assert cache.nbytes()["total"] == bill.total and cache.nbytes().get("state", 0) == bill.state


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3", "tiny-falcon-h1"])
def test_real_cache_refuses_what_it_cannot_do_to_its_stores(family):
    """Beam search reorders the cache's rows, assisted decoding drops its newest tokens: transformers' DynamicLayer
    methods would edit an empty placeholder and carry on from the wrong history, so the cache refuses them in one
    line (Falcon-H1: the layer that also holds a Mamba state refuses them too, not only its state part)."""
    model = build_tiny_model(family)
    ids = ids_for(model, 9)
    policy = KVPolicy.preset("int4_g32")
    with pytest.raises(KvevalError, match=r"num_beams=1") as err:
        model.generate(ids, cache=QuantizedKVCache(model, policy), max_new_tokens=3, num_beams=2, do_sample=False)
    assert "\n" not in str(err.value)
    with pytest.raises(KvevalError, match=r"repeat the rows.*num_beams=1"):  # rows given: the batch is 2x them
        model.generate(ids, cache=QuantizedKVCache(model, policy, left_padding=[0]), max_new_tokens=3, num_beams=2,
                       do_sample=False)
    cache = QuantizedKVCache(model, policy)
    assert not cache.is_croppable  # transformers' assisted decoding checks this and refuses after the prefill
    model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    held = cache.get_seq_length()
    assert isinstance(held, int) and held == 10
    for call, words in ((lambda: cache.crop(-1), "cannot drop stored tokens"),
                        (lambda: cache.reorder_cache(torch.tensor([0])), "num_beams=1"),
                        (lambda: cache.batch_repeat_interleave(2), "num_beams=1"),
                        (lambda: cache.batch_select_indices(torch.tensor([0])), "build a new cache")):
        with pytest.raises(KvevalError, match=words):
            call()
    assert cache.get_seq_length() == held  # nothing changed


#: what the real cache's layers take from transformers' layer classes unchanged, each reviewed: a new transformers
#: release that adds a member to those classes fails the test below until it is reviewed here or overridden
_INHERITED_AS_IS = {
    "_layer_type": "registration data (None: not registered)",
    "is_compileable": "False for every class involved",
    "is_sliding": "an attribute QuantizedKVLayer.__init__ sets",
    "supports_early_init": "early_initialization hands lazy_initialization a 0-token tensor of the real shape",
    "offload": "only an offloading Cache calls it; QuantizedKVCache is never built with offloading",
    "prefetch": "only an offloading Cache calls it; QuantizedKVCache is never built with offloading",
    # the state part of QuantizedHybridLayer: transformers' own LinearAttentionLayer tensors, kept as they are
    "activate_past_recording": "state part; crop, which would use it, is refused",
    "increase_count": "state part: its token counter",
    "update_conv_state": "state part",
    "update_recurrent_state": "state part",
}


def test_cache_layers_review_every_method_transformers_gives_them():
    """QuantizedKVLayer subclasses DynamicLayer and QuantizedHybridLayer LinearAttentionLayer too: a method of
    theirs that the quantized layers inherit would work on transformers' placeholders, not on the stores (beam
    search went on from the wrong history that way). transformers 5.25 gave LinearAttentionLayer a get_seq_length
    (a tensor counter) that took precedence over QuantizedKVLayer's in the hybrid layer's MRO: so every member the
    attention part defines must resolve to it (or to the hybrid layer's own), and every other inherited member
    must be reviewed."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    from kveval.patch.cache import QuantizedHybridLayer, QuantizedKVLayer

    ours = (QuantizedKVLayer, QuantizedHybridLayer)
    for cls, bases in ((QuantizedKVLayer, (DynamicLayer,)), (QuantizedHybridLayer, (LinearAttentionLayer, DynamicLayer))):
        names = {n for base in bases for k in base.__mro__ if k is not object for n in vars(k)
                 if not n.startswith("__") and n != "_abc_impl"}
        for name in sorted(names):
            owner = next(k for k in cls.__mro__ if name in vars(k))
            assert owner in ours or name in _INHERITED_AS_IS, (
                f"{cls.__name__}.{name} comes from transformers' {owner.__name__} unreviewed: override it (work on "
                "the quantized stores, or raise KvevalError) or add it to _INHERITED_AS_IS with the reason")
    for name in vars(QuantizedKVLayer):
        if name.startswith("__") or name == "_abc_impl":
            continue
        owner = next(k for k in QuantizedHybridLayer.__mro__ if name in vars(k))
        assert owner in ours, f"QuantizedHybridLayer.{name} resolves to {owner.__name__}, not the attention part"


# ------------------------------------------------------------------------------------------------- MLA
def _deepseek_of_the_issue(layout_dtype=torch.float64):
    """The DeepSeek-V3 config of issue 28: hidden 256, 4 heads, head_dim 64 (the RoPE part), 2 layers, latent 32."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=260, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                           topk_group=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
                           v_head_dim=32, max_position_embeddings=256,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa",
                                                 experts_implementation="eager")
    return model.to(layout_dtype).eval().requires_grad_(False)


def test_mla_bill_is_the_latent():
    model = _deepseek_of_the_issue()
    arch = Arch.from_model(model)
    assert arch.mla is not None and arch.kv_shapes() == ((1, 32), (1, 64))
    # (kv_lora_rank + qk_rope_head_dim) x 2 B x 2 layers = 384 B/token; the decompressed per-head K/V attention
    # sees: 4 heads x (32 + 64) keys + 4 heads x 32 values, x 2 B x 2 layers = 2,048 B/token
    assert fp16_bytes(arch, 1000) == 1000 * 384 == kv_bytes(arch, "fp16", 1000).total
    assert kv_bytes(arch, KVPolicy.from_config({"spec": "none", "mla": "decompressed"}), 1000).total == \
        1000 * 2 * (4 * 96 + 4 * 32) * 2 == 1000 * 2048
    # the real cache holds exactly that: the latent, in the model's dtype (8 B in float64)
    ids = ids_for(model, 12)
    _, cache = decoded_logits(model, ids, KVPolicy.preset("fp16"))
    assert cache.nbytes()["total"] == 12 * 2 * (32 + 64) * 8 == kv_bytes(arch, "fp16", 12, fp_bytes=8).total


def test_mla_emulation_equals_the_real_cache_on_the_latent():
    model = _deepseek_of_the_issue()
    ids = ids_for(model, 16)
    for policy in (KVPolicy.preset("int8"), KVPolicy.from_config({"spec": "int4_g32", "residual": 4}),
                   KVPolicy.from_config({"key": "int4_g32", "value": "none", "sink_tokens": 2})):
        emu = emulated_logits(model, ids, policy, prefill_len=5)
        dec, cache = decoded_logits(model, ids, policy, prefill_len=5)
        with torch.no_grad():
            effect = float((emu - model(ids).logits).abs().max())
        # DeepSeek's MoE router runs in float32 (F.linear of the hidden state cast to float32), so one pass and
        # step-by-step decoding differ by ~1e-8 at some tokens even in a float64 model
        assert float((emu - dec).abs().max()) < 1e-4 * effect and effect > 1e-3
        assert cache.nbytes()["total"] == kv_bytes(Arch.from_model(model), policy, 16, fp_bytes=8, prompt=5).total


def test_mla_layouts_give_different_logits():
    """Quantizing the latent (what engines store) and the decompressed per-head K/V (what attention sees) are two
    different caches: the choice changes the numbers."""
    model = _deepseek_of_the_issue()
    ids = ids_for(model, 16)
    latent = emulated_logits(model, ids, KVPolicy.preset("int4_g32"))
    decompressed = emulated_logits(model, ids, KVPolicy.from_config({"spec": "int4_g32", "mla": "decompressed"}))
    with torch.no_grad():
        fp = model(ids).logits
    assert float((latent - decompressed).abs().max()) > 0.1 * float((latent - fp).abs().max()) > 0
    with pytest.raises(KvevalError, match="mla: decompressed is an emulation"):
        QuantizedKVCache(model, KVPolicy.from_config({"spec": "int4_g32", "mla": "decompressed"}))


def test_mla_group_sizes_name_the_latent():
    model = _deepseek_of_the_issue()
    with pytest.raises(KvevalError) as err:
        QuantizedKVCache(model, KVPolicy.preset("int4_g64"))
    msg = str(err.value)
    assert "group_size 64 does not divide" in msg and "the latent c_kv, 32 wide" in msg and "\n" not in msg


# ------------------------------------------------------------------------------------------------- hybrids
@pytest.mark.parametrize("family,kv_layers", [("tiny-qwen3-next", [1]), ("tiny-falcon-h1", [0, 1]),
                                              ("tiny-granite-hybrid", [1])])
def test_hybrid_bill_counts_attention_layers_only(family, kv_layers):
    model = build_tiny_model(family, dtype="float32")
    arch = Arch.from_model(model)
    assert list(arch.kv_layers) == kv_layers and arch.state is not None
    per_layer = 2 * arch.kv_heads * arch.head_dim * 2  # FP16 K and V of one token in one layer
    assert fp16_bytes(arch, 100) == 100 * per_layer * len(kv_layers)
    bill = kv_bytes(arch, "int4_g32", 100, fp_bytes=4)
    assert [i for i, (k, v) in enumerate(bill.per_layer) if k.total or v.total] == kv_layers
    # the fixed state: as transformers holds it after a forward pass (conv in the model dtype, recurrent in fp32)
    ids = ids_for(model, 7)
    _, cache = decoded_logits(model, ids, KVPolicy.preset("int4_g32"), prefill_len=3)
    assert cache.nbytes()["state"] == bill.state == arch.state_bytes(4) > 0


def test_scan_lists_attention_layers_only(tmp_path):
    import json

    from kveval.commands.scan import scan_command

    # Falcon-H1 scales its logits after the final norm: the scan's prefix reuse does not reproduce it, naive does
    for family, expected, naive in (("tiny-qwen3-next", {1}, False), ("tiny-falcon-h1", {0, 1}, True)):
        path = tmp_path / f"{family}.yaml"
        body = {"specs": ["int4_g32"], "seq_len": 16, "max_tokens": 16, "plots": False, "naive": naive}
        path.write_text(f"name: scan\nmodel: {{name: 'builtin:{family}', dtype: float64}}\nkv: [int4_g32]\n"
                        f"tasks:\n  - sensitivity: {json.dumps(body)}\noutput: {tmp_path / family}\n")
        cells = scan_command(str(path), quiet=True)["sensitivity"]["cells"]
        assert {c["layer"] for c in cells} == expected and len(cells) == 2 * len(expected)
        assert all(c["kld"] > 0 for c in cells)
    path = tmp_path / "tiny-qwen3-next.yaml"
    path.write_text(path.read_text().replace('"plots": false', '"plots": false, "layers": 0'))
    with pytest.raises(KvevalError, match="selects layers 0 that hold no K/V"):
        scan_command(str(path), quiet=True, overwrite=True)


def test_hybrid_policy_selectors_use_model_indices():
    """A layer override addresses an attention layer by its index in the model (layer 1 of Qwen3-Next is its only
    attention layer): overriding it to none leaves nothing quantized."""
    model = build_tiny_model("tiny-qwen3-next", dtype="float64")
    ids = ids_for(model, 8)
    policy = KVPolicy.from_config({"spec": "int4_g32", "layers": {"1": {"spec": "none"}}})
    with torch.no_grad():
        fp = model(ids).logits
    assert float((emulated_logits(model, ids, policy) - fp).abs().max()) == 0.0
    assert kv_bytes(Arch.from_model(model), policy, 8).codes == 0


# ------------------------------------------------------------------------------------------------- designs kveval does not model
def test_unmodelled_designs_are_refused_in_one_line():
    from kveval.memory.arch import layer_kinds_of

    with pytest.raises(KvevalError, match="'indexed_attention' are not modelled by kveval"):
        layer_kinds_of({"layer_types": ["indexed_attention", "full_attention"]}, 2)
    with pytest.raises(KvevalError, match="family kveval does not bill"):
        Arch.from_model_config({"model_type": "rwkv_hybrid", "num_hidden_layers": 2, "num_attention_heads": 2,
                                "hidden_size": 64, "layer_types": ["linear_attention", "full_attention"]})
    with pytest.raises(KvevalError, match="no layer of this model holds K/V"):
        Arch.from_model_config({"model_type": "qwen3_next", "num_hidden_layers": 1, "num_attention_heads": 2,
                                "hidden_size": 64, "layer_types": ["linear_attention"], "linear_num_key_heads": 1,
                                "linear_num_value_heads": 1, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                "linear_conv_kernel_dim": 4})


def test_engines_doc_names_every_design_group():
    """docs/engines.md's design table names every preset group of PRESET_DESIGNS."""
    from pathlib import Path

    from kveval.policy.presets import PRESET_DESIGNS

    text = (Path(__file__).resolve().parents[1] / "docs" / "engines.md").read_text()
    section = text[text.index("### Attention designs"):text.index("### vLLM's FP8 attention on FlashAttention 3")]
    for name in [*PRESET_DESIGNS, "vllm_fp8_ds_mla", "vllm_nvfp4_ds_mla"]:
        prefixes = [name, name.rsplit("_", 1)[0] + "_*", "_".join(name.split("_")[:2]) + "_*",
                    name.split("_")[0] + "_*", "vllm_*_per_token_head"]
        assert any(f"`{p}`" in section for p in prefixes), f"{name} is not in docs/engines.md's design table"


def test_calibrated_scales_on_a_hybrid(tmp_path):
    """scales: auto on Qwen3-Next: the scales file has one entry per model layer (zeros at the linear-attention
    layer, which no quantizer reads), and the attention layer's scales quantize it in both paths alike."""
    from kveval.commands.run import run_experiment
    from kveval.config import load_config
    from kveval.scales.file import load_scales

    path = tmp_path / "cal.yaml"
    path.write_text("name: cal\nmodel: {name: 'builtin:tiny-qwen3-next', dtype: float64}\n"
                    "kv: [{cal: {spec: int8_tensor, scales: auto}}]\n"
                    f"tasks:\n  - perplexity: {{seq_len: 32, max_tokens: 64}}\noutput: {tmp_path / 'out'}\n")
    metrics = run_experiment(load_config(path), quiet=True)
    assert metrics["policies"]["cal"]["kld_mean"] > 0 and metrics["policies"]["cal"]["layers_quantized"] == 1
    scales = load_scales(tmp_path / "out" / "scales.safetensors")
    absmax = scales.tensors["key.tensor.absmax"]
    assert absmax.shape[0] == 2 and float(absmax[0]) == 0.0 < float(absmax[1])
    model = build_tiny_model("tiny-qwen3-next", dtype="float64")
    policy = KVPolicy.from_config({"spec": "int8_tensor", "scales": str(tmp_path / "out" / "scales.safetensors")})
    model.kveval_name = "builtin:tiny-qwen3-next"
    ids = ids_for(model, 10)
    emu, dec = emulated_logits(model, ids, policy), decoded_logits(model, ids, policy)[0]
    with torch.no_grad():
        effect = float((emu - model(ids).logits).abs().max())
    assert float((emu - dec).abs().max()) <= 1e-4 * effect and effect > 0
