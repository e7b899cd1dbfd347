"""A reference of vLLM's DeepSeek MLA latent cache entries, written from vLLM's kernels (not from kveval's code):
the writer and the reader of one token's entry, byte for byte.

- ``fp8_ds_mla`` (656 bytes): vllm-project/vllm @37cb21c ``csrc/libtorch_stable/cache_kernels.cu``,
  ``concat_and_cache_ds_mla_kernel``: bytes [0, 512) the latent c_kv as FP8 E4M3 in 4 tiles of 128, each
  ``scaled_convert(x, tile_scale)`` = e4m3_satfinite(clamp(x / s, +-448)) with ``s = fmaxf(amax / 448, FLT_MIN)``
  in float32; bytes [512, 528) the 4 float32 tile scales (``kv_lora_rank / 4 + tile_idx`` in 32-bit units);
  bytes [528, 656) the 64 RoPE values k_pe copied as bf16 (``kv_lora_rank / 2 + 8`` in 16-bit units). Read: the
  E4M3 value times its tile's scale.
- ``nvfp4_ds_mla`` (352 bytes): @03b6016 ``csrc/libtorch_stable/nvfp4_ds_mla_cache_kernels.cu``: bytes [0, 256)
  512 E2M1 codes, two per byte, the even element in the low nibble; [256, 320) the 64 RoPE values as plain E4M3
  (no scale); [320, 352) one E4M3 scale per 16 latent elements, block s at byte ``320 + 8 * (s & 3) + (s >> 2)``;
  ``sf = e4m3(max(amax / 6, 2^-9))`` bumped to the next E4M3 value when below ``amax / 6``, codes
  ``e2m1_rn(x * (1 / sf))``. Read: E2M1 value times sf.

Rounding is by table, independent of torch's casts: E4M3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits;
subnormals; 0x7E = 448 the largest finite) and E2M1 ({0, 0.5, 1, 1.5, 2, 3, 4, 6}) to nearest, ties to the even
code, saturating. Inputs are float32 tensors holding bf16 values (the kernels read bf16 and compute in float32).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

E4M3_VALUES = np.array([(2.0 ** (e - 7) * (1 + m / 8)) if e else 2.0 ** -6 * (m / 8)
                        for e in range(16) for m in range(8)][:127], dtype=np.float64)  # codes 0x00..0x7E
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def _nearest_even(table: np.ndarray, v: float) -> int:
    """The index of the table value nearest to ``v >= 0`` (ties: the even index), saturating at the last."""
    if v >= table[-1]:
        return len(table) - 1
    hi = int(np.searchsorted(table, v))  # table[hi - 1] < v <= table[hi]
    if table[hi] == v or hi == 0:
        return hi
    lo = hi - 1
    dl, dh = v - table[lo], table[hi] - v
    return lo if dl < dh or (dl == dh and lo % 2 == 0) else hi


def e4m3_byte(x: float) -> int:
    """E4M3 byte of float32 ``x``: round to nearest even, saturating at +-448 (``__nv_fp8_e4m3``, satfinite)."""
    code = _nearest_even(E4M3_VALUES, abs(x))
    return code | (0x80 if x < 0 or (x == 0 and np.signbit(x)) else 0)


def e4m3_value(byte: int) -> float:
    v = E4M3_VALUES[byte & 0x7F]
    return -v if byte & 0x80 else v


def e2m1_code(y: float) -> int:
    """E2M1 code of ``y`` (``cvt.rn.satfinite.e2m1x2.f32``): nearest, ties to the even code, +-6 saturating; the
    sign of y kept (-0.1 -> 8)."""
    code = _nearest_even(E2M1_VALUES, abs(y))
    return code | (8 if np.signbit(y) else 0)


def e2m1_value(code: int) -> float:
    v = E2M1_VALUES[code & 7]
    return -v if code & 8 else v


def _f32(x) -> np.float32:
    return np.float32(x)


def fp8_ds_mla_write(c_kv: torch.Tensor, k_pe: torch.Tensor) -> bytes:
    """The 656-byte entry of one token: c_kv ``[512]``, k_pe ``[64]`` (float32 holding bf16 values)."""
    c = c_kv.to(torch.float32).numpy()
    out = bytearray(656)
    for t in range(4):
        tile = c[128 * t:128 * (t + 1)]
        amax = _f32(np.max(np.abs(tile)))
        scale = max(_f32(amax / _f32(448.0)), _f32(np.finfo(np.float32).tiny))
        for i, x in enumerate(tile):
            v = _f32(_f32(x) / scale)
            v = min(max(v, _f32(-448.0)), _f32(448.0))
            out[128 * t + i] = e4m3_byte(float(v))
        out[512 + 4 * t:516 + 4 * t] = struct.pack("<f", scale)
    out[528:656] = k_pe.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    return bytes(out)


def fp8_ds_mla_read(entry: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_kv ``[512]`` float32, k_pe ``[64]`` bfloat16) read back from a 656-byte entry."""
    scales = struct.unpack("<4f", entry[512:528])
    c = np.array([_f32(_f32(e4m3_value(entry[i])) * _f32(scales[i // 128])) for i in range(512)], dtype=np.float32)
    pe = torch.from_numpy(np.frombuffer(entry[528:656], dtype="<i2").copy()).view(torch.bfloat16)
    return torch.from_numpy(c), pe


def nvfp4_sf_byte(s: int) -> int:
    """Where block s's scale sits in the scale region (vLLM's ``nvfp4_sf_byte``)."""
    return 8 * (s & 3) + (s >> 2)


def nvfp4_ds_mla_write(c_kv: torch.Tensor, k_pe: torch.Tensor) -> bytes:
    """The 352-byte entry of one token: c_kv ``[512]``, k_pe ``[64]`` (float32 holding bf16 values)."""
    c = c_kv.to(torch.float32).numpy()
    out = bytearray(352)
    for s in range(32):
        tile = c[16 * s:16 * (s + 1)]
        amax = _f32(np.max(np.abs(tile)))
        sf_f = max(_f32(amax / _f32(6.0)), _f32(2.0 ** -9))
        byte = e4m3_byte(float(sf_f))
        if _f32(e4m3_value(byte)) < sf_f and byte < 0x7E:
            byte += 1
        out[320 + nvfp4_sf_byte(s)] = byte
        inv = _f32(_f32(1.0) / _f32(e4m3_value(byte)))
        codes = [e2m1_code(float(_f32(_f32(x) * inv))) for x in tile]
        for i in range(0, 16, 2):
            out[8 * s + i // 2] = (codes[i] & 0xF) | ((codes[i + 1] & 0xF) << 4)
    for i, x in enumerate(k_pe.to(torch.float32).numpy()):
        out[256 + i] = e4m3_byte(float(x))
    return bytes(out)


def nvfp4_ds_mla_read(entry: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_kv ``[512]``, k_pe ``[64]``) float32 read back from a 352-byte entry."""
    c = np.empty(512, dtype=np.float32)
    for s in range(32):
        sf = e4m3_value(entry[320 + nvfp4_sf_byte(s)])
        for i in range(16):
            b = entry[8 * s + i // 2]
            code = b & 0xF if i % 2 == 0 else b >> 4
            c[16 * s + i] = e2m1_value(code) * sf
    pe = np.array([e4m3_value(b) for b in entry[256:320]], dtype=np.float32)
    return torch.from_numpy(c), torch.from_numpy(pe)
