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
