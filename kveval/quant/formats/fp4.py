"""FP4 (E2M1) microscaling formats: OCP MXFP4, NVIDIA NVFP4 as vLLM's KV cache writes it (plain and "4 over 6"),
and SGLang's FP4 KV cache (block 16, power-of-two scales).

Element code E2M1 (4 bits: sign, 2 exponent bits with bias 1, 1 mantissa bit; no Inf/NaN): code c = s<<3 | m,
m = 0..7 -> magnitude [0, 0.5, 1, 1.5, 2, 3, 4, 6][m] (m = 1 is the subnormal 0.5), value (-1)^s * magnitude.
Codes are uint8 (0..15) in the package convention; two are packed per byte, the even element in the low nibble
(the layout of PTX ``cvt.rn.satfinite.e2m1x2.f32`` and of SGLang's and vLLM's packers).

Three roundings to E2M1 occur, each written out below and tested on every tie (tests/test_formats_fp4.py):
- ``e2m1_rne``: round to nearest, ties to the even code, magnitudes above 6 saturate to 6 (OCP MX, PTX
  ``cvt.rn.satfinite``): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, 7 -> 6.
- ``e2m1_half_up``: ties to the larger magnitude (SGLang counts the bounds 0.25 .. 5 that |y| reaches: ``>=``).
- the 4-over-6 error estimate of vLLM uses ties away from zero too (``round_to_nearest_e2m1``: ``|y| < bound``).
The sign bit is the sign bit of the scaled value for ``e2m1_rne`` (so -0.1 -> code 8, "-0", as the PTX convert
keeps the sign of a zero result) and ``y < 0`` for SGLang's (-0.0 -> code 0, -0.1 -> code 8).

Formats (`QuantSpec.format`; bits 4, mapping symmetric):

- ``mxfp4`` (OCP Microscaling Formats spec v1.0, sections 5.3 and 6.3): blocks of 32 elements of head_dim
  (granularity 'group', group_size 32), one E8M0 scale per block (scale_dtype 'e8m0', 1 byte: 2^(byte - 127),
  held as torch.float8_e8m0fnu). shared exponent E = floor(log2(amax)) - 2 (2 = the exponent of E2M1's largest
  power of two, 4), clamped to [-127, 127]; an all-zero block gets E = -127 (byte 0); codes = e2m1_rne(x / 2^E),
  so magnitudes in [6, 8) * 2^E saturate to 6 (the spec's rule). x^ = value(code) * 2^E. 17 bytes per 32 elements.
  Worked: block max 7 -> E = floor(log2 7) - 2 = 0 (byte 127); x = 7 -> 6 (saturated), 2.6 -> 3, 2.5 -> 2 (tie to
  even), -0.2 -> -0 (code 8).
- ``fp4_mx_block16`` (SGLang's FP4 KV cache: ``--kv-cache-dtype fp4_e2m1`` in 0.5.x, renamed ``fp4_mx_block16``
  by 0.5.23; ``KVFP4QuantizeUtil`` / ``FP4MXBlock16KVQuantizeUtil.batched_quantize`` in
  python/sglang/srt/layers/quantization/kvfp4_tensor.py, read in the sglang 0.5.23 wheel and in sgl-project/sglang
  at 0dae407): blocks of 16 (group_size 16), scale byte e + 127 with e = ceil(log2(max(amax / 6, 1e-10))), in
  the compute dtype (the function runs under torch.compile, whose kernels keep float32 intermediates for 16-bit
  inputs), codes = sign (y < 0) << 3 | #{b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5): |y| >= b} for y = x / 2^e:
  the scale never lets a magnitude exceed 6 and ties round up. x^ = value(code) * 2^e. 9 bytes per 16 elements.
  Worked: amax 3 -> amax/6 = 0.5 -> e = -1 -> y = 2x: x = 0.625 -> 1.25 -> 1.5 (tie up; RNE would give 1).
- ``nvfp4`` (vLLM ``--kv-cache-dtype nvfp4``: ``reshape_and_cache_nvfp4_kernel`` and ``cvt_warp_fp16_to_fp4``,
  vllm-project/vllm csrc/libtorch_stable/quantization/fp4/nvfp4_kv_cache_kernels.cu and nvfp4_utils.cuh, as
  shipped in vLLM 0.33.0; the layout ``nvfp4_kv_cache_full_dim`` in vllm/utils/torch_utils.py): two levels, an
  fp32 scale per tensor (the layer's k_scale / v_scale) and an E4M3 scale per 16 elements of head_dim. Per
  block, all in float32 with the global scale g = 1 / s_t:
      SF  = e4m3_satfinite_rne(g * (amax * rcp(6)));  out = rcp(float(SF) * rcp(g)) (0 when SF = 0)
      codes = e2m1_rne(x * out);  x^ = value(code) * float(SF) * s_t
  The per-tensor scale s_t is the QParams scale (granularity 'tensor', or 'head' for one per KV head;
  scale_dtype 'float32'): vLLM takes it from the checkpoint (k_scale / v_scale, compressed-tensors or ModelOpt
  ``kv_cache_scheme``) and uses 1.0 without one, which is ``static_scale: 1.0`` here; calibrated (scales file)
  it is s_t = clip_ratio * amax / (6 * 448), NVIDIA's NVFP4 recipe (the tensor's amax lands on the largest
  block scale), kveval's choice: vLLM reads whatever the checkpoint holds. A stored row is vLLM's: head_dim/2
  bytes of packed codes, then head_dim/16 E4M3 bytes (9 bytes per 16 elements); the fp32 s_t is counted once
  per layer and tensor (per head with granularity 'head'). In kveval's code tensor each element carries its
  block's E4M3 byte: code = e2m1 | SF << 4 (int16), which ``pack`` splits into vLLM's row and ``unpack`` rejoins.
- ``nvfp4_4over6`` (vLLM ``--kv-cache-dtype nvfp4_4over6``, PR #45187, in 0.33.0's CacheDType; the store kernel's
  ``cvt_warp_fp16_to_fp4_4over6`` in the same .cu file, SM100 only): as nvfp4, but each block computes the
  candidates d = 6 and d = 4 (SF_d = e4m3(g * (amax * rcp(d))), out_d as above), estimates the squared error of
  each, err_d = sum over the 8 element pairs in order of (dx0^2 + dx1^2) with dx = half_away(x * out_d) *
  rcp(out_d) - x (sum x^2 when out_d = 0), in float32, and keeps d = 4 only when err4 < err6 (ties keep 6); the
  codes are then e2m1_rne(x * out_d). The global scale, layout and read path are nvfp4's.

Where kveval assumes rather than reads (no GPU here): ``rcp.approx.ftz.f32`` is taken as the correctly rounded
reciprocal (PTX allows 1 ulp; it changes a code only when x * out lands within an ulp of a rounding boundary),
``1.0f / k_scale`` as IEEE division, and the 4-over-6 error sum without FMA contraction (nvcc may fuse dx*dx + ...,
which moves err4 and err6 by an ulp: only exact near-ties can flip). NVFP4 is computed in float32 whatever the
input dtype (vLLM reads bf16/fp16 K/V and converts to float32), MXFP4 and SGLang's format in the compute dtype
(float64 for float64 inputs, where powers of two keep every step exact). A head_dim that the block does not
divide is refused with one line (`QuantFormat.check_head_dim` / the group granularity).
"""

from __future__ import annotations

import torch

from ..packing import unpack
from .base import QParams, Spec, check_finite, count_reached, minmax, nonzero, store
from .segment import QuantFormat

#: magnitudes of the E2M1 codes 0..7 (codes 8..15: the same, negative)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: midpoints between consecutive E2M1 magnitudes
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
#: round to nearest even: a tie goes up when the lower neighbour's code is odd (0.75, 1.75, 3.5), down otherwise
_TIE_UP = (False, True, False, True, False, True, False)
E8M0_BIAS = 127


# ------------------------------------------------------------------------------------------------ element codes
def e2m1_values(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 code values [16] (code 8 is -0.0)."""
    mags = list(E2M1_MAGNITUDES)
    return torch.tensor(mags + [-m for m in mags], dtype=dtype, device=device)


def e2m1_rne(y: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, y's shape) of y rounded to nearest E2M1, ties to even, saturating at +-6; the sign bit is
    y's sign bit (-0.0 and -0.1 -> 8). Worked: [0.25, 0.75, 2.5, 5, 7, -3.4] -> [0, 2, 4, 6, 7, 13]."""
    return count_reached(y.abs(), _MIDPOINTS, _TIE_UP) | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_half_up(y: torch.Tensor) -> torch.Tensor:
    """SGLang's codes: magnitude index = how many of the midpoints 0.25 .. 5 |y| reaches (``>=``: ties round up,
    anything >= 5 is 6), sign bit for y < 0 (-0.0 -> 0). Worked: [0.25, 1.25, 5, -0.1, -0.0] -> [1, 3, 7, 8, 0]."""
    return count_reached(y.abs(), _MIDPOINTS) | ((y < 0).to(torch.uint8) << 3)


def e2m1_half_away_value(y: torch.Tensor) -> torch.Tensor:
    """vLLM's ``round_to_nearest_e2m1`` (the 4-over-6 error estimate): the E2M1 value nearest y, ties away from
    zero, |y| >= 5 -> 6, with y's sign (copysign): the magnitude whose index is the number of midpoints |y|
    reaches."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=y.dtype, device=y.device)
    return torch.copysign(mags[count_reached(y.abs(), _MIDPOINTS).long()], y)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values (dtype, codes' shape) of E2M1 codes 0..15 (low nibble of any integer code tensor)."""
    return e2m1_values(dtype, codes.device)[(codes & 0xF).long()]


def e4m3_rne(v: torch.Tensor) -> torch.Tensor:
    """v (>= 0 or any sign) to float8_e4m3fn, round to nearest even with saturation at +-448 (the CUDA
    ``__nv_fp8_e4m3(float)`` conversion, satfinite); subnormals down to 2^-9, below 2^-10 -> 0."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_to_float(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float values of E4M3 bytes (uint8 or any integer tensor holding 0..255)."""
    return b.to(torch.uint8).view(torch.float8_e4m3fn).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even, 0..15) -> bytes [..., n/2]: element 2i in the low nibble, 2i+1 in the high."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: bytes [..., n/2] -> uint8 codes [..., n]."""
    return unpack(packed, 4, packed.shape[-1] * 2)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


# ------------------------------------------------------------------------------------------------ base class
class _FP4Format(QuantFormat):
    """Shared checks and storage of the E2M1 formats: bits 4, symmetric, codes packed two per byte."""

    mappings = ("symmetric",)
    supports_static = False
    block: int = 32
    granularities: tuple[str, ...] = ("group",)
    scale_dtypes: tuple[str, ...] = ("e8m0",)

    def validate(self, spec: Spec) -> None:
        if spec.bits != 4:
            raise ValueError(f"QuantSpec.bits must be 4 for format {self.name!r} (E2M1 codes); got {spec.bits}")
        super().validate(spec)
        if spec.granularity not in self.granularities:
            allowed = " or ".join(map(repr, self.granularities))
            raise ValueError(f"format {self.name!r} needs granularity {allowed}; got {spec.granularity!r}")
        if spec.granularity == "group" and spec.group_size != self.block:
            raise ValueError(f"format {self.name!r} scales blocks of {self.block} elements of head_dim: group_size "
                             f"must be {self.block}; got {spec.group_size!r}")
        if spec.scale_dtype not in self.scale_dtypes:
            allowed = " or ".join(map(repr, self.scale_dtypes))
            raise ValueError(f"format {self.name!r} stores {self._scale_words} scales: scale_dtype must be {allowed}; "
                             f"got {spec.scale_dtype!r}")
        if spec.outliers:
            raise ValueError(f"format {self.name!r} takes no outliers")

    _scale_words = "E8M0"

    def check_head_dim(self, spec: Spec, head_dim: int) -> None:
        if head_dim % self.block:
            raise ValueError(f"format {self.name!r} quantizes blocks of {self.block} elements: head_dim {head_dim} "
                             f"is not a multiple of {self.block}")

    def code_bits(self, spec: Spec) -> int:
        return 4

    def bits_label(self, spec: Spec) -> str:
        return "FP4"

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.uint8

    def pack(self, codes: torch.Tensor, spec: Spec) -> torch.Tensor:
        return pack_nibbles(codes)

    def unpack(self, packed: torch.Tensor, spec: Spec, n: int) -> torch.Tensor:
        if packed.dtype != torch.uint8 or packed.shape[-1] != self.row_nbytes(spec, n):
            raise ValueError(f"expected uint8 [..., {self.row_nbytes(spec, n)}] for {n} {self.name} codes; got "
                             f"{packed.dtype} {tuple(packed.shape)}")
        return unpack_nibbles(packed)

    def row_nbytes(self, spec: Spec, head_dim: int) -> int:
        return head_dim // 2

    def param_nbytes(self, spec: Spec) -> int:
        return 1  # one E8M0 byte per block

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        raise ValueError(f"format {self.name!r} computes its block scales from each block; it takes no fixed "
                         "parameters")

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        raise ValueError(f"format {self.name!r} computes its block scales from each block; it takes no fixed "
                         "parameters")

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        """x^ = value(code) * scale (the block scale as a float: 2^E): exact products."""
        return e2m1_decode(codes, scale.dtype).mul_(scale)

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        codes, qp = self.fit(xv, dims, spec)
        return self.decode(codes, qp.scale.to(xv.dtype), None, spec)

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        return self.fit(xv, dims, spec)[1]

    def describe(self, spec: Spec) -> str:
        return f"{self.name} (E2M1, g{self.block}, {self._scale_words} scales)"


def _e8m0(byte: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (torch.float8_e8m0fnu, 2^(byte - 127)) from integer-valued bytes 0..254."""
    return byte.to(torch.uint8).view(torch.float8_e8m0fnu)


class MXFP4Format(_FP4Format):
    """OCP MXFP4: E2M1 in blocks of 32 with an E8M0 scale, E = floor(log2(amax)) - 2 (see the module docstring)."""

    name = "mxfp4"
    block = 32

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        """xv [..., 32] (group segment): codes [..., 32], E8M0 scales [..., 1]."""
        amax = xv.abs().amax(-1, keepdim=True)
        check_finite(amax)
        _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
        shared = torch.where(amax > 0, e - 1 - 2, -E8M0_BIAS).clamp_(-E8M0_BIAS, E8M0_BIAS)
        codes = e2m1_rne(torch.ldexp(xv, -shared))
        return codes, QParams(_e8m0(shared + E8M0_BIAS))


class FP4Block16Format(_FP4Format):
    """SGLang's FP4 KV cache: blocks of 16, power-of-two scale 2^ceil(log2(amax / 6)), ties up (module doc)."""

    name = "fp4_mx_block16"
    block = 16

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        """xv [..., 16]: codes [..., 16], E8M0 scales [..., 1] (byte = e + 127), as ``batched_quantize``."""
        amax = xv.abs().amax(-1, keepdim=True)
        check_finite(amax)
        e = torch.ceil(torch.log2(torch.clamp(amax / E2M1_MAX, min=1e-10)))
        codes = e2m1_half_up(xv / torch.exp2(e))
        return codes, QParams(_e8m0(e + E8M0_BIAS))

    def describe(self, spec: Spec) -> str:
        return f"{self.name} (E2M1, g16, power-of-two E8M0 scales, SGLang)"


# ------------------------------------------------------------------------------------------------ NVFP4
NVFP4_BLOCK = 16


def _rcp(v: torch.Tensor) -> torch.Tensor:
    """rcp.approx.ftz.f32, taken as the correctly rounded reciprocal (module docstring)."""
    return torch.reciprocal(v)


def nvfp4_candidate(amax: torch.Tensor, g: torch.Tensor, d: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's block scale for divisor d (6, or 4 for 4-over-6), float32: (E4M3 byte as uint8 [...], the encode
    multiplier out = rcp(float(SF) * rcp(g)), 0 where SF = 0)."""
    rcp_d = torch.tensor(1.0 / d, dtype=torch.float32)
    sf = e4m3_rne(g * (amax * rcp_d))
    sfv = sf.to(torch.float32)
    out = torch.where(sfv != 0, _rcp(sfv * _rcp(g)), torch.zeros_like(sfv))
    return sf.view(torch.uint8), out


def nvfp4_error(xb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The 4-over-6 squared error of blocks xb [..., 16] under multiplier out [..., 1] (float32, vLLM's order:
    e = 0; for each pair (x0, x1): e += dx0*dx0 + dx1*dx1, dx = half_away(x*out) * rcp(out) - x; out = 0: x^2)."""
    zero = out == 0
    deq = torch.where(zero, torch.zeros_like(out), _rcp(torch.where(zero, torch.ones_like(out), out)))
    q = e2m1_half_away_value(xb * out)
    dx = torch.where(zero, xb, q * deq - xb)
    err = torch.zeros(xb.shape[:-1], dtype=torch.float32, device=xb.device)
    for i in range(0, xb.shape[-1], 2):
        err = err + (dx[..., i] * dx[..., i] + dx[..., i + 1] * dx[..., i + 1])
    return err.unsqueeze(-1)


def nvfp4_encode(x: torch.Tensor, s_t: torch.Tensor, four_over_six: bool = False) -> torch.Tensor:
    """Codes (int16 [..., D], e2m1 | SF << 4) of rows x [..., D] (float32) under per-tensor scale s_t
    (float32, broadcastable to x[..., :1]), as vLLM's store kernel (module docstring)."""
    xb = _blocks(x, NVFP4_BLOCK)
    g = 1.0 / s_t.to(torch.float32).unsqueeze(-1)  # global_scale = 1.0f / k_scale
    amax = xb.abs().amax(-1, keepdim=True)
    sf, out = nvfp4_candidate(amax, g, 6.0)
    if four_over_six:
        sf4, out4 = nvfp4_candidate(amax, g, 4.0)
        use4 = nvfp4_error(xb, out4) < nvfp4_error(xb, out)
        sf, out = torch.where(use4, sf4, sf), torch.where(use4, out4, out)
    e2 = e2m1_rne(xb * out).to(torch.int16)
    codes = e2 | (sf.to(torch.int16) << 4)
    return codes.reshape(x.shape)


def nvfp4_decode(codes: torch.Tensor, s_t: torch.Tensor) -> torch.Tensor:
    """x^ [..., D] (float32) = value(code) * float(SF) * s_t from int16 codes (e2m1 | SF << 4)."""
    c = codes.to(torch.int16)
    v = e2m1_decode(c, torch.float32) * e4m3_to_float((c >> 4) & 0xFF, torch.float32)
    return v.mul_(s_t.to(torch.float32))


class NVFP4Format(_FP4Format):
    """vLLM's NVFP4 KV cache: E2M1, E4M3 scale per 16, fp32 scale per tensor (module docstring). Codes carry the
    block scale (int16: e2m1 | SF << 4); the QParams scale is the fp32 per-tensor (or per-head) scale."""

    name = "nvfp4"
    block = NVFP4_BLOCK
    supports_static = True
    granularities = ("tensor", "head")
    scale_dtypes = ("float32",)
    _scale_words = "fp32 per-tensor and E4M3 block"
    four_over_six = False

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # vLLM converts the bf16/fp16 K/V to float32

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.int16

    def row_nbytes(self, spec: Spec, head_dim: int) -> int:
        return head_dim // 2 + head_dim // NVFP4_BLOCK  # vLLM's nvfp4_kv_cache_full_dim

    def param_nbytes(self, spec: Spec) -> int:
        return 4  # the fp32 per-tensor (per-head) scale

    def pack(self, codes: torch.Tensor, spec: Spec) -> torch.Tensor:
        """int16 codes [..., D] -> vLLM's row [..., D/2 + D/16]: packed E2M1 nibbles, then one E4M3 byte per 16."""
        c = codes.to(torch.int16)
        sf = ((_blocks(c, NVFP4_BLOCK)[..., 0] >> 4) & 0xFF).to(torch.uint8)
        return torch.cat([pack_nibbles(c & 0xF), sf], dim=-1)

    def unpack(self, packed: torch.Tensor, spec: Spec, n: int) -> torch.Tensor:
        if packed.dtype != torch.uint8 or packed.shape[-1] != self.row_nbytes(spec, n):
            raise ValueError(f"expected uint8 [..., {self.row_nbytes(spec, n)}] for {n} {self.name} codes; got "
                             f"{packed.dtype} {tuple(packed.shape)}")
        e2 = unpack_nibbles(packed[..., : n // 2]).to(torch.int16)
        sf = packed[..., n // 2 :].to(torch.int16).repeat_interleave(NVFP4_BLOCK, dim=-1)
        return e2 | (sf << 4)

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        """s_t = static_scale (vLLM's k_scale; 1.0 without checkpoint scales), or clip_ratio * amax / (6 * 448)
        for a calibrated range, stored as float32."""
        if spec.static_scale is not None:
            return QParams(store(torch.full_like(mn, spec.static_scale), torch.float32))
        absmax = torch.maximum(-mn, mx) * spec.clip_ratio
        return QParams(store(absmax / (E2M1_MAX * E4M3_MAX), torch.float32))

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        mn, mx = minmax(xv, dims)
        check_finite(mn, mx)
        return self.range_qparams(mn, mx, spec)

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        qp = self.group_qparams(xv, dims, spec)
        return self.encode(xv, qp.scale.to(xv.dtype), None, spec), qp

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        """xv [..., D] (a tensor or head segment: whole rows), scale broadcastable [.., 1] (s_t): int16 codes."""
        return nvfp4_encode(xv.to(torch.float32), nonzero(scale), self.four_over_six)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return nvfp4_decode(codes, scale).to(scale.dtype)

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        codes, qp = self.fit(xv, dims, spec)
        return self.decode(codes, qp.scale.to(xv.dtype), None, spec)

    def describe(self, spec: Spec) -> str:
        s = f"static s_t {spec.static_scale:g}" if spec.static_scale is not None else "calibrated s_t"
        per = "per-head" if spec.granularity == "head" else "per-tensor"
        return f"{self.name} (E2M1, g16 E4M3 scales, {per} fp32 {s})"


class NVFP4FourOverSixFormat(NVFP4Format):
    """vLLM's ``nvfp4_4over6``: per block, max/6 or max/4 by the smaller squared error (module docstring)."""

    name = "nvfp4_4over6"
    four_over_six = True


FORMATS = (MXFP4Format(), FP4Block16Format(), NVFP4Format(), NVFP4FourOverSixFormat())
