"""How each preset named after a system was checked: one table, preset name -> :class:`Check`.

Three kinds, in decreasing strength:

- ``system``: a test runs the real system here (llama.cpp through llama-cpp-python, transformers'
  ``QuantizedCache`` with optimum-quanto or hqq) on the same weights and token ids and holds kveval's preset to it;
- ``reference``: the system does not run here (CUDA kernels, a research repository), so a test holds the preset to
  a reference written from the system's source at the cited commit (in ``tests/``);
- ``documented``: the preset follows the system's documentation and flags; no test compares it with the system.

``depth`` says how far the check goes (model, layers, tokens, tolerance). ``kveval ls``, the report's verdict
table and docs/engines.md show the kind; the README's and docs/engines.md's wording follows this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CheckKind = Literal["system", "reference", "documented"]
CHECK_KINDS: tuple[CheckKind, ...] = ("system", "reference", "documented")


@dataclass(frozen=True)
class Check:
    """How one preset was checked: ``kind`` (module docstring), ``against`` (the system and its version, or the
    reference and the commit it follows), ``depth`` (model, layers, tokens, tolerance) and ``test`` (the test that
    runs the check; None for ``documented``)."""

    kind: CheckKind
    against: str
    depth: str
    test: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in CHECK_KINDS:
            raise ValueError(f"check kind must be one of {', '.join(CHECK_KINDS)}; got {self.kind!r}")
        if (self.test is None) != (self.kind == "documented"):
            raise ValueError("a system or reference check names its test; a documented one has none")

    def label(self) -> str:
        """``system: llama.cpp 0c1e570 ...``: the kind and what it was checked against."""
        return f"{self.kind}: {self.against}"


_LLAMACPP = Check(
    "system", "llama.cpp 0c1e570 through llama-cpp-python 0.3.36 (kveval's F32 GGUF of the same weights)",
    "builtin model cut to 2 layers, 256 ids, rotation on and off: KL(llama.cpp ‖ kveval) <= 10% of llama.cpp's own "
    "KLD; q4_0 also at all 30 layers, within 2x kveval's float-path floor",
    "tests/parity/test_llamacpp.py")
_HF_QUANTO = Check(
    "system", "transformers 5.24 QuantizedCache(backend='quanto') with optimum-quanto 0.2.7",
    "tiny float32 Llama, int4 and int2, prompts 1 and 5: logits within 1e-6; builtin model, int4, 160-200 ids, "
    "prompts 1 and 128: KL(transformers ‖ kveval) <= 10% of transformers' KLD",
    "tests/parity/test_hf_quanto.py")
_HF_HQQ = Check(
    "system", "transformers 5.24 QuantizedCache(backend='hqq', axis 1) with hqq 0.2.8.post1",
    "hqq's quantizer bit for bit on crafted tensors; tiny float32 Llama: logits within 1e-6 (emulation 5e-6); "
    "builtin model int4 (prompt 128, 160 ids) and int2 (prompt 4, 140 ids): ratio <= 0.1",
    "tests/parity/test_hf_hqq.py")
_KIVI = Check(
    "reference", "KIVI jy-yuan/KIVI @876b4d2 (tests/parity/kivi_reference.py, written from its source)",
    "tiny float32 Llama: logits and bytes as the reference (3e-7 against an effect of 1e-2); builtin model, 200 "
    "ids: KL(reference ‖ kveval) <= 10% of the reference's KLD",
    "tests/parity/test_kivi.py")
_TURBOQUANT = Check(
    "reference", "vLLM 0.20.1+ TurboQuant kernels (tests/turboquant_reference.py, written from vLLM's source)",
    "codes, norms, reconstructions and bytes bit for bit with the reference on the CPU; the bill equals vLLM's "
    "slot sizes; float64 emulation equals the real cache",
    "tests/test_turboquant.py")
_KVQUANT = Check(
    "reference", "KVQuant SqueezeAILab/KVQuant @57a2383 (tests/kvquant_reference.py, written from its source)",
    "codebooks, bounds, outlier slots and reconstructions as the reference on crafted and calibrated tensors; "
    "float64 emulation equals the real cache",
    "tests/test_kvquant.py")
_FP4 = "tests/test_formats_fp4.py"
_TOKEN_HEAD = "tests/test_formats_token_head.py"

PRESET_CHECKS: dict[str, Check] = {
    **{f"llamacpp_{t}{s}": _LLAMACPP for t in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
       for s in ("", "_norot")},
    "hf_quanto_int4": _HF_QUANTO,
    "hf_quanto_int2": _HF_QUANTO,
    "hf_hqq_int4": _HF_HQQ,
    "hf_hqq_int2": _HF_HQQ,
    "kivi2": _KIVI,
    "kivi4": _KIVI,
    **{f"kvquant{b}_1pct": _KVQUANT for b in (4, 3, 2)},
    **{f"vllm_turboquant_{t}": _TURBOQUANT for t in ("k8v4", "4bit_nc", "k3v4_nc", "3bit_nc")},
    "vllm_fp8_fa3": Check(
        "reference", "vLLM 5704f34 and vllm-flash-attn 617264c (tests/parity/vllm_fa3_reference.py, written from "
        "their source)",
        "tiny float64 Llama and Gemma3, 60 tokens, prompts 1 and 16: real cache and emulation within 1e-12 of the "
        "reference, where the FP8 cache without the query and P rounding is 1e-2 to 0.35 away",
        "tests/parity/test_vllm_fa3.py"),
    "vllm_nvfp4": Check(
        "reference", "vLLM 0.33.0 nvfp4 KV cache kernels (nvfp4_kv_cache_kernels.cu, nvfp4_utils.cuh)",
        "crafted blocks against the kernels' arithmetic written out by hand (E2M1 and E4M3 rounding, scales, "
        "packing); float64 emulation equals the real cache; bill = bytes", _FP4),
    "vllm_nvfp4_4over6": Check(
        "reference", "vLLM 0.33.0 nvfp4_4over6 (PR #45187)",
        "crafted blocks where max/4 and max/6 win, by hand from the kernel's error estimate; float64 emulation "
        "equals the real cache", _FP4),
    "sglang_fp4_e2m1": Check(
        "reference", "SGLang 0.5.x kvfp4_tensor.py (KVFP4QuantizeUtil / FP4MXBlock16KVQuantizeUtil)",
        "crafted blocks by hand from its source (power-of-two scale, ties up, 9 bytes per 16); float64 emulation "
        "equals the real cache", _FP4),
    **{f"vllm_{t}_per_token_head": Check(
        "reference", "vLLM 0.33.0 Triton per-token-head cache (triton_reshape_and_cache_flash.py, "
        "int4_per_token_head.py)",
        "crafted rows by hand from its kernels (rounding, scale floor, zero point in the scale's low bits, seeded "
        "Hadamard signs); float64 emulation equals the real cache", _TOKEN_HEAD) for t in ("int8", "fp8", "int4")},
    **{f"vllm_{t}_ds_mla": Check(
        "reference", f"vLLM {t}_ds_mla kernels (vllm-project/vllm csrc/libtorch_stable/cache_kernels.cu @37cb21c, "
        "nvfp4_ds_mla_cache_kernels.cu @03b6016; tests/ds_mla_reference.py, written from them)",
        "the reference's 656- / 352-byte entries written and read back bit for bit against kveval's codes on "
        "random and crafted latents; tiny DeepSeek-V3 (512 + 64 latent): float64 emulation equals the real cache, "
        "bill = entry bytes", "tests/test_ds_mla.py") for t in ("fp8", "nvfp4")},
    "vllm_fp8": Check(
        "documented", "vLLM --kv-cache-dtype fp8 (E4M3, k/v_scale 1.0 without checkpoint scales)",
        "FP8 E4M3 saturating cast with a unit scale; the cast itself is tested bit for bit, not vLLM"),
    "vllm_fp8_per_head": Check(
        "documented", "vLLM FP8 with per-head KV scales (as llm-compressor writes them)",
        "calibrated per-head E4M3 scales; no test runs vLLM or a reference of its loader"),
    "trtllm_int8": Check(
        "documented", "TensorRT-LLM kv_cache_dtype int8 with calibrated scaling factors",
        "INT8 per layer and K/V from calibration; TensorRT-LLM keeps one factor for K and V together"),
}


# Issue #29: transformers' fp8 cache, SGLang's nvfp4 and mxfp8, TensorRT-LLM's NVFP4 (kveval/parity/hf_fp8.py,
# kveval/quant/formats/mxfp8.py, nvfp4_flashinfer.py)
_ENGINES29 = "tests/test_formats_engines.py"
PRESET_CHECKS.update({
    "hf_fp8": Check(
        "system", "transformers 5.24 QuantizedCache(backend='fp8') (Fp8QuantizedLayer)",
        "kveval's scales from the same prompt; tiny float32 Llama, prompts 1 and 7: emulation within 5e-6 of "
        "transformers' logits, the real cache within 1e-6 (prompts of 2+ tokens); builtin model, 128-token prompt, "
        "160 ids, kveval's real cache: KL(transformers ‖ kveval) <= 10% of transformers' KLD (measured 0)",
        "tests/parity/test_hf_fp8.py"),
    "sglang_nvfp4": Check(
        "reference", "SGLang 0.5.23 NVFP4KVCacheMethod with FlashInfer @0c33fb6 nvfp4_kv_quantize "
        "(csrc/fp4_kv_quantization.cu)",
        "random blocks against the kernel's float32 arithmetic written out in numpy at four global scales; the SM100 "
        "loader's x6 on checkpoint scales; float64 emulation equals the real cache", _ENGINES29),
    "sglang_mxfp8": Check(
        "reference", "SGLang 0.5.23 mxfp8_quant_store_kv.py (_mxfp8_quant_store_qkv_kernel)",
        "crafted and random blocks against the Triton kernel in scalar Python (E8M0 byte, E4M3 rounding, the 1e-30 "
        "floor); float64 emulation equals the real cache", _ENGINES29),
    "trtllm_nvfp4": Check(
        "documented", "TensorRT-LLM NVFP4 KV cache (features/quantization.html; kv_scales loading read in "
        "tensorrt_llm/_torch/modules/linear.py)",
        "vLLM's nvfp4 arithmetic (TensorRT-LLM's cvt_warp_fp16_to_fp4, assumed for its attention kernels' KV write, "
        "not read); kv_scales = the checkpoint's k/v scales as loaded, 1.0 without; the prompt reading the "
        "quantized cache assumed"),
})


def check_of(name: str) -> Check | None:
    """The check of preset ``name`` (None: a generic preset, named after no system)."""
    return PRESET_CHECKS.get(name)


__all__ = ["CHECK_KINDS", "PRESET_CHECKS", "Check", "CheckKind", "check_of"]
