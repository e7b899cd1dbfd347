"""Policy presets: one table, name -> (config, one-line description). ``kveval ls`` lists them.

A preset's config is plain data in the form of a config's policy entry (``kv: {policies: {NAME: ...}}``), so a
preset is one entry here. Every QuantSpec preset (``kveval.quant.presets``) is also a policy name: the same spec for
keys and values.
"""

from __future__ import annotations

from kveval.quant import preset_names

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
    "kivi2": (
        {"key": "int2_channel", "value": "int2_g32", "residual": 128, "residual_mode": "block"},
        "KIVI 2-bit: keys per-channel, values per-token g32, 128-token full-precision residual (block mode)",
    ),
    "kivi4": (
        {"key": "int4_channel", "value": "int4_g32", "residual": 128, "residual_mode": "block"},
        "KIVI 4-bit: keys per-channel, values per-token g32, 128-token full-precision residual (block mode)",
    ),
    "fp8_e4m3": (
        {"spec": "fp8_e4m3"},
        "FP8 E4M3 with a static scale of 1.0 (a plain saturating cast)",
    ),
    "q8_0": (
        {"spec": "q8_0"},
        "llama.cpp -ctk q8_0 -ctv q8_0: blocks of 32, fp16 scale",
    ),
    "q4_0": (
        {"spec": "q4_0"},
        "llama.cpp -ctk q4_0 -ctv q4_0: blocks of 32, fp16 scale",
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
    "trtllm_int8": (
        {"spec": "int8_tensor", "scales": "auto"},
        "TensorRT-LLM INT8 KV cache: symmetric, one calibrated per-tensor scale per layer and K/V",
    ),
    "llamacpp_q8_0": (
        {"spec": "q8_0", "prefill": "quantized"},
        "llama.cpp -ctk q8_0 -ctv q8_0 (the prompt reads the quantized cache too)",
    ),
    "llamacpp_q4_0": (
        {"spec": "q4_0", "prefill": "quantized"},
        "llama.cpp -ctk q4_0 -ctv q4_0 (the prompt reads the quantized cache too)",
    ),
    "hf_quanto_int4": (
        {"spec": "int4_g64", "residual": 128, "residual_mode": "block"},
        "transformers QuantizedCache (quanto, nbits 4, group 64, residual_length 128): prompt attended in full precision, new tokens quantized in blocks of 128",
    ),
    "kvquant4_1pct": (
        {
            "key": {"preset": "int4_channel", "outliers": 0.01},
            "value": {"preset": "int4_token", "outliers": 0.01},
            "pre_rope": True,
            "scales": "auto",
        },
        "KVQuant-4bit-1%: pre-RoPE per-channel keys with calibrated scales, per-token values, 1% outliers of each vector kept exactly (uniform INT4 instead of KVQuant's non-uniform codes)",
    ),
}


def policy_names() -> list[str]:
    """Every name ``KVPolicy.preset`` accepts: policy presets, then QuantSpec presets."""
    return list(POLICY_PRESETS) + [n for n in preset_names() if n not in POLICY_PRESETS]


def policy_descriptions() -> dict[str, str]:
    """name -> one-line description of the policy presets."""
    return {name: desc for name, (_, desc) in POLICY_PRESETS.items()}
