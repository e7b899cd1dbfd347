"""The caches of issue #29 written from their engines' source, against references written here from that source:
SGLang 0.5.23's MXFP8 (``sglang/kernels/ops/kvcache/mxfp8_quant_store_kv.py``) and NVFP4 (FlashInfer @0c33fb6
``csrc/fp4_kv_quantization.cu``, ``quantize_fp16_to_e2m1_with_scaling``, which SGLang's ``NVFP4KVQuantizeUtil`` calls
with the global scale not inverted; its SM100 loader multiplies a checkpoint scale other than 1.0 by 6), plus the
presets sglang_mxfp8, sglang_nvfp4 and trtllm_nvfp4 end to end (float64 emulation equals the real cache)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.memory import Arch, kv_bytes
from kveval.policy import KVPolicy
from kveval.quant import QParams, dequantize, fake_quantize, packed_nbytes, preset, quantize

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ------------------------------------------------------------------------------------------------ references
def mxfp8_reference(block: list[float]) -> tuple[int, list[float]]:
    """SGLang's ``_mxfp8_quant_store_qkv_kernel`` on one block of 32 floats, in scalar Python: (scale byte, x^)."""
    amax = max(max(abs(v) for v in block), 1e-30)
    amax32 = float(np.float32(amax))
    s = min(max(math.ceil(math.log2(float(np.float32(amax32 / 448.0)))) + 127.0, 0.0), 254.0)
    descale = 2.0 ** (s - 127)
    q = torch.tensor([min(max(v / descale, -448.0), 448.0) for v in block]).to(torch.float8_e4m3fn).float()
    return int(s), (q * descale).tolist()


def e2m1_rne_scalar(y: float) -> float:
    """cvt.rn.satfinite.e2m1: nearest E2M1 magnitude, ties to the even code, saturating at 6, y's sign."""
    a = min(abs(y), 6.0)
    d = [abs(a - m) for m in E2M1]
    best = min(d)
    idx = [i for i, v in enumerate(d) if v == best]
    i = idx[0] if len(idx) == 1 else next(j for j in idx if j % 2 == 0)
    return math.copysign(E2M1[i], y)


def flashinfer_reference(block: np.ndarray, s_t: float) -> list[float]:
    """FlashInfer's ``quantize_fp16_to_e2m1_with_scaling`` on one block of 16 (float32 arithmetic in numpy,
    rcp = correctly rounded reciprocal), then the read ``value * SF * s_t``."""
    f = np.float32
    g = f(s_t)
    vec_max = f(np.abs(block).max())
    sf_value = (f(1) / g) * (vec_max * (f(1) / f(6)))
    sf = float(torch.tensor(min(float(sf_value), 448.0)).to(torch.float8_e4m3fn).float())
    out = (f(1) / (f(sf) * g)) if vec_max != 0 and sf != 0 else f(0)
    return [float(f(e2m1_rne_scalar(float(f(x) * out))) * f(sf) * g) for x in block]


# ------------------------------------------------------------------------------------------------ mxfp8
def test_mxfp8_crafted_blocks():
    spec = preset("mxfp8")
    x = torch.zeros(1, 1, 2, 32)
    x[0, 0, 0, :4] = torch.tensor([500.0, 3.3, -1.0, 0.001])  # max 500: log2(500/448) = 0.158 -> e = 1, scale 2
    qt = quantize(x, spec)
    # the zero block: amax floored at 1e-30, ceil(log2(1e-30 / 448)) = -108 -> byte 19
    assert qt.scale.view(torch.uint8).flatten().tolist() == [128, 19]
    back = dequantize(qt)[0, 0, 0, :4].tolist()
    assert back == [512.0, 3.25, -1.0, 0.0]  # 250 -> 256; 1.65 -> 1.625; 0.0005 below half of E4M3's 2^-9 -> 0
    assert bool((dequantize(qt)[0, 0, 1] == 0).all())
    assert packed_nbytes(spec, (1, 1, 2, 32))["total"] == 2 * 32 + 2  # one byte per code and per block


def test_mxfp8_exact_power_of_two_boundary():
    """amax = 448 * 2^k exactly: log2 is exact, ceil keeps k, the max lands on 448 (no saturation)."""
    x = torch.zeros(1, 1, 1, 32)
    x[..., 0] = 448.0 * 4
    qt = quantize(x, preset("mxfp8"))
    assert qt.scale.view(torch.uint8).item() == 129 and dequantize(qt)[..., 0].item() == 448.0 * 4


def test_mxfp8_matches_the_kernel_reference_on_random_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 64, generator=g) * torch.logspace(-3, 3, 5)[None, None, :, None]
    got = fake_quantize(x, preset("mxfp8"))
    for b, h, t, blk in [(0, 0, 0, 0), (1, 2, 4, 1), (0, 1, 2, 1), (1, 0, 3, 0)]:
        row = x[b, h, t, blk * 32:(blk + 1) * 32].tolist()
        _, want = mxfp8_reference(row)
        assert got[b, h, t, blk * 32:(blk + 1) * 32].tolist() == want


# ------------------------------------------------------------------------------------------------ nvfp4 (FlashInfer)
@pytest.mark.parametrize("s_t", [1.0, 0.0123, 3.0e-3, 0.7])
def test_flashinfer_nvfp4_matches_the_kernel_reference(s_t):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 6, 32, generator=g) * 4
    spec = preset("nvfp4_flashinfer")
    qt = quantize(x, spec, QParams(torch.tensor(s_t, dtype=torch.float32).reshape(1, 1, 1, 1)))
    got = dequantize(qt)
    xs = x.numpy().astype(np.float32)
    for h in range(2):
        for t in range(6):
            for blk in range(2):
                want = flashinfer_reference(xs[0, h, t, blk * 16:(blk + 1) * 16], s_t)
                assert got[0, h, t, blk * 16:(blk + 1) * 16].tolist() == pytest.approx(want, rel=0, abs=0)


def test_flashinfer_nvfp4_equals_vllm_nvfp4_at_unit_scale():
    """With s_t = 1.0 (no checkpoint scales) FlashInfer's and vLLM's encode multipliers are the same number."""
    x = torch.randn(2, 3, 7, 64, generator=torch.Generator().manual_seed(0)) * 10
    assert torch.equal(fake_quantize(x, preset("nvfp4_flashinfer")), fake_quantize(x, preset("nvfp4")))


def test_flashinfer_nvfp4_calibrated_scale_is_amax_over_448():
    from kveval.quant import qparams_from_range

    qp = qparams_from_range(torch.tensor(-10.0), torch.tensor(896.0), preset("nvfp4_flashinfer").replace(static_scale=None))
    assert qp.scale.item() == 2.0  # SGLang SM100's kernels expect amax / 448 (a checkpoint's amax / 2688, x6)


# ------------------------------------------------------------------------------------------------ presets
def test_the_presets_follow_their_engines():
    nv = KVPolicy.preset("sglang_nvfp4")
    assert nv.key.format == "nvfp4_flashinfer" and nv.prefill == "quantized"
    assert [t.name for t in nv.transforms] == ["query_fp8"] and nv.transforms[0].scale == 1.0  # q.to(e4m3)
    mx = KVPolicy.preset("sglang_mxfp8")
    assert mx.key.format == "mxfp8" and mx.key.group_size == 32 and not mx.transforms
    trt = KVPolicy.preset("trtllm_nvfp4")
    assert trt.key.format == "nvfp4" and trt.key.static_scale == 1.0  # kv_scales = ones(3) without a checkpoint


@pytest.mark.parametrize("name", ["sglang_mxfp8", "sglang_nvfp4", "trtllm_nvfp4"])
def test_emulation_equals_real_cache_float64(tiny_llama64, name):
    model, _ = tiny_llama64
    ids = ids_for(model, 14)
    policy = KVPolicy.preset(name)
    emulated = emulated_logits(model, ids, policy, prefill_len=5)
    decoded = decoded_logits(model, ids, policy, prefill_len=5)[0]
    with torch.no_grad():
        baseline = model(ids).logits
    assert (emulated - baseline).abs().max() > 1e-6
    torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)


def test_the_bill_of_the_new_caches():
    arch = Arch.named("smollm2-135m")
    mx = kv_bytes(arch, "sglang_mxfp8", 256)
    assert mx.codes == 2 * 30 * 3 * 256 * 64 and mx.scales == 2 * 30 * 3 * 256 * 2  # 64 codes + 2 E8M0 per row
    nv = kv_bytes(arch, "sglang_nvfp4", 256)
    assert nv.total == kv_bytes(arch, "vllm_nvfp4", 256).total  # the same layout as vLLM's
