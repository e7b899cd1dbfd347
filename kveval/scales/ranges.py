"""Static (calibrated) ranges of K or V from calibration samples: absmax, percentile clipping, MSE-optimal clipping.

Samples of one layer's keys or values are ``x [N, H, D]`` (N calibration tokens, H kv heads, head_dim D). A range is
computed per statistics group of a static granularity: ``tensor`` (one, shape ``[]``), ``head`` (``[H]``) or
``channel`` (``[H, D]``), as three numbers per group: ``absmax`` (for symmetric specs), ``lo`` and ``hi`` (for
asymmetric specs). ``kveval.quant.qparams_from_range`` turns a range into the stored scale (and zero point).

Methods:
- ``absmax``: the observed extremes (max |x|, min x, max x).
- ``percentile`` p (e.g. 99.9): nearest-rank percentiles, k = ceil(p/100 * n) of n values per group: ``absmax`` is
  the k-th smallest |x|, ``hi`` the k-th smallest x, ``lo`` the (n + 1 - k)-th smallest x. p = 100 is ``absmax``.
  Worked: |x| = 1, 2, ..., 1000 and p = 99.9 -> k = 999 -> absmax 999 (the single largest value is clipped).
- ``mse``: per group, the clipping ratio r in ``MSE_RATIOS`` (1.0 down to 0.5) whose fake-quantization under a
  target spec (format, bits, mapping, scale dtype) has the smallest squared error on the samples; symmetric:
  absmax * r; asymmetric: the range shrunk by r about its centre. Depends on the target: a file calibrated by mse for
  int8 is for int8.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kveval.quant.primitives import fake_quantize, qparams_from_range
from kveval.quant.spec import QuantSpec

METHODS = ("absmax", "percentile", "mse")
STATIC_GRANULARITIES = ("tensor", "head", "channel")
MSE_RATIOS = tuple(round(1.0 - 0.025 * i, 4) for i in range(21))  # 1.0, 0.975, ..., 0.5


@dataclass
class Ranges:
    """Per-group ranges: shape ``[]`` (tensor), ``[H]`` (head) or ``[H, D]`` (channel), float32."""

    absmax: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


def group_values(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """x ``[N, H, D]`` -> ``[*group_shape, n]``: tensor ``[N*H*D]``, head ``[H, N*D]``, channel ``[H, D, N]``."""
    if x.dim() != 3:
        raise ValueError(f"calibration samples must be [tokens, kv_heads, head_dim]; got shape {tuple(x.shape)}")
    N, H, D = x.shape
    if granularity == "tensor":
        return x.reshape(-1)
    if granularity == "head":
        return x.permute(1, 0, 2).reshape(H, N * D)
    if granularity == "channel":
        return x.permute(1, 2, 0)
    raise ValueError(f"static ranges exist for {', '.join(STATIC_GRANULARITIES)}; got {granularity!r}")


def _kth(v: torch.Tensor, k: int) -> torch.Tensor:
    return v.kthvalue(k, dim=-1).values


def percentile_ranges(x: torch.Tensor, granularity: str, percentile: float = 100.0) -> Ranges:
    """Nearest-rank percentile ranges (``percentile=100``: the extremes, i.e. the absmax method)."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100]; got {percentile}")
    v = group_values(x.float(), granularity)
    n = v.shape[-1]
    if n == 0:
        raise ValueError("no calibration samples")
    if percentile == 100:
        return Ranges(v.abs().amax(-1), v.amin(-1), v.amax(-1))
    k = min(max(math.ceil(percentile / 100 * n - 1e-9), 1), n)
    return Ranges(_kth(v.abs(), k), _kth(v, n + 1 - k), _kth(v, k))


def _static_spec(target: QuantSpec, granularity: str, mapping: str) -> QuantSpec:
    return dataclasses.replace(target, granularity=granularity, group_size=None, static_scale=None, outliers=0.0,
                               mapping=mapping, clip_ratio=1.0)


def _sq_error(x4: torch.Tensor, spec: QuantSpec, lo: torch.Tensor, hi: torch.Tensor, granularity: str) -> torch.Tensor:
    """Summed squared error per group of fake-quantizing x4 ``[1, H, N, D]`` with the range [lo, hi]."""
    err = (fake_quantize(x4, spec, qparams=qparams_from_range(lo, hi, spec)) - x4).pow_(2)[0]  # [H, N, D]
    if granularity == "tensor":
        return err.sum()
    if granularity == "head":
        return err.sum((1, 2))
    return err.sum(1)


def mse_ranges(x: torch.Tensor, granularity: str, target: QuantSpec) -> Ranges:
    """MSE-optimal clipping of the absmax ranges for ``target`` (its format, bits, mapping and scale dtype)."""
    if target.is_none or not target.fmt.supports_static:
        raise ValueError("mse calibration needs a target spec whose format takes calibrated parameters "
                         f"(int, fp8); got {target.describe()}")
    full = percentile_ranges(x, granularity)
    x4 = x.float().permute(1, 0, 2)[None]  # [1, H, N, D]
    out = {}
    for mapping in ("symmetric", "asymmetric"):
        try:
            spec = _static_spec(target, granularity, mapping)
        except ValueError:  # the format has no such mapping (fp8: symmetric only; no symmetric 1-bit int)
            if mapping == "symmetric":
                out["absmax"] = full.absmax  # plain extremes
            else:
                out["lo"], out["hi"] = full.lo, full.hi
            continue
        centre, half = (full.hi + full.lo) / 2, (full.hi - full.lo) / 2
        best_err = best_lo = best_hi = None
        for r in MSE_RATIOS:
            lo, hi = (-full.absmax * r, full.absmax * r) if mapping == "symmetric" else (centre - half * r, centre + half * r)
            err = _sq_error(x4, spec, lo, hi, granularity)
            if best_err is None:
                best_err, best_lo, best_hi = err, lo, hi
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
        if mapping == "symmetric":
            out["absmax"] = best_hi
        else:
            out["lo"], out["hi"] = best_lo, best_hi
    return Ranges(out["absmax"], out["lo"], out["hi"])


def calibrate_ranges(x: torch.Tensor, granularity: str, method: str = "absmax", *, percentile: float = 99.9,
                     target: QuantSpec | None = None) -> Ranges:
    """Ranges of samples x ``[N, H, D]`` for one static granularity by ``method`` (see the module docstring)."""
    if method == "absmax":
        return percentile_ranges(x, granularity, 100.0)
    if method == "percentile":
        return percentile_ranges(x, granularity, percentile)
    if method == "mse":
        if target is None:
            raise ValueError("method 'mse' needs a target spec (the format the scales are for)")
        return mse_ranges(x, granularity, target)
    raise ValueError(f"calibration method must be one of {', '.join(METHODS)}; got {method!r}")
