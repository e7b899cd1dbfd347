"""Bit packing of integer codes along the last dimension (head_dim rows): `pack` / `unpack`.

Used by the formats' default `pack` / `unpack` (`kveval.quant.formats.base.QuantFormat`) for codes of 1..8 bits.
"""

from __future__ import annotations

import math
import sys

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


#: the integer dtype as wide as the codes of one byte written one per byte: 2, 4 or 8 codes per byte
_WORD = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _spread(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of uint8 ``packed`` [..., m] (1, 2 or 4 bits), one per byte: uint8 [..., m * 8 // bits].

    Each byte is widened to an integer of 8 // bits bytes in which the codes are spread apart by halves (code k
    moves from bit k*bits to bit 8k: the upper half of each group of G codes shifts by G/2 * (8 - bits), then a
    mask keeps both halves), so that the integer's bytes, in memory order on a little-endian machine, are the
    codes in `pack`'s order. Worked (4 bits): byte 0x21 -> int16 0x0021 | 0x0210 = 0x0231, & 0x0F0F = 0x0201:
    bytes [1, 2]. About 2x faster than stacking one tensor per code, whose interleaving copy dominates."""
    per = 8 // bits
    x = packed.reshape(-1).to(_WORD[per])  # flat: a view of its bytes needs a unit stride
    tmp = torch.empty_like(x)
    group = per
    while group > 1:
        half = group // 2
        keep = sum(((1 << half * bits) - 1) << (j * half * 8) for j in range(per // half))
        torch.bitwise_left_shift(x, half * (8 - bits), out=tmp)
        x.bitwise_or_(tmp).bitwise_and_(keep)
        group = half
    return x.view(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def unpack(packed: torch.Tensor, bits: int, n: int, *, signed: bool = False) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., ceil(n*bits/8)] -> codes [..., n], int8 if `signed` else uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8; got {bits}")
    nbytes = math.ceil(n * bits / 8)
    if packed.dtype != torch.uint8 or packed.shape[-1] != nbytes:
        raise ValueError(f"expected uint8 [..., {nbytes}] for {n} {bits}-bit codes; got {packed.dtype} {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    per = 8 // bits
    if bits == 8:  # u - 128 is u with its top bit flipped, read as int8 (two's complement)
        return packed.bitwise_xor(0x80).view(torch.int8) if signed else packed.clone()
    if 8 % bits == 0 and n % per == 0 and sys.byteorder == "little":  # 1, 2, 4 bits
        u = _spread(packed, bits)
    elif 8 % bits == 0 and n % per == 0:  # one pass per code of a byte
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
    return u.view(torch.int8).sub_(2 ** (bits - 1))  # in place on the new u: 0..2^bits-1 cannot wrap in int8
