"""Named QuantSpecs: `preset("int4_g64")`; `preset_names()` and `describe_presets()` feed `kveval ls`.

Adding a preset is one entry in PRESETS: name -> (QuantSpec, one-line description). A new format (a module in
`formats/`) needs one here too: tests/quant/test_format_plugin.py runs every registered format through one preset.
"""

from __future__ import annotations

import difflib

from .formats import GGML_BLOCK, GGML_TYPES
from .spec import QuantSpec


def _int(bits: int, mapping: str, granularity: str, group_size: int | None = None, **kw) -> QuantSpec:
    return QuantSpec(format="int", bits=bits, mapping=mapping, granularity=granularity, group_size=group_size, **kw)


def _ggml(name: str, bits_mapping: tuple[int, str] | None = None) -> QuantSpec:
    bits, mapping = bits_mapping or GGML_TYPES[name]
    return QuantSpec(format="int", bits=bits, mapping=mapping, granularity="group", group_size=GGML_BLOCK,
                     scale_dtype="float16", ggml=name)


PRESETS: dict[str, tuple[QuantSpec, str]] = {
    "none": (QuantSpec(format="none"), "full precision (baseline)"),
    "int8": (_int(8, "symmetric", "token"), "INT8 per-token symmetric, fp16 scales"),
    "int8_g64": (_int(8, "symmetric", "group", 64), "INT8 symmetric, groups of 64, fp16 scales"),
    "int8_tensor": (_int(8, "symmetric", "tensor", scale_dtype="float32"),
                    "INT8 symmetric per-tensor, fp32 scale; static: needs calibrated scales (TensorRT-LLM INT8 KV)"),
    "int4_token": (_int(4, "asymmetric", "token"), "INT4 asymmetric per-token, fp16 scale + min"),
    "int4_g32": (_int(4, "asymmetric", "group", 32), "INT4 asymmetric g32, fp16 scale + min (quanto/KIVI)"),
    "int4_g64": (_int(4, "asymmetric", "group", 64), "INT4 asymmetric g64, fp16 scale + min (quanto/KIVI)"),
    "int4_g128": (_int(4, "asymmetric", "group", 128), "INT4 asymmetric g128, fp16 scale + min (quanto/KIVI)"),
    "int4_g32_sym": (_int(4, "symmetric", "group", 32), "INT4 symmetric g32, fp16 scales"),
    "int4_g64_sym": (_int(4, "symmetric", "group", 64), "INT4 symmetric g64, fp16 scales"),
    "int4_g128_sym": (_int(4, "symmetric", "group", 128), "INT4 symmetric g128, fp16 scales"),
    "int4_channel": (_int(4, "asymmetric", "channel"), "INT4 asymmetric per-channel over token blocks (KIVI keys)"),
    "int3_g64": (_int(3, "asymmetric", "group", 64), "INT3 asymmetric g64, fp16 scale + min"),
    "int2_g32": (_int(2, "asymmetric", "group", 32), "INT2 asymmetric g32, fp16 scale + min (KIVI values)"),
    "int2_g64": (_int(2, "asymmetric", "group", 64), "INT2 asymmetric g64, fp16 scale + min"),
    "int2_channel": (_int(2, "asymmetric", "channel"), "INT2 asymmetric per-channel over token blocks (KIVI keys)"),
    "fp8_e4m3": (QuantSpec(format="fp8_e4m3", granularity="tensor", scale_dtype="float32", static_scale=1.0),
                 "FP8 E4M3 saturating cast, static scale 1.0 (vLLM without calibration)"),
    "fp8_e5m2": (QuantSpec(format="fp8_e5m2", granularity="tensor", scale_dtype="float32", static_scale=1.0),
                 "FP8 E5M2 saturating cast, static scale 1.0 (vLLM without calibration)"),
    "fp8_e4m3_head": (QuantSpec(format="fp8_e4m3", granularity="head", scale_dtype="float32"),
                      "FP8 E4M3, one static fp32 scale per KV head; needs calibrated scales (vLLM per-head)"),
    "fp8_e4m3_token": (QuantSpec(format="fp8_e4m3", granularity="token"),
                       "FP8 E4M3 per-token dynamic scale absmax/448, fp16 scales"),
    "q8_0": (_ggml("q8_0"), "ggml q8_0: INT8 blocks of 32, fp16 scale (llama.cpp --cache-type-k q8_0)"),
    "q4_0": (_ggml("q4_0"), "ggml q4_0: INT4 blocks of 32, fp16 scale"),
    "q4_1": (_ggml("q4_1"), "ggml q4_1: INT4 blocks of 32, fp16 scale + min"),
    "q5_0": (_ggml("q5_0"), "ggml q5_0: INT5 blocks of 32, fp16 scale"),
    "q5_1": (_ggml("q5_1"), "ggml q5_1: INT5 blocks of 32, fp16 scale + min"),
    "q8_0_x86": (_ggml("q8_0_x86", (8, "symmetric")),
                 "ggml q8_0 as llama.cpp's CPU cache writes it on x86: x*127/amax rounded half to even"),
    "iq4_nl": (_ggml("iq4_nl", (4, "symmetric")),
               "ggml iq4_nl: 4-bit non-linear codebook, blocks of 32, fp16 scale (llama.cpp's cache write)"),
    # TurboQuant as vLLM >= 0.20.1 stores it (kveval/quant/formats/turboquant.py): keys rotated by a Hadamard matrix,
    # Lloyd-Max codebook per coordinate, fp16 norm per vector; values uniform per token, fp16 scale + min
    "turboquant_k4_nc": (QuantSpec(format="turboquant_nc", bits=4),
                         "TurboQuant keys (vLLM 0.20.1+ turboquant_4bit_nc): Hadamard, 4-bit Lloyd-Max codebook, fp16 norm, norm correction"),
    "turboquant_k3_nc": (QuantSpec(format="turboquant_nc", bits=3),
                         "TurboQuant keys (vLLM 0.20.1+ turboquant_k3v4_nc, 3bit_nc): Hadamard, 3-bit Lloyd-Max codebook, fp16 norm, norm correction"),
    "turboquant_k4": (QuantSpec(format="turboquant", bits=4),
                      "TurboQuant keys without norm correction (vLLM 0.20.1+ norm_correction=False; no vLLM dtype): Hadamard, 4-bit Lloyd-Max codebook, fp16 norm"),
    "turboquant_v4": (QuantSpec(format="turboquant_uniform", bits=4, mapping="asymmetric"),
                      "TurboQuant values (vLLM 0.20.1+): 4-bit uniform per token from the fp32 min and scale, fp16 scale + min"),
    "turboquant_v3": (QuantSpec(format="turboquant_uniform", bits=3, mapping="asymmetric"),
                      "TurboQuant values (vLLM 0.20.1+): 3-bit uniform per token from the fp32 min and scale, fp16 scale + min"),
    # FP4 microscaling (kveval/quant/formats/fp4.py) and vLLM's per-token-head dtypes (formats/per_token_head.py)
    "mxfp4": (QuantSpec(format="mxfp4", bits=4, granularity="group", group_size=32, scale_dtype="e8m0"),
              "OCP MXFP4: E2M1, one E8M0 scale per 32 (2^(floor(log2 amax) - 2)), round to nearest even, saturating"),
    "nvfp4": (QuantSpec(format="nvfp4", bits=4, granularity="tensor", scale_dtype="float32", static_scale=1.0),
              "NVFP4 as vLLM 0.33.0 stores it: E2M1, E4M3 scale per 16, fp32 per-tensor scale 1.0 (no checkpoint scales)"),
    "nvfp4_tensor": (QuantSpec(format="nvfp4", bits=4, granularity="tensor", scale_dtype="float32"),
                     "NVFP4 with a calibrated fp32 per-tensor scale amax / (6 * 448); static: needs calibrated scales"),
    "nvfp4_4over6": (QuantSpec(format="nvfp4_4over6", bits=4, granularity="tensor", scale_dtype="float32",
                               static_scale=1.0),
                     "NVFP4 4-over-6 as vLLM 0.33.0 stores it: per 16, scale from max/6 or max/4, whichever errs less"),
    "fp4_mx_block16": (QuantSpec(format="fp4_mx_block16", bits=4, granularity="group", group_size=16,
                                 scale_dtype="e8m0"),
                       "SGLang FP4 (fp4_e2m1 / fp4_mx_block16): E2M1 per 16, scale 2^ceil(log2(amax/6)), ties up"),
    # vLLM's DeepSeek MLA latent caches (kveval/quant/formats/nvfp4_ds_mla.py; policies vllm_*_ds_mla)
    "fp8_e4m3_g128": (QuantSpec(format="fp8_e4m3", bits=8, granularity="group", group_size=128, scale_dtype="float32"),
                      "FP8 E4M3 per 128 with an fp32 scale amax/448 (vLLM fp8_ds_mla's latent tiles)"),
    "nvfp4_ds_mla": (QuantSpec(format="nvfp4_ds_mla", bits=4, granularity="group", group_size=16, scale_dtype="e4m3"),
                     "vLLM nvfp4_ds_mla latent: E2M1 per 16, E4M3 scale max(amax/6, 2^-9) rounded up, no global scale"),
    "int8_per_token_head": (QuantSpec(format="int8_per_token_head", bits=8, scale_dtype="float32"),
                            "vLLM 0.33.0 int8_per_token_head: symmetric, fp32 scale max(amax/127, 1e-6), round half away"),
    "fp8_per_token_head": (QuantSpec(format="fp8_per_token_head", bits=8, scale_dtype="float32"),
                           "vLLM 0.33.0 fp8_per_token_head: E4M3, fp32 scale max(amax/448, 1e-6) per token and head"),
    "int4_per_token_head": (QuantSpec(format="int4_per_token_head", bits=4, mapping="asymmetric", zero_point="int",
                                      scale_dtype="float32"),
                            "vLLM 0.33.0 int4_per_token_head: Hadamard-rotated, asymmetric 4-bit per token and head, "
                            "fp32 scale with the zero point in its low bits"),
}


def preset_names() -> list[str]:
    """All preset names, in registry order."""
    return list(PRESETS)


def describe_presets() -> dict[str, str]:
    """name -> one-line description (for `kveval ls`)."""
    return {name: desc for name, (_, desc) in PRESETS.items()}


def preset(name: str) -> QuantSpec:
    """The QuantSpec registered as `name`; unknown names raise ValueError with the closest match."""
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown quantization preset {name!r}{hint} (kveval ls lists them)")
    return PRESETS[name][0]


# HQQ (kveval/quant/formats/hqq.py): hqq 0.2.8.post1's quantizer, asymmetric codes per group of head_dim with the
# zero point fitted by its half-quadratic solver, scale and zero in the model's dtype (as transformers'
# QuantizedCache(backend="hqq") keeps them). hqq4_g32 comes first: the format contract tests take a format's first
# preset on a model whose head_dim is 32.
PRESETS.update({
    "hqq4_g32": (QuantSpec(format="hqq", bits=4, mapping="asymmetric", granularity="group", group_size=32,
                           scale_dtype="model"),
                 "HQQ 4-bit g32 (hqq 0.2.8.post1, optimize=True): zero point fitted by the half-quadratic solver, "
                 "scale and zero in the model's dtype"),
    "hqq4_g64": (QuantSpec(format="hqq", bits=4, mapping="asymmetric", granularity="group", group_size=64,
                           scale_dtype="model"),
                 "HQQ 4-bit g64 (hqq 0.2.8.post1, optimize=True): zero point fitted by the half-quadratic solver, "
                 "scale and zero in the model's dtype"),
    "hqq2_g64": (QuantSpec(format="hqq", bits=2, mapping="asymmetric", granularity="group", group_size=64,
                           scale_dtype="model"),
                 "HQQ 2-bit g64 (hqq 0.2.8.post1, optimize=True): zero point fitted by the half-quadratic solver, "
                 "scale and zero in the model's dtype"),
})


# KVQuant's non-uniform codes (kveval/quant/formats/nuq.py; SqueezeAILab/KVQuant @57a2383): per token over all kv
# heads, fp32 bounds; the codebook is fitted by k-means on the calibration slice (a policy with scales: auto), else
# KVQuant's NormalFloat signposts. KVQuant's key recipe (per channel, calibrated bounds, 1% outliers) is in the
# kvquant*_1pct policy presets (kveval/policy/presets.py).
PRESETS.update({
    f"nuq{b}": (QuantSpec(format="nuq", bits=b, mapping="asymmetric", scale_dtype="float32"),
                f"KVQuant nuq{b}: {b}-bit non-uniform codebook (k-means when calibrated, else NormalFloat), "
                "per token over all kv heads, fp32 max/min")
    for b in (4, 3, 2)
})


# Issue #29: the FP8 per-tensor scale a checkpoint (or a calibration) supplies, transformers' QuantizedCache(backend=
# "fp8") and the FP4/FP8 caches of SGLang (kveval/quant/formats/mxfp8.py, nvfp4_flashinfer.py)
PRESETS.update({
    "fp8_e4m3_tensor": (QuantSpec(format="fp8_e4m3", granularity="tensor", scale_dtype="float32"),
                        "FP8 E4M3, one static fp32 scale per tensor (layer and K/V); needs static scales (a "
                        "checkpoint's k/v_scale, kveval calibrate)"),
    "mxfp8": (QuantSpec(format="mxfp8", bits=8, granularity="group", group_size=32, scale_dtype="e8m0"),
              "MXFP8 as SGLang 0.5.23 stores it: E4M3 per 32 with an E8M0 scale 2^ceil(log2(amax/448))"),
    "nvfp4_flashinfer": (QuantSpec(format="nvfp4_flashinfer", bits=4, granularity="tensor", scale_dtype="float32",
                                   static_scale=1.0),
                         "NVFP4 as FlashInfer's nvfp4_kv_quantize writes it (SGLang SM100): E2M1, E4M3 scale per 16, "
                         "fp32 global scale 1.0 (no checkpoint scales)"),
})
