"""KVQuant's quantizer and calibration, restated from its source for tests (independent of kveval's code).

Source: SqueezeAILab/KVQuant @57a2383 (2024-07-09):
- ``quant/kvquant/simquant_module_quantizer.py``: ``round_to_nearest_pole_sim``, ``get_outliers``,
  ``get_outliers_dynamic``, ``quant_fn_nuq_recon``, ``SimQuant.quantize`` (calibration), ``QuantLinearSim``
  (thresholds cast with ``.half()``, the NormalFloat signposts of ``nf_nuq``);
- ``quant/llama_simquant.py``: keys (``k_proj``) per channel with static thresholds, values (``v_proj``) per token
  with dynamic ones (``dynamicquantization=True``);
- ``deployment/transformers/src/transformers/models/llama/modeling_llama.py``: ``QuantK.forward_fused_sparse``
  (at most ``int(((1 - sparsity_threshold) / 2) * hidden) + 1`` outliers per side and token, chosen by ``topk`` of
  the normalised values).

Tensors are KVQuant's: one layer's projection output ``y [T, n]`` (n = kv_heads * head_dim, element h * head_dim + d),
float32. ``sparsity_threshold`` is KVQuant's (0.99 for "1%"). The k-means is scikit-learn's, as KVQuant calls it.
"""

from __future__ import annotations

import numpy as np
import torch


def round_to_nearest_pole(w: torch.Tensor, poles) -> torch.Tensor:
    """Each value of the 1-D ``w`` replaced by the nearest pole (the first in ``poles`` order on ties), and the
    index of that pole."""
    diff = torch.stack([(w - c).abs() for c in poles])
    idx = diff.argmin(dim=0)
    out = torch.zeros_like(w)
    for i, c in enumerate(poles):
        out = out + (idx == i) * c
    return out, idx


def nf_signposts(bits: int) -> list[float]:
    """``QuantLinearSim.__init__`` with ``nf_nuq``: NormalFloat signposts from float32 normal quantiles."""
    dist = torch.distributions.Normal(torch.tensor([0.0]), torch.tensor([1.0]))
    n_pos, n_neg = 2 ** (bits - 1) + 1, 2 ** (bits - 1)
    offsets = [0.5 * (1 / 32 + 1 / 30), 1 - 0.5 * (1 / 32 + 1 / 30)]
    list1 = [offsets[0]]
    spacing = (0.5 - offsets[0]) / (2 ** (bits - 1) - 1)
    add = offsets[0]
    for _ in range(n_neg - 1):
        add += spacing
        list1.append(add)
    list2 = []
    spacing = (offsets[1] - 0.5) / (2 ** (bits - 1))
    add = 0.5
    for _ in range(n_pos - 1):
        list2.append(add)
        add += spacing
    list2.append(offsets[-1])
    neg = [torch.tensor(dist.icdf(torch.tensor([v])).data.numpy()).item() for v in list1]
    pos = [torch.tensor(dist.icdf(torch.tensor([v])).data.numpy()).item() for v in list2]
    rangeval, off = abs(neg[0]) - abs(neg[-1]), abs(neg[-1])
    neg = [(v + off) / rangeval for v in neg]
    rangeval, off = abs(pos[-1]) - abs(pos[0]), abs(pos[0])
    pos = [(v - off) / rangeval for v in pos]
    del pos[0]
    return neg + pos


def calibrate(data: np.ndarray, bits: int, sparsity_threshold: float, perchannel: bool, fisher=None):
    """``SimQuant.quantize`` with ``nuq=True``, ``include_sparse`` (unless ``sparsity_threshold`` is 1), no
    cap, no Q-Norm: data [N, n] float32 numpy; ``perchannel`` (keys, qchannel 0) or per token (values, qchannel -1).
    Returns (upper, lower, centroids [2^b] ascending, float32)."""
    from sklearn.cluster import KMeans

    t = 1 - ((1 - sparsity_threshold) / 2) if sparsity_threshold < 1 else 1
    axis = 0 if perchannel else -1
    upper = np.percentile(data, t * 100, axis=axis)
    lower = np.percentile(data, (1 - t) * 100, axis=axis)
    d = torch.tensor(data)
    up, lo = torch.tensor(upper).unsqueeze(axis), torch.tensor(lower).unsqueeze(axis)
    rangeval, zeropoint = (up - lo) / 2, (up + lo) / 2
    s = (d - zeropoint) / rangeval
    mask = torch.logical_or(s > 1, s < -1).flatten()
    x = s.flatten()[~mask].float().cpu().numpy().reshape(-1, 1)
    km = KMeans(n_clusters=2**bits, random_state=0, n_init="auto", max_iter=50)
    km = km.fit(x) if fisher is None else km.fit(x, sample_weight=fisher.flatten()[~mask.numpy()])
    return upper, lower, np.sort(km.cluster_centers_[:, 0])


def quant_keys(y: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, lut) -> tuple[torch.Tensor, torch.Tensor]:
    """``QuantLinearSim.forward`` for keys: static thresholds (cast to fp16), ``get_outliers`` (strict), then
    ``quant_fn_nuq_recon`` (no cap). Returns (y^ [T, n], the outlier mask)."""
    up, lo = upper.flatten().half(), lower.flatten().half()
    mask = torch.logical_or(y < lo.unsqueeze(0), y > up.unsqueeze(0))
    return _nuq_recon(y, mask, up, lo, lut, 0), mask


def quant_values(y: torch.Tensor, sparsity_threshold: float, lut) -> tuple[torch.Tensor, torch.Tensor]:
    """``QuantLinearSim.forward`` for values: ``get_outliers_dynamic`` (per-token quantiles, non-strict), the
    median trick of ``quant_fn_nuq_recon`` for the bounds, then the same lookup. Returns (y^ [T, n], mask)."""
    t = 1 - ((1 - sparsity_threshold) / 2)
    w = y.float()
    hi = torch.quantile(w, t, dim=-1).unsqueeze(-1)
    lo = torch.quantile(w, 1 - t, dim=-1).unsqueeze(-1)
    mask = torch.logical_or(w <= lo, w >= hi)
    outliers = y * mask
    median = torch.median(y, dim=-1).values.unsqueeze(-1)
    tmp = y - outliers + median * mask
    return _nuq_recon(y, mask, tmp.max(dim=-1).values, tmp.min(dim=-1).values, lut, -1), mask


def _nuq_recon(inp, mask, maxval, minval, lut, qchannel):
    """``quant_fn_nuq_recon`` with ``include_sparse`` and given bounds (``qchannel`` 0: per channel, -1: per token)."""
    offset = ((maxval + minval) / 2).unsqueeze(qchannel)
    rangeval = ((maxval - minval) / 2).unsqueeze(qchannel)
    inp = inp - offset
    outliers = inp * mask
    inp = inp - outliers
    scaled = inp / rangeval
    q, _ = round_to_nearest_pole(scaled.flatten(), torch.tensor(lut))
    out = q.reshape(inp.shape).float() * rangeval
    out[mask] = 0
    out = out + outliers
    return torch.nan_to_num(out + offset, nan=0.0, posinf=0.0, neginf=0.0)


def capped(mask_up: torch.Tensor, mask_lo: torch.Tensor, normalised: torch.Tensor, k: int) -> torch.Tensor:
    """``QuantK.forward_fused_sparse``: per token, the ``k`` largest normalised values are outliers if above 1 and
    the ``k`` smallest if below -1 (``topk``; the others keep their dense code). Returns the kept mask [T, n]."""
    up_vals, up_idx = torch.topk(normalised, k, dim=-1)
    lo_vals, lo_idx = torch.topk(normalised, k, dim=-1, largest=False)
    kept = torch.zeros_like(mask_up)
    kept.scatter_(-1, up_idx, (up_vals > 1) & mask_up.gather(-1, up_idx))
    kept.scatter_(-1, lo_idx, kept.gather(-1, lo_idx) | ((lo_vals < -1) & mask_lo.gather(-1, lo_idx)))
    return kept
