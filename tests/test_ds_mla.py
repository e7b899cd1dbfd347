"""vLLM's DeepSeek MLA latent caches (presets vllm_fp8_ds_mla, vllm_nvfp4_ds_mla) against a reference written from
vLLM's kernels (tests/ds_mla_reference.py): every byte of each token's entry, the values read back, and the
presets on a tiny DeepSeek-V3 (emulation == real cache, bill == bytes held)."""

from __future__ import annotations

import pytest
import torch
from ds_mla_reference import (
    fp8_ds_mla_read,
    fp8_ds_mla_write,
    nvfp4_ds_mla_read,
    nvfp4_ds_mla_write,
    nvfp4_sf_byte,
)
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.models import build_tiny_model
from kveval.policy import KVPolicy
from kveval.quant import dequantize, preset, quantize


def _latents(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """c_kv [T, 512] and k_pe [T, 64], float32 holding bf16 values: random rows at several magnitudes plus crafted
    tiles (all zeros, tiny values at the 2^-9 scale floor, values large enough to saturate the largest scale,
    E2M1 ties at scale 1)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(6, 512, generator=g) * torch.tensor([1.0, 0.01, 30.0, 1e-4, 3.0, 1.0])[:, None]
    c[5, :16] = 0.0  # a zero block: the 2^-9 floor
    c[5, 16:32] = torch.tensor([6.0, 2.5, -0.25, 0.75, 5.0, -1.25, 1.75, 3.5, 0.1, 0, 0, 0, 0, 0, 0, 0])  # sf 1: ties
    c[5, 32:48] = 4000.0 * torch.linspace(-1, 1, 16)  # amax / 6 > 448: the largest E4M3 scale, values saturate
    c[5, 48:64] = 0.1 * torch.linspace(-1, 1, 16)  # amax / 6 = 0.01667 rounds down in E4M3: bumped up
    c[5, 128:256] = 0.0  # a zero FP8 tile (scale FLT_MIN in vLLM)
    pe = torch.randn(6, 64, generator=g) * 2.0
    pe[1] = 1000.0  # beyond E4M3's 448: saturates
    return c.to(torch.bfloat16).float(), pe.to(torch.bfloat16).float()


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_fp8_ds_mla_entry_bit_for_bit():
    c, pe = _latents()
    spec = preset("fp8_e4m3_g128")
    qt = quantize(c[None, None], spec)
    codes = spec.fmt.pack(qt.codes, spec)[0, 0]  # [T, 512] E4M3 bytes
    scales = qt.scale.reshape(c.shape[0], 4).to(torch.float32)
    read = dequantize(qt)[0, 0]
    for t in range(c.shape[0]):
        entry = fp8_ds_mla_write(c[t], pe[t])
        mine = _as_bytes(codes[t]) + _as_bytes(scales[t]) + _as_bytes(pe[t].to(torch.bfloat16))
        assert mine[:512] == entry[:512], f"token {t}: codes differ"
        assert mine[512:528] == entry[512:528] or t == 5, f"token {t}: scales differ"
        ref_c, ref_pe = fp8_ds_mla_read(entry)
        assert torch.equal(read[t], ref_c), f"token {t}: values read back differ"
        assert torch.equal(ref_pe.float(), pe[t])  # the RoPE part is kept as it is
    # the zero tile: vLLM stores FLT_MIN, kveval 0; both read back zeros
    assert float(scales[5, 1]) == 0.0 and struct_scale(fp8_ds_mla_write(c[5], pe[5]), 1) > 0
    assert torch.equal(read[5, 128:256], torch.zeros(128))


def struct_scale(entry: bytes, tile: int) -> float:
    import struct

    return struct.unpack("<f", entry[512 + 4 * tile:516 + 4 * tile])[0]


def test_nvfp4_ds_mla_entry_bit_for_bit():
    c, pe = _latents(1)
    spec, rope = preset("nvfp4_ds_mla"), preset("fp8_e4m3")
    qt = quantize(c[None, None], spec)
    nibbles = spec.fmt.pack(qt.codes, spec)[0, 0]  # [T, 256]
    sf = qt.scale.reshape(c.shape[0], 32).contiguous().view(torch.uint8)  # E4M3 bytes per block
    qr = quantize(pe[None, None], rope)
    rope_bytes = rope.fmt.pack(qr.codes, rope)[0, 0]
    read, read_pe = dequantize(qt)[0, 0], dequantize(qr)[0, 0]
    for t in range(c.shape[0]):
        region = bytearray(32)
        for s in range(32):
            region[nvfp4_sf_byte(s)] = int(sf[t, s])
        mine = _as_bytes(nibbles[t]) + _as_bytes(rope_bytes[t]) + bytes(region)
        entry = nvfp4_ds_mla_write(c[t], pe[t])
        assert len(entry) == len(mine) == 352
        assert mine == entry, f"token {t}: entry bytes differ at {[i for i in range(352) if mine[i] != entry[i]][:8]}"
        ref_c, ref_pe = nvfp4_ds_mla_read(entry)
        assert torch.equal(read[t], ref_c) and torch.equal(read_pe[t], ref_pe)
    # the crafted blocks did what they are there for
    assert int(sf[5, 0]) == 0x01  # zeros: the 2^-9 floor
    assert int(sf[5, 2]) == 0x7E  # the largest scale, 448
    assert float(sf[5, 3:4].view(torch.float8_e4m3fn).float()) == 0.017578125  # 0.0167 rounded up, not down
    assert read[5, 17].item() == 2.0 and read[5, 18].item() == -0.0 and read[5, 19].item() == 1.0  # ties to even


@pytest.fixture(scope="module")
def deepseek():
    return build_tiny_model("tiny-deepseek-v3", dtype="float64")


@pytest.mark.parametrize("name,entry", [("vllm_fp8_ds_mla", 656), ("vllm_nvfp4_ds_mla", 352)])
def test_presets_on_tiny_deepseek(deepseek, name, entry):
    policy = KVPolicy.preset(name)
    ids = ids_for(deepseek, 24)
    base_gap = (emulated_logits(deepseek, ids, KVPolicy.preset("fp16"))
                - decoded_logits(deepseek, ids, KVPolicy.preset("fp16"))[0]).abs().max()
    emu = emulated_logits(deepseek, ids, policy)
    dec, cache = decoded_logits(deepseek, ids, policy)
    with torch.no_grad():
        fp = deepseek(ids).logits
    effect = float((emu - fp).abs().max())
    assert float((emu - dec).abs().max()) <= 1e-10 + 10 * float(base_gap) < 1e-3 * effect
    arch = Arch.from_model(deepseek)
    n, layers = ids.shape[1], arch.layers
    assert cache.nbytes()["total"] == kv_bytes(arch, policy, n, fp_bytes=8).total
    # in a bf16 model, what vLLM allocates: one entry per token and layer (+ the RoPE cast's static scale 1.0,
    # which kveval counts as a 4-byte per-layer parameter)
    static = 4 * layers if name == "vllm_nvfp4_ds_mla" else 0
    assert kv_bytes(arch, policy, n).total == n * layers * entry + static


def test_presets_refuse_other_designs():
    llama = build_tiny_model("tiny-llama")
    with pytest.raises(KvevalError, match="supports an MLA latent cache only; this model has per-head K/V"):
        emulated_logits(llama, ids_for(llama, 4), KVPolicy.preset("vllm_fp8_ds_mla"))
    other = Arch.from_model_config({"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "hidden_size": 256, "kv_lora_rank": 256, "qk_rope_head_dim": 64,
                                    "qk_nope_head_dim": 64, "v_head_dim": 64})
    from kveval.memory import check_design

    with pytest.raises(KvevalError, match="kv_lora_rank 512 and qk_rope_head_dim 64.*256 \\+ 64"):
        check_design(other, KVPolicy.preset("vllm_nvfp4_ds_mla"))
