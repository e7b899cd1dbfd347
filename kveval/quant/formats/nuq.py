"""Format 'nuq': KVQuant's non-uniform codes with dense-and-sparse outliers (Hooper et al., 2024).

Source read: SqueezeAILab/KVQuant @57a2383 (2024-07-09),
- ``quant/kvquant/simquant_module_quantizer.py``: ``get_outliers`` (static thresholds), ``get_outliers_dynamic``
  (per-token quantiles), ``quant_fn_nuq_recon`` (normalisation, codebook lookup, outliers), ``round_to_nearest_pole_sim``
  (nearest codebook entry), ``QuantLinearSim`` (thresholds cast to fp16, NormalFloat signposts for ``--nf``) and
  ``SimQuant.quantize`` (the calibration: ``kveval/calibration/codebooks.py``);
- ``quant/llama_simquant.py``: keys (``k_proj`` output, i.e. before RoPE) per channel with calibrated thresholds,
  values (``v_proj`` output) per token with thresholds computed at run time (``dynamicquantization=True``);
- ``deployment/transformers/src/transformers/models/llama/modeling_llama.py`` (``QuantK``, ``QuantV``): what the
  real cache stores: packed codes, a sorted float32 LUT per layer, and a fixed number of sparse entries per token,
  ``int((1 - sparsity_threshold) / 2 * hidden) + 1`` per side (the ``topk`` of ``forward_fused_sparse``).

Shapes: x [B, H, T, D]; a token's row is its whole K or V projection, y [n] with n = H * D, element h * D + d (KVQuant
quantizes the ``k_proj`` / ``v_proj`` output, all kv heads together). b = bits (2..5), c = the ascending codebook
[2^b] (float32), p = ``QuantSpec.outliers`` (KVQuant's ``1 - sparsity_threshold``; 0: no outliers), compute dtype
float32 (float64 for float64 inputs), bounds in ``scale_dtype``.

Granularity 'channel' (KVQuant's keys; needs calibration): per channel, bounds hi, lo [H, D] = the calibrated
  (100 - 50p)th / 50p-th percentiles of the channel (``np.percentile``, linear), stored in fp16 as KVQuant casts them;
  outliers are the elements with y > hi or y < lo (strict, ``get_outliers``).
Granularity 'token' (KVQuant's values): per token, over all n elements of the row: t = 1 - p / 2,
  hi_q = quantile(y, t), lo_q = quantile(y, 1 - t) (``torch.quantile``, linear); outliers y >= hi_q or y <= lo_q
  (``get_outliers_dynamic``); then every outlier is replaced by the row's median (``torch.median``: the lower one)
  and hi, lo = max, min of that row (``quant_fn_nuq_recon``), stored as one (hi, lo) pair per token [B, 1, T, 1].
  p = 0: hi, lo = max(y), min(y).
Then, both granularities (``quant_fn_nuq_recon``):
    o = (hi + lo) / 2, r = (hi - lo) / 2 (rounded to scale_dtype);  s = (y - o) / r   (r = 0 divides by 1)
    code = argmin_j |s - c[j]| (first index on ties, over the ascending codebook);  y^ = c[code] * r + o
    an outlier is kept: y^ = y (KVQuant's simulation computes (y - o) + o, its kernels LUT end + (y - LUT end))
Capacity (the deployment cache, ``QuantK.forward_fused_sparse``, ``QuantV``): at most
  k = floor(p / 2 * n) + 1 outliers per side and token are kept, the k with the largest s above (smallest below), ties
  to the lower index; an outlier over the capacity keeps its code (the codebook end: KVQuant's kernels store it too).
  Values select at most 1 + floor((n - 1) p / 2) per side, so the cap only acts on ties; keys, whose thresholds are
  static, can have more on a token (KVQuant's simulation keeps them all, its cache does not).

Stored, per layer and tensor: codes (b bits, packed along head_dim); bounds hi, lo (channel: [1, H, 1, D], static;
token: [B, 1, T, 1]) as scale / zero point; the calibrated codebook, float32 [2^b] (``QuantizedTensor.codebook``;
without a calibrated codebook, KVQuant's NormalFloat signposts of ``--nf`` (`nf_codebook`), a constant, not stored);
and per token 2k sparse slots [B, 1, T, 2k]: the kept value in x's dtype and its index into the row (uint8 for
n <= 256, int16 up to 32768, else int32). A token with fewer outliers repeats one of them in its empty slots (or,
with none, element 0 and its dense value), so decoding writes the slots back whatever their number: the bytes are
the same for every token, as in KVQuant's fixed-size cache (its slots are fp32 + int32, 8 bytes each).

Worked, b = 2, c = [-1, -1/3, 1/3, 1], token, p = 0, y = [0, 1, 2, 3] (H = 1, D = 4): hi = 3, lo = 0, o = 1.5,
r = 1.5, s = [-1, -1/3, 1/3, 1] -> codes [0, 1, 2, 3], y^ = y.

Differences from KVQuant's code: its simulation (the published perplexities) keeps every key outlier, its cache
and this format at most k per side (the kvquant*_1pct presets therefore keep the first token in full precision,
KVQuant's ``first_few_fp16``, here ``sink_tokens``: its keys exceed the bounds in many channels; docs/engines.md has
the measurements); the codebook's k-means (Fisher-weighted, ``SimQuant.quantize``) starts differently
(kveval/calibration/codebooks.py); Q-Norm (``--norm``) is not reproduced (its calibration calls
``round_to_nearest_pole_sim`` with an argument it does not take, at this commit).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from .base import (
    SCALE_TORCH_DTYPES,
    SHORT_DTYPE,
    QParams,
    Spec,
    TensorFormat,
    TensorParts,
    check_finite,
    minmax,
    nonzero,
    store,
)

#: the bit widths KVQuant's ``QuantLinearSim`` takes
NUQ_BITS = (2, 3, 4, 5)
CODEBOOK_DTYPE = torch.float32
GRANULARITIES = ("token", "channel")


def quantile_levels(p: float) -> tuple[float, float]:
    """(lower, upper) quantile levels of an outlier fraction p, as KVQuant forms them: t = 1 - (1 - (1 - p)) / 2,
    (1 - t, t). Worked: p = 0.01 -> (0.0050000000000000044, 0.995)."""
    t = 1 - ((1 - (1 - p)) / 2)
    return 1 - t, t


def outlier_capacity(p: float, n: int) -> int:
    """Outliers kept per side and token: floor(p / 2 * n) + 1 (0 for p = 0), KVQuant's
    ``int(((1 - sparsity_threshold) / 2) * hidden_size) + 1``. Worked: p = 0.01, n = 4096 -> 21; n = 192 -> 1."""
    if p <= 0:
        return 0
    return math.floor(p / 2 * n + 1e-9) + 1


def index_dtype(n: int) -> torch.dtype:
    """The dtype of a sparse entry's index into a row of n elements: uint8, int16 or int32."""
    return torch.uint8 if n <= 256 else torch.int16 if n <= 2**15 else torch.int32


@functools.lru_cache(maxsize=8)
def _nf_signposts(bits: int) -> tuple[float, ...]:
    dist = torch.distributions.Normal(torch.tensor([0.0]), torch.tensor([1.0]))

    def icdf(v: float) -> float:
        return float(dist.icdf(torch.tensor([v]))[0])  # float32, as QuantLinearSim

    half = 2 ** (bits - 1)
    edge = 0.5 * (1 / 32 + 1 / 30)
    lows = [edge]
    step = (0.5 - edge) / (half - 1)
    for _ in range(half - 1):
        lows.append(lows[-1] + step)
    highs = []
    step = (1 - edge - 0.5) / half
    v = 0.5
    for _ in range(half):
        highs.append(v)
        v += step
    highs.append(1 - edge)
    neg = [icdf(v) for v in lows]
    pos = [icdf(v) for v in highs]
    span, off = abs(neg[0]) - abs(neg[-1]), abs(neg[-1])
    neg = [(v + off) / span for v in neg]
    span, off = abs(pos[-1]) - abs(pos[0]), abs(pos[0])
    pos = [(v - off) / span for v in pos][1:]
    return tuple(neg + pos)


def nf_codebook(bits: int) -> torch.Tensor:
    """KVQuant's NormalFloat signposts (``QuantLinearSim`` with ``nf_nuq``): 2^(b-1) normal quantiles at probabilities
    from 0.5 (1/32 + 1/30) to 0.5 and 2^(b-1) + 1 from 0.5 to 1 - 0.5 (1/32 + 1/30), each half scaled onto [-1, 0]
    and [0, 1], the repeated 0 dropped; float32 [2^b], ascending, with -1, 0 and 1. The codebook of a 'nuq' spec
    without a calibrated one."""
    return torch.tensor(_nf_signposts(bits), dtype=CODEBOOK_DTYPE)


def quantile_sorted(srt: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(y, q, dim=-1, keepdim=True)`` (linear) from y sorted along its last dim, bit for bit: rank
    q * (n - 1) in y's dtype, lerp of the two neighbours (ATen's ``quantile``), without its size limit."""
    n = srt.shape[-1]
    rank = torch.tensor(q, dtype=srt.dtype) * (n - 1)
    below = int(rank.to(torch.long))
    above = int(rank.ceil().to(torch.long))
    return torch.lerp(srt[..., below:below + 1], srt[..., above:above + 1], rank - below)


def nearest_codes(s: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """argmin_j |s - c[j]| over the ascending codebook c (s's dtype), the lower index on ties, as uint8 codes of
    s's shape (``round_to_nearest_pole_sim``). Worked: c = [-1, 0, 1], s = [-0.5, 0.7, 3] -> [0, 2, 2]."""
    last = codebook.numel() - 1
    hi = torch.searchsorted(codebook, s.contiguous()).clamp_(max=last)
    lo = (hi - 1).clamp_(min=0)
    pick_hi = (s - codebook[hi]).abs() < (s - codebook[lo]).abs()
    return torch.where(pick_hi, hi, lo).to(torch.uint8)


def _cap(mask: torch.Tensor, key: torch.Tensor, k: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The at most k entries of ``mask`` per row with the largest (smallest) ``key``, ties to the lower index:
    (kept mask, the k candidate positions [..., k] in that order)."""
    fill = -math.inf if largest else math.inf
    order = torch.where(mask, key, fill).argsort(dim=-1, descending=largest, stable=True)[..., :k]
    kept = torch.zeros_like(mask).scatter_(-1, order, True) & mask
    return kept, order


def _centre(hi: torch.Tensor, lo: torch.Tensor, cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """o = (hi + lo) / 2 and r = (hi - lo) / 2 rounded to the bounds' dtype (KVQuant: fp16 arithmetic on its fp16 key
    thresholds, float32 on its value bounds), in the compute dtype."""
    sdt = hi.dtype
    h, low = hi.to(torch.float64), lo.to(torch.float64)
    return store((h + low) / 2, sdt).to(cdt), store((h - low) / 2, sdt).to(cdt)


class NuqFormat(TensorFormat):
    """KVQuant's non-uniform codes (module docstring). Codes uint8 [B, H, T, D]; scale / zero point: the bounds hi /
    lo; outliers: [B, 1, T, 2k] values and indices into the token's row; codebook: float32 [2^b] when calibrated."""

    name = "nuq"
    mappings = ("asymmetric",)
    supports_static = False

    def validate(self, spec: Spec) -> None:
        if spec.bits not in NUQ_BITS:
            raise ValueError(f"QuantSpec.bits must be one of {', '.join(map(str, NUQ_BITS))} for format 'nuq' "
                             f"(KVQuant's widths); got {spec.bits}")
        if spec.granularity not in GRANULARITIES:
            raise ValueError("format 'nuq' quantizes per token (over all kv heads) or per channel (calibrated); "
                             f"got granularity {spec.granularity!r}")
        if spec.granularity == "channel" and spec.group_size is not None:
            raise ValueError("format 'nuq' per channel takes calibrated bounds for every token; no group_size")
        if spec.zero_point != "float":
            raise ValueError(f"format 'nuq' keeps its lower bound as the zero point: zero_point must be 'float'; "
                             f"got {spec.zero_point!r}")
        if spec.clip_ratio != 1.0:
            raise ValueError(f"format 'nuq' takes no clip_ratio (its bounds are percentiles); got {spec.clip_ratio!r}")
        super().validate(spec)

    def takes_calibration(self, spec: Spec) -> bool:
        return True  # the codebook (and, per channel, the bounds) come from the scales file

    def code_bits(self, spec: Spec) -> int:
        return spec.bits

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.uint8

    def short_name(self, spec: Spec) -> str:
        return f"nuq{spec.bits}"

    def describe(self, spec: Spec) -> str:
        where = "per channel, calibrated bounds" if spec.granularity == "channel" else "per token over all kv heads"
        sparse = f", {100 * spec.outliers:g}% threshold outliers" if spec.outliers else ""
        return f"nuq{spec.bits} non-uniform codebook {where}{sparse} ({SHORT_DTYPE[spec.scale_dtype]} bounds)"

    def bits_per_element(self, spec: Spec, head_dim: int) -> float:
        """The codes only: the bounds are shared by all kv heads of a token (or calibrated), the outliers depend on
        the number of heads (`tensor_nbytes` counts both)."""
        return 8 * self.row_nbytes(spec, head_dim) / head_dim

    # ---- whole tensors ----------------------------------------------------------------------------------------
    def _codebook(self, spec: Spec, qparams: QParams | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the codebook to use, the stored one or None)."""
        cb = None if qparams is None else qparams.codebook
        if cb is None:
            return nf_codebook(spec.bits), None
        if cb.shape != (2**spec.bits,):
            raise ValueError(f"a nuq{spec.bits} codebook has {2**spec.bits} entries; got shape {tuple(cb.shape)}")
        return cb, cb

    def quantize_tensor(self, x: torch.Tensor, spec: Spec, qparams: QParams | None,
                        channel_block: int | None = None) -> TensorParts:
        B, H, T, D = x.shape
        n = H * D
        cdt = self.compute_dtype(x.dtype)
        sdt = SCALE_TORCH_DTYPES[spec.scale_dtype]
        book, stored_book = self._codebook(spec, qparams)
        channel = spec.granularity == "channel"
        if channel and (qparams is None or qparams.zero_point is None or qparams.scale.numel() != n):
            raise ValueError("format 'nuq' per channel needs calibrated bounds for every channel (a policy with "
                             "scales: auto, or a scales file from kveval calibrate)")
        k = outlier_capacity(spec.outliers, n)
        if x.numel() == 0:
            codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
            if channel:
                assert qparams is not None
                hi_s, lo_s = qparams.scale, qparams.zero_point
            else:
                hi_s = lo_s = torch.empty(B, 1, 0, 1, dtype=sdt, device=x.device)
            sparse = (torch.empty(B, 1, 0, 2 * k, dtype=x.dtype, device=x.device),
                      torch.empty(B, 1, 0, 2 * k, dtype=index_dtype(n), device=x.device)) if k else (None, None)
            return TensorParts(codes, hi_s, lo_s, channel, sparse[0], sparse[1], stored_book)
        xc = x.to(cdt)
        check_finite(*minmax(xc, None))
        y = xc.permute(0, 2, 1, 3).reshape(B, T, n)
        if channel:
            assert qparams is not None and qparams.zero_point is not None
            hi_s, lo_s = qparams.scale, qparams.zero_point
            o, r = (t.reshape(1, 1, n) for t in _centre(hi_s, lo_s, cdt))
            s = (y - o) / nonzero(r)
            if k:
                up = y > hi_s.to(device=y.device, dtype=cdt).reshape(1, 1, n)
                dn = y < lo_s.to(device=y.device, dtype=cdt).reshape(1, 1, n)
                up, up_at = _cap(up, s, k, largest=True)
                dn, dn_at = _cap(dn, s, k, largest=False)
        else:
            tmp = y
            if k:
                srt = y.sort(dim=-1).values
                q_lo, q_hi = quantile_levels(spec.outliers)
                up, up_at = _cap(y >= quantile_sorted(srt, q_hi), y, k, largest=True)
                dn, dn_at = _cap(y <= quantile_sorted(srt, q_lo), y, k, largest=False)
                median = srt[..., (n - 1) // 2:(n - 1) // 2 + 1]
                tmp = torch.where(up | dn, median, y)
            hi_s = store(tmp.amax(-1, keepdim=True), sdt).reshape(B, 1, T, 1)
            lo_s = store(tmp.amin(-1, keepdim=True), sdt).reshape(B, 1, T, 1)
            o, r = (t.reshape(B, T, 1) for t in _centre(hi_s, lo_s, cdt))
            s = (y - o) / nonzero(r)
        book_c = book.to(device=y.device, dtype=cdt)
        code_rows = nearest_codes(s, book_c)
        codes = code_rows.reshape(B, T, H, D).permute(0, 2, 1, 3).contiguous()
        values = index = None
        if k:
            dense = book_c[code_rows.long()] * r + o
            kept = torch.where(up | dn, y, dense)
            at = torch.cat([up_at, dn_at], dim=-1)
            valid = torch.cat([up.gather(-1, up_at), dn.gather(-1, dn_at)], dim=-1)
            first = at.gather(-1, valid.to(torch.uint8).argmax(-1, keepdim=True))
            fill = torch.where(valid.any(-1, keepdim=True), first, 0)
            at = torch.where(valid, at, fill)
            values = kept.gather(-1, at).to(x.dtype).reshape(B, 1, T, 2 * k)
            index = at.to(index_dtype(n)).reshape(B, 1, T, 2 * k)
        return TensorParts(codes, hi_s, lo_s, channel, values, index, stored_book)

    def dequantize_tensor(self, qt: Any) -> torch.Tensor:
        spec = qt.spec
        B, H, T, D = qt.shape
        n = H * D
        cdt = self.compute_dtype(qt.dtype)
        dev = qt.codes.device
        book = (qt.codebook if qt.codebook is not None else nf_codebook(spec.bits)).to(device=dev, dtype=cdt)
        o, r = _centre(qt.scale.to(dev), qt.zero_point.to(dev), cdt)
        shape = (1, 1, n) if spec.granularity == "channel" else (B, T, 1)
        rows = qt.codes.permute(0, 2, 1, 3).reshape(B, T, n).long()
        x = book[rows] * r.reshape(shape) + o.reshape(shape)
        if qt.outlier_values is not None:
            x.scatter_(-1, qt.outlier_index.reshape(B, T, -1).long(), qt.outlier_values.reshape(B, T, -1).to(cdt))
        return x.reshape(B, T, H, D).permute(0, 2, 1, 3).to(qt.dtype).contiguous()

    def tensor_nbytes(self, spec: Spec, shape: tuple[int, int, int, int], dtype: torch.dtype, static: bool,
                      channel_block: int | None = None) -> dict[str, int]:
        """codes B*H*T*ceil(D*b/8); bounds: 2 per channel and head (channel, static) or 2 per token (token) in
        scale_dtype, plus the float32 codebook [2^b] when calibrated (``static``); outliers B*T*2k slots of one
        value in ``dtype`` and one index. Worked: nuq4, token, p = 0.01, fp32 bounds, calibrated, fp16 values,
        [1, 3, 512, 64] (n = 192, k = 1): codes 1536*32 = 49152, bounds 512*8 + 64 = 4160, outliers 512*2*3 = 3072."""
        B, H, T, D = shape
        n = H * D
        codes = B * H * T * self.row_nbytes(spec, D)
        bound = torch.empty((), dtype=SCALE_TORCH_DTYPES[spec.scale_dtype]).element_size()
        scales = 2 * bound * (H * D if spec.granularity == "channel" else B * T)
        if static:
            scales += 2**spec.bits * torch.empty((), dtype=CODEBOOK_DTYPE).element_size()
        k = outlier_capacity(spec.outliers, n)
        slot = torch.empty((), dtype=dtype).element_size() + torch.empty((), dtype=index_dtype(n)).element_size()
        outliers = B * T * 2 * k * slot
        return {"codes": codes, "scales": scales, "outliers": outliers, "total": codes + scales + outliers}


FORMATS = (NuqFormat(),)
