"""Bit packing of integer codes along the last dimension (head_dim rows): `pack` / `unpack`.

Used by the formats' default `pack` / `unpack` (`kveval.quant.formats.base.QuantFormat`) for codes of 1..8 bits.
"""

from __future__ import annotations

import math

import torch


def pack(codes: torch.Tensor, bits: int, *, signed: bool | None = None) -> torch.Tensor:
    """Pack integer codes [..., n] into uint8 [..., ceil(n*bits/8)] along the last dimension.

    Layout: a little-endian bitstream per row: code i occupies stream bits [i*bits, (i+1)*bits), least
    significant bit first, and stream bit j is bit (j % 8) of byte j // 8; the last byte is zero-padded. So INT8
    is one code per byte, INT4 two per byte (low nibble first), INT2 four per byte (bits 0-1 first), and INT3
    packs 8 codes into 3 bytes: [c0 | c1<<3 | (c2&3)<<6], [c2>>2 | c3<<1 | c4<<4 | (c5&1)<<7], [c5>>1 | c6<<2 | c7<<5].
    `signed` (default: codes.dtype is int8) offsets codes by +2^(bits-1) first, e.g. INT4 -8..7 -> 0..15;
    pass the same `signed` to `unpack`. Codes outside the range raise ValueError.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8; got {bits}")
    if codes.is_floating_point():
        raise ValueError(f"pack expects integer codes; got {codes.dtype}")
    signed = codes.dtype == torch.int8 if signed is None else signed
    off = 2 ** (bits - 1) if signed else 0
    if codes.numel():
        lo, hi = torch.aminmax(codes)
        if int(lo) < -off or int(hi) > 2**bits - 1 - off:
            raise ValueError(f"codes in [{int(lo)}, {int(hi)}] do not fit {'signed' if signed else 'unsigned'} {bits}-bit")
    u = (codes.to(torch.int16) + off).to(torch.uint8) if off or codes.dtype != torch.uint8 else codes
    n = u.shape[-1]
    if bits == 8:
        return u.contiguous()
    per = 8 // bits
    if 8 % bits == 0 and n % per == 0:  # fast path: 1, 2, 4 bits
        g = u.reshape(*u.shape[:-1], n // per, per)
        out = g[..., 0].clone()
        for k in range(1, per):
            out |= g[..., k] << (k * bits)
        return out
    nbytes = math.ceil(n * bits / 8)
    stream = (u.unsqueeze(-1) >> torch.arange(bits, dtype=torch.uint8)) & 1  # [..., n, bits]
    stream = stream.reshape(*u.shape[:-1], n * bits)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - n * bits))
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)
    return (stream.reshape(*u.shape[:-1], nbytes, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int, *, signed: bool = False) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., ceil(n*bits/8)] -> codes [..., n], int8 if `signed` else uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8; got {bits}")
    nbytes = math.ceil(n * bits / 8)
    if packed.dtype != torch.uint8 or packed.shape[-1] != nbytes:
        raise ValueError(f"expected uint8 [..., {nbytes}] for {n} {bits}-bit codes; got {packed.dtype} {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    per = 8 // bits
    if bits == 8:
        u = packed.clone()
    elif 8 % bits == 0 and n % per == 0:  # one pass per code of a byte (about 2x faster than a broadcast shift)
        mask = 2**bits - 1
        parts = [packed & mask] + [(packed >> (k * bits)) & mask for k in range(1, per - 1)] + [packed >> (8 - bits)]
        u = torch.stack(parts, dim=-1).reshape(*lead, n)
    else:
        stream = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [..., nbytes, 8]
        stream = stream.reshape(*lead, nbytes * 8)[..., : n * bits].reshape(*lead, n, bits)
        weights = torch.tensor([1 << k for k in range(bits)], dtype=torch.uint8)
        u = (stream * weights).sum(-1, dtype=torch.uint8)
    if not signed:
        return u
    return (u.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)
