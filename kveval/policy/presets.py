"""Policy presets: one table, name -> (config, one-line description). ``kveval ls`` lists them.

A preset's config is plain data in the form of a config's policy entry (``kv: {policies: {NAME: ...}}``), so a
preset is one entry here. Every QuantSpec preset (``kveval.quant.presets``) is also a policy name: the same spec for
keys and values.
"""

from __future__ import annotations

from typing import Any

from kveval.quant import preset_names

#: the llama.cpp the llamacpp_* presets reproduce (``ggml_commit()`` / ``ggml_version()`` of the libraries)
LLAMACPP_VERSION = "llama.cpp 0c1e570 (ggml 0.25.3) as bundled by llama-cpp-python 0.3.36"
#: llama.cpp cache type (-ctk/-ctv) -> the kveval spec that writes it (f16: kept in the model's precision)
LLAMACPP_SPECS = {"f16": "none", "q8_0": "q8_0_x86", "q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0",
                  "q5_1": "q5_1", "iq4_nl": "iq4_nl"}
#: K cache type -> the type llama.cpp's CPU attention converts the query to (kveval.transforms.query_quant)
_QUERY_TYPES = {"f16": "f16", "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "iq4_nl": "q8_0", "q4_1": "q8_1",
                "q5_1": "q8_1"}


def llamacpp_config(type_k: str, type_v: str, rotation: bool = True, gguf_order: bool = True) -> dict[str, Any]:
    """The policy config of llama.cpp's CPU KV cache with ``-ctk type_k -ctv type_v`` (flash attention on, as a
    quantized V requires), for a Llama-family GGUF (``gguf_order``: Q/K in the permuted channel order of
    convert_hf_to_gguf.py; False for Qwen2/3, Gemma, Phi-3 and other architectures it does not permute).

    Types: f16 (the default cache; kveval keeps it in the model's precision), q8_0 (x86 run-time write, format
    ``q8_0_x86``), q4_0, q4_1, q5_0, q5_1, iq4_nl. Transforms, in order: ``gguf_order``; ``hadamard`` on the
    quantized sides (``rotation``: llama.cpp's default; False = ``LLAMA_ATTN_ROT_DISABLE=1``); ``query_quant`` to the
    keys' vec_dot type (q8_0, q8_1 or f16). The prompt reads the quantized cache (``prefill: quantized``): llama.cpp
    writes a batch's K/V to the cache before attending to it. Worked: ``llamacpp_config("f16", "q4_0")`` ->
    ``{key: none, value: q4_0, prefill: quantized, transforms: [gguf_order, {name: hadamard, on: value},
    {name: query_quant, type: f16}]}``."""
    for t in (type_k, type_v):
        if t not in LLAMACPP_SPECS:
            raise ValueError(f"unknown llama.cpp cache type {t!r}; known: {', '.join(LLAMACPP_SPECS)}")
    transforms: list[Any] = ["gguf_order"] if gguf_order else []
    quantized = [kind for kind, t in (("key", type_k), ("value", type_v)) if t != "f16"]
    if rotation and quantized:
        transforms.append({"name": "hadamard", "on": "both" if len(quantized) == 2 else quantized[0]})
    transforms.append({"name": "query_quant", "type": _QUERY_TYPES[type_k]})
    return {"key": LLAMACPP_SPECS[type_k], "value": LLAMACPP_SPECS[type_v], "prefill": "quantized",
            "transforms": transforms}


def _llamacpp(t: str, rotation: bool = True) -> tuple[dict, str]:
    rot = "Hadamard rotation (default)" if rotation else "rotation off (LLAMA_ATTN_ROT_DISABLE=1)"
    return llamacpp_config(t, t, rotation), (
        f"llama.cpp 0c1e570 (llama-cpp-python 0.3.36) -ctk {t} -ctv {t}, CPU: {rot}, Llama GGUF Q/K order, "
        f"{_QUERY_TYPES[t]} query")

#: the KVQuant commit the kvquant*_1pct presets follow
KVQUANT_COMMIT = "SqueezeAILab/KVQuant @57a2383"


def kvquant_config(bits: int, outliers: float = 0.01) -> tuple[dict, str]:
    """KVQuant's nuq``bits``-``outliers`` recipe: keys before RoPE, per channel, with calibrated bounds (the
    0.5th/99.5th percentiles for 1%) in fp16; values per token over all kv heads with run-time quantile bounds;
    ``bits``-bit per-layer Fisher-weighted k-means codebooks fitted on the calibration slice (``scales: auto``); the
    outliers beyond the bounds kept exactly, at most floor(p/2 n) + 1 per side and token (n = kv heads x head_dim,
    KVQuant's cache, ``QuantK.forward_fused_sparse``), the first token in full precision (KVQuant's
    ``--first_few_fp16 1``, its attention-sink option, which the capped key outliers need: the first token's keys
    exceed the per-channel bounds in many channels); every attention reads the quantized cache, the prompt's too
    (KVQuant's simulation)."""
    pct = f"{100 * outliers:g}%"
    cfg = {"key": {"format": "nuq", "bits": bits, "mapping": "asymmetric", "granularity": "channel",
                   "scale_dtype": "float16", "outliers": outliers},
           "value": {"preset": f"nuq{bits}", "outliers": outliers},
           "pre_rope": True, "scales": "auto", "prefill": "quantized", "sink_tokens": 1}
    desc = (f"KVQuant nuq{bits}-{pct} ({KVQUANT_COMMIT}): keys pre-RoPE per channel with calibrated percentile "
            f"bounds (fp16), values per token over all kv heads, {bits}-bit per-layer k-means codebooks, outliers "
            "beyond the bounds kept exactly (at most floor(p/2 n)+1 per side and token, as its cache), first token "
            "in fp16 (first_few_fp16 1); Fisher-weighted k-means")
    return cfg, desc


POLICY_PRESETS: dict[str, tuple[dict, str]] = {
    "fp16": (
        {"spec": "none"},
        "no quantization (the full-precision baseline)",
    ),
    "int8": (
        {"spec": "int8"},
        "INT8 symmetric per-token keys and values",
    ),
    "int4_g32": (
        {"spec": "int4_g32"},
        "INT4 asymmetric, groups of 32, keys and values",
    ),
    "int4_g64": (
        {"spec": "int4_g64"},
        "INT4 asymmetric, groups of 64, keys and values",
    ),
    "int4_g128": (
        {"spec": "int4_g128"},
        "INT4 asymmetric, groups of 128, keys and values",
    ),
    "int2_g32": (
        {"spec": "int2_g32"},
        "INT2 asymmetric, groups of 32, keys and values",
    ),
    "k4v8": (
        {"key": "int4_g64", "value": "int8"},
        "keys INT4 g64, values INT8 per-token",
    ),
    "k8v4": (
        {"key": "int8", "value": "int4_g64"},
        "keys INT8 per-token, values INT4 g64",
    ),
    # KIVI as jy-yuan/KIVI @876b4d2 does it (models/llama_kivi.py, quant/new_pack.py): G = 32, R = 128
    "kivi2": (
        {"key": {"preset": "int2_channel", "group_size": 32}, "value": "int2_g32", "residual": 128,
         "residual_mode": {"key": "block", "value": "sliding_lag"}},
        "KIVI-2 (jy-yuan/KIVI @876b4d2): keys per channel in groups of 32 tokens, quantized 128 at a time after the step that used them; values per token in groups of 32 channels, the newest 128 in full precision; fp16 scale and min",
    ),
    "kivi4": (
        {"key": {"preset": "int4_channel", "group_size": 32}, "value": "int4_g32", "residual": 128,
         "residual_mode": {"key": "block", "value": "sliding_lag"}},
        "KIVI-4 (jy-yuan/KIVI @876b4d2): keys per channel in groups of 32 tokens, quantized 128 at a time after the step that used them; values per token in groups of 32 channels, the newest 128 in full precision; fp16 scale and min",
    ),
    "fp8_e4m3": (
        {"spec": "fp8_e4m3"},
        "FP8 E4M3 with a static scale of 1.0 (a plain saturating cast)",
    ),
    "q8_0": (
        {"spec": "q8_0"},
        "ggml q8_0 blocks of 32, fp16 scale, on K and V (the format alone; llamacpp_q8_0 is llama.cpp's cache)",
    ),
    "q4_0": (
        {"spec": "q4_0"},
        "ggml q4_0 blocks of 32, fp16 scale, on K and V (the format alone; llamacpp_q4_0 is llama.cpp's cache)",
    ),
    # serving engines (docs/engines.md says what each reproduces and where it differs)
    "vllm_fp8": (
        {"spec": "fp8_e4m3", "prefill": "quantized"},
        "vLLM --kv-cache-dtype fp8: E4M3, per-tensor scale 1.0 (no checkpoint scales; add scales: auto to calibrate), prompt attends to the quantized cache",
    ),
    "vllm_fp8_per_head": (
        {"spec": "fp8_e4m3_head", "scales": "auto", "prefill": "quantized"},
        "vLLM FP8 E4M3 with calibrated per-head scales (as llm-compressor writes them)",
    ),
    # vLLM's FLASH_ATTN backend on FlashAttention 3 (Hopper): vllm/attention/layer.py, vllm/v1/attention/backends/
    # flash_attn.py; vllm-project/flash-attention hopper/ (kveval.transforms.query_fp8, fa3_fp8_attention)
    "vllm_fp8_fa3": (
        {"spec": "fp8_e4m3", "prefill": "quantized",
         "transforms": [{"name": "query_fp8", "scale": 1.0}, {"name": "fa3_fp8_attention", "block_n": 128}]},
        "vLLM (read at vllm@5704f34, vllm-flash-attn@617264c) --kv-cache-dtype fp8 on FlashAttention 3: E4M3 K/V scale 1.0, query cast to E4M3 (q_scale 1.0), softmax probabilities x256 rounded to E4M3 per 128-key tile for P.V",
    ),
    "trtllm_int8": (
        {"spec": "int8_tensor", "scales": "auto"},
        "TensorRT-LLM INT8 KV cache: symmetric, one calibrated per-tensor scale per layer and K/V",
    ),
    # llama.cpp (kveval parity llamacpp checks each against the real library; llamacpp_config builds mixed K/V)
    "llamacpp_q8_0": _llamacpp("q8_0"),
    "llamacpp_q4_0": _llamacpp("q4_0"),
    "llamacpp_q4_1": _llamacpp("q4_1"),
    "llamacpp_q5_0": _llamacpp("q5_0"),
    "llamacpp_q5_1": _llamacpp("q5_1"),
    "llamacpp_iq4_nl": _llamacpp("iq4_nl"),
    "llamacpp_q8_0_norot": _llamacpp("q8_0", rotation=False),
    "llamacpp_q4_0_norot": _llamacpp("q4_0", rotation=False),
    "llamacpp_q4_1_norot": _llamacpp("q4_1", rotation=False),
    "llamacpp_q5_0_norot": _llamacpp("q5_0", rotation=False),
    "llamacpp_q5_1_norot": _llamacpp("q5_1", rotation=False),
    "llamacpp_iq4_nl_norot": _llamacpp("iq4_nl", rotation=False),
    # transformers 5.24 QuantizedCache(backend="quanto") with optimum-quanto 0.2.7, its defaults (axis 0 = groups
    # along head_dim, q_group_size 64, residual_length 128); MaxOptimizer scale and shift in the model's dtype
    "hf_quanto_int4": (
        {"spec": {"preset": "int4_g64", "scale_dtype": "model"}, "residual": 128, "residual_mode": "prompt_block"},
        "transformers 5.24 QuantizedCache(backend='quanto', nbits=4) with optimum-quanto 0.2.7: asymmetric g64 per token, scale and min in the model's dtype; the prompt quantized at the end of its call, then blocks of 128 counted from the prompt end (the flushing step reads them in full precision)",
    ),
    "hf_quanto_int2": (
        {"spec": {"preset": "int2_g64", "scale_dtype": "model"}, "residual": 128, "residual_mode": "prompt_block"},
        "transformers 5.24 QuantizedCache(backend='quanto', nbits=2) with optimum-quanto 0.2.7: asymmetric g64 per token, scale and min in the model's dtype; the prompt quantized at the end of its call, then blocks of 128 counted from the prompt end (the flushing step reads them in full precision)",
    ),
    # transformers 5.24 QuantizedCache(backend="hqq", axis_key=1, axis_value=1) with hqq 0.2.8.post1 (the axes
    # transformers' docs recommend for HQQ: groups of 64 along head_dim; its default axis 0 groups strided elements
    # of the whole flattened history, regrouped at every flush, which no per-token cache reproduces); q_group_size
    # 64, residual_length 128; hqq's solver in float32 (CPU), scale and zero in the model's dtype
    "hf_hqq_int4": (
        {"spec": {"preset": "hqq4_g64"}, "residual": 128, "residual_mode": "prompt_block"},
        "transformers 5.24 QuantizedCache(backend='hqq', nbits=4, axis_key=1, axis_value=1) with hqq 0.2.8.post1: g64 per token, zero point fitted by HQQ's half-quadratic solver, scale and zero in the model's dtype; the prompt quantized at the end of its call, then blocks of 128 counted from the prompt end (the flushing step reads them in full precision)",
    ),
    "hf_hqq_int2": (
        {"spec": {"preset": "hqq2_g64"}, "residual": 128, "residual_mode": "prompt_block"},
        "transformers 5.24 QuantizedCache(backend='hqq', nbits=2, axis_key=1, axis_value=1) with hqq 0.2.8.post1: g64 per token, zero point fitted by HQQ's half-quadratic solver, scale and zero in the model's dtype; the prompt quantized at the end of its call, then blocks of 128 counted from the prompt end (the flushing step reads them in full precision)",
    ),
    # KVQuant nuq{4,3,2}-1% as SqueezeAILab/KVQuant @57a2383 computes it (quant/llama_simquant.py --nuq
    # --include_sparse --sparsity-threshold 0.99; kveval/quant/formats/nuq.py, kveval/calibration/codebooks.py)
    **{f"kvquant{b}_1pct": kvquant_config(b) for b in (4, 3, 2)},
    # vLLM >= 0.20.1 --kv-cache-dtype turboquant_* (model_executor/layers/quantization/turboquant/config.py TQ_PRESETS;
    # engine/arg_utils.py skips the first and last 2 layers of a dense model; a first prompt chunk attends to its raw K/V)
    "vllm_turboquant_k8v4": (
        {"key": "fp8_e4m3", "value": "turboquant_v4", "prefill": "fp",
         "layers": {"first 2, last 2": {"spec": "none"}}},
        "vLLM 0.20.1+ --kv-cache-dtype turboquant_k8v4: keys FP8 E4M3 unscaled, values 4-bit uniform per token (fp16 scale + min); first and last 2 layers in the model's dtype",
    ),
    "vllm_turboquant_4bit_nc": (
        {"key": "turboquant_k4_nc", "value": "turboquant_v4", "prefill": "fp",
         "layers": {"first 2, last 2": {"spec": "none"}}},
        "vLLM 0.20.1+ --kv-cache-dtype turboquant_4bit_nc: keys Hadamard + 4-bit Lloyd-Max codebook + fp16 norm with norm correction, values 4-bit uniform per token; first and last 2 layers in the model's dtype",
    ),
    "vllm_turboquant_k3v4_nc": (
        {"key": "turboquant_k3_nc", "value": "turboquant_v4", "prefill": "fp",
         "layers": {"first 2, last 2": {"spec": "none"}}},
        "vLLM 0.20.1+ --kv-cache-dtype turboquant_k3v4_nc: keys Hadamard + 3-bit Lloyd-Max codebook + fp16 norm with norm correction, values 4-bit uniform per token; first and last 2 layers in the model's dtype",
    ),
    "vllm_turboquant_3bit_nc": (
        {"key": "turboquant_k3_nc", "value": "turboquant_v3", "prefill": "fp",
         "layers": {"first 2, last 2": {"spec": "none"}}},
        "vLLM 0.20.1+ --kv-cache-dtype turboquant_3bit_nc: keys Hadamard + 3-bit Lloyd-Max codebook + fp16 norm with norm correction, values 3-bit uniform per token; first and last 2 layers in the model's dtype",
    ),
    # FP4 microscaling and per-token-head caches of vLLM 0.33.0 and SGLang (docs/engines.md; the formats in
    # kveval/quant/formats/fp4.py and per_token_head.py name the source files they follow)
    "vllm_nvfp4": (
        {"spec": "nvfp4", "prefill": "quantized"},
        "vLLM 0.33.0 --kv-cache-dtype nvfp4 (SM100 trtllm-gen / FlashInfer): E2M1 with an E4M3 scale per 16 and k/v_scale 1.0 as fp32 per-tensor scale (no checkpoint scales; scales: auto calibrates amax/2688), prompt attends to the quantized cache",
    ),
    "vllm_nvfp4_4over6": (
        {"spec": "nvfp4_4over6", "prefill": "quantized"},
        "vLLM 0.33.0 --kv-cache-dtype nvfp4_4over6 (SM100): nvfp4 whose block scale is max/6 or max/4, the smaller squared error; k/v_scale 1.0, prompt attends to the quantized cache",
    ),
    "vllm_int8_per_token_head": (
        {"spec": "int8_per_token_head", "prefill": "quantized"},
        "vLLM 0.33.0 --kv-cache-dtype int8_per_token_head (Triton backend): symmetric INT8, fp32 scale max(amax/127, 1e-6) per token and KV head, round half away from zero; prompt attends to the quantized cache",
    ),
    "vllm_fp8_per_token_head": (
        {"spec": "fp8_per_token_head", "prefill": "quantized"},
        "vLLM 0.33.0 --kv-cache-dtype fp8_per_token_head (Triton backend): FP8 E4M3, fp32 scale max(amax/448, 1e-6) per token and KV head; prompt attends to the quantized cache",
    ),
    "vllm_int4_per_token_head": (
        {"spec": "int4_per_token_head", "prefill": "quantized"},
        "vLLM 0.33.0 --kv-cache-dtype int4_per_token_head (Triton backend): seeded randomized Hadamard rotation, asymmetric INT4 per token and KV head, fp32 scale holding the zero point in its low 4 bits; prompt attends to the quantized cache",
    ),
    "sglang_fp4_e2m1": (
        {"spec": "fp4_mx_block16", "prefill": "fp"},
        "SGLang --kv-cache-dtype fp4_e2m1 (0.5.x; fp4_mx_block16 in 0.5.23): E2M1 per 16 with a power-of-two scale 2^ceil(log2(amax/6)), ties up; a prompt attends to its own K/V in full precision (Triton extend), decode reads the FP4 cache",
    ),
}


# Issue #29: caches the anchors ship (docs/engines.md). transformers 5.24 QuantizedCache(backend="fp8")
# (Fp8QuantizedLayer: per-tensor E4M3 scale amax/448 taken from the first call, the prompt, which itself reads full
# precision; later tokens quantized with it at once); SGLang 0.5.23's nvfp4 (FlashInfer nvfp4_kv_quantize, the
# trtllm_mha backend on SM100: Q cast to E4M3 with q_scale 1.0, the prompt written to the cache before it is read)
# and mxfp8 (FA4); TensorRT-LLM's NVFP4 KV cache (its cvt_warp_fp16_to_fp4, as vLLM's nvfp4)
POLICY_PRESETS.update({
    "hf_fp8": (
        {"spec": "fp8_e4m3_tensor", "scales": "auto", "prefill": "fp"},
        "transformers 5.24 QuantizedCache(backend='fp8'): E4M3 with one fp32 scale amax/448 per layer and K/V (transformers takes it from the prompt; kveval calibrates it: scales: auto), the prompt reads full precision, every later token is quantized as it is stored",
    ),
    "sglang_nvfp4": (
        {"spec": "nvfp4_flashinfer", "prefill": "quantized", "transforms": [{"name": "query_fp8", "scale": 1.0}]},
        "SGLang 0.5.23 --kv-cache-dtype nvfp4 on SM100 (trtllm_mha, FlashInfer nvfp4_kv_quantize): E2M1, E4M3 scale per 16, fp32 global scale = the checkpoint's k/v_scale x6 (1.0 without), query cast to E4M3, prompt reads the quantized cache",
    ),
    "sglang_mxfp8": (
        {"spec": "mxfp8", "prefill": "quantized"},
        "SGLang 0.5.23 --kv-cache-dtype mxfp8 (FA4 backend): E4M3 per 32 with an E8M0 scale 2^ceil(log2(amax/448)); prompt reads the quantized cache (FA4 also rounds the query to MXFP8: not reproduced)",
    ),
    "trtllm_nvfp4": (
        {"spec": "nvfp4", "prefill": "quantized"},
        "TensorRT-LLM NVFP4 KV cache (ModelOpt kv_cache_quant_algo NVFP4, PyTorch backend): E2M1, E4M3 scale per 16, fp32 kv_scales = the checkpoint's k/v_scale (1.0 without); prompt reads the quantized cache (assumed)",
    ),
})


# vLLM's DeepSeek MLA latent caches (vllm-project/vllm: csrc/libtorch_stable/cache_kernels.cu @37cb21c
# concat_and_cache_ds_mla_kernel; csrc/libtorch_stable/nvfp4_ds_mla_cache_kernels.cu @03b6016; the layouts in
# vllm/v1/attention/backends/mla/flashmla_sparse.py). One 656- or 352-byte entry per token and layer: the key spec
# quantizes the latent c_kv (512), the value spec the RoPE part k_pe (64); the prompt reads the quantized cache
# (the sparse backend gathers and upconverts the cache for prefill and decode alike)
POLICY_PRESETS.update({
    "vllm_fp8_ds_mla": (
        {"key": "fp8_e4m3_g128", "value": "none", "prefill": "quantized", "designs": ["mla:512:64"]},
        "vLLM --kv-cache-dtype fp8_ds_mla (DeepSeek MLA, 656 B/token/layer): the 512-wide latent in 4 FP8 E4M3 tiles of 128 with an fp32 scale amax/448 each, the 64 RoPE values kept in bf16; prompt reads the quantized cache",
    ),
    "vllm_nvfp4_ds_mla": (
        {"key": "nvfp4_ds_mla", "value": "fp8_e4m3", "prefill": "quantized", "designs": ["mla:512:64"]},
        "vLLM --kv-cache-dtype nvfp4_ds_mla (DeepSeek MLA, SM100, 352 B/token/layer): the latent in E2M1 per 16 with an E4M3 scale max(amax/6, 2^-9) rounded up, the RoPE values cast to E4M3 unscaled; prompt reads the quantized cache",
    ),
})

#: the attention designs (kveval.memory.fit.DESIGNS) that the system a preset is named after supports, where it
#: does not support them all: a model with another design is refused in one line. llama.cpp caches an MLA latent
#: as one [c_kv ; k_pe] K row (its presets here model per-head K/V); transformers' QuantizedCache refuses every
#: layer type but full attention (cache_utils.py QuantizedCache.__init__); vLLM's FP8 FlashAttention-3 path, its
#: nvfp4 / per-token-head / TurboQuant caches, TensorRT-LLM's and SGLang's presets are for per-head K/V (vLLM has
#: separate MLA cache dtypes, above)
_PER_HEAD = ["gqa", "sliding", "chunked", "state", "sinks"]
_QUANTIZED_CACHE = ["gqa", "mla", "sinks"]
PRESET_DESIGNS: dict[str, list[str]] = {
    **{name: _PER_HEAD for name in POLICY_PRESETS if name.startswith("llamacpp_")},
    **{name: _QUANTIZED_CACHE for name in ("hf_quanto_int4", "hf_quanto_int2", "hf_hqq_int4", "hf_hqq_int2",
                                           "hf_fp8")},
    "vllm_fp8_fa3": ["gqa", "sliding", "chunked", "state"],  # kveval's FA3 arithmetic refuses sinks (s_aux)
    **{name: _PER_HEAD for name in ("vllm_nvfp4", "vllm_nvfp4_4over6", "vllm_int8_per_token_head",
                                    "vllm_fp8_per_token_head", "vllm_int4_per_token_head", "vllm_turboquant_k8v4",
                                    "vllm_turboquant_4bit_nc", "vllm_turboquant_k3v4_nc", "vllm_turboquant_3bit_nc",
                                    "trtllm_int8", "trtllm_nvfp4", "sglang_fp4_e2m1", "sglang_nvfp4",
                                    "sglang_mxfp8")},
}
for _name, _designs in PRESET_DESIGNS.items():
    if _name in POLICY_PRESETS and isinstance(POLICY_PRESETS[_name][0], dict):
        POLICY_PRESETS[_name][0].setdefault("designs", list(_designs))


def policy_names() -> list[str]:
    """Every name ``KVPolicy.preset`` accepts: policy presets, then QuantSpec presets."""
    return list(POLICY_PRESETS) + [n for n in preset_names() if n not in POLICY_PRESETS]


def policy_descriptions() -> dict[str, str]:
    """name -> one-line description of the policy presets."""
    return {name: desc for name, (_, desc) in POLICY_PRESETS.items()}
