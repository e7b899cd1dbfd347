"""Statistics of captured keys and values (pure tensor maths, torch only).

Shapes: a tensor of one layer is ``x [kv_heads, T, head_dim]`` (the tokens of every window side by side); queries
``q [heads, T, head_dim]``; the residual stream ``h [T, hidden]``. Every function returns plain numbers and lists
(JSON-ready).

Definitions (docs/inspect.md):

- ``offset``: per token and head, ``|mean| / max(max - min, max |x|)`` of its ``head_dim`` values, averaged over
  tokens: how far the group a per-token quantizer scales is from centred, in [0, 1] (about 0.02 for Gaussian
  values; 0.75 for values uniform in [1, 2]; 1 when every value is the same). A symmetric quantizer spends the
  part of its range the values do not reach.
- ``kurtosis``: Pearson's, of every value of the head (3 for a Gaussian).
- ``channel_ratio``: the largest channel's mean absolute value over tokens divided by the median channel's; the
  channels above ``OUTLIER_CHANNEL`` times the median are named (a per-channel bias or a few dominant channels:
  what squeezes every other channel of a per-token or per-group scale). A mean, not a maximum, so that one
  dominant token (a sink) does not make its channels outliers: that token is ``token_ratio``'s.
- ``token_ratio``: the largest token's absolute maximum over channels divided by the median token's; the tokens
  above ``DOMINANT_TOKEN`` times are named by index (attention sinks, massive activations;
  ``kveval.inspect.analysis`` names them by window, position and text).
- ``first_mass``: the softmax weight the queries (rows after the first ``n`` tokens) put on each of the first
  ``n`` tokens, per head, averaged over rows.
"""

from __future__ import annotations

import torch

OUTLIER_CHANNEL = 6.0  # x the median channel's mean absolute value
DOMINANT_TOKEN = 6.0  # x the median token's absolute maximum
MASSIVE_ACTIVATION = 50.0  # x the median token's largest residual-stream value
TOP = 4


def _ratio_and_top(values: torch.Tensor, threshold: float) -> tuple[float, list[int], list[float]]:
    """(largest / median, the indices above ``threshold`` x median (at most ``TOP``, largest first), their ratios)
    of a 1-D tensor of non-negative magnitudes."""
    median = float(values.to(torch.float64).quantile(0.5))  # the middle, or the mean of the two middle values
    if median <= 0.0:
        median = float(values[values > 0].min()) if bool((values > 0).any()) else 1.0
    ratios = values / median
    order = torch.argsort(ratios, descending=True)[:TOP]
    named = [int(i) for i in order if float(ratios[i]) >= threshold]
    return float(ratios.max()), named, [float(ratios[i]) for i in named]


def head_profile(x: torch.Tensor) -> dict:
    """The statistics of one head ``x [T, head_dim]`` (module docstring)."""
    x = x.to(torch.float64)
    span = torch.maximum(x.amax(-1) - x.amin(-1), x.abs().amax(-1)).clamp_min(1e-30)
    offset = float((x.mean(-1).abs() / span).mean())
    centred = x - x.mean()
    var = float((centred ** 2).mean())
    kurtosis = float((centred ** 4).mean()) / var ** 2 if var > 0 else 0.0
    channel_ratio, channels, channel_ratios = _ratio_and_top(x.abs().mean(0), OUTLIER_CHANNEL)
    token_ratio, tokens, token_ratios = _ratio_and_top(x.abs().amax(-1), DOMINANT_TOKEN)
    return {"abs_max": float(x.abs().max()), "offset": offset, "kurtosis": kurtosis,
            "channel_ratio": channel_ratio, "outlier_channels": channels, "outlier_channel_ratios": channel_ratios,
            "token_ratio": token_ratio, "dominant_tokens": tokens, "dominant_token_ratios": token_ratios}


def tensor_profile(x: torch.Tensor) -> list[dict]:
    """``head_profile`` of each KV head of ``x [kv_heads, T, head_dim]``."""
    return [head_profile(x[h]) for h in range(x.shape[0])]


def first_mass(q: torch.Tensor, k: torch.Tensor, scaling: float, n: int = 4, rows: int = 256) -> torch.Tensor:
    """``[heads, n]``: the causal softmax weight that the query rows ``t >= n`` put on each of keys ``0..n-1``,
    averaged over those rows, for ``q [heads, T, head_dim]`` and ``k [kv_heads, T, head_dim]`` (grouped heads share
    a KV head). Rows are taken ``rows`` at a time (memory ``heads x rows x T``)."""
    H, T, _ = q.shape
    n = min(n, T - 1)
    if n <= 0:
        return torch.zeros(H, 0, dtype=torch.float64)
    kk = k.to(torch.float64).repeat_interleave(H // k.shape[0], dim=0)
    qq = q.to(torch.float64)
    total = torch.zeros(H, n, dtype=torch.float64, device=q.device)
    for start in range(n, T, rows):
        stop = min(start + rows, T)
        scores = torch.matmul(qq[:, start:stop], kk[:, :stop].transpose(-1, -2)) * scaling  # [H, r, stop]
        causal = (torch.arange(stop, device=q.device)[None, :]
                  > torch.arange(start, stop, device=q.device)[:, None])
        scores = scores.masked_fill(causal, float("-inf"))
        total += torch.softmax(scores, dim=-1)[..., :n].sum(1)
    return total / (T - n)


def massive_activations(h: torch.Tensor) -> dict:
    """The residual stream ``h [T, hidden]`` entering one layer: the tokens whose largest absolute value is at
    least ``MASSIVE_ACTIVATION`` times the median token's (position, channel, ratio), and the largest ratio."""
    h = h.to(torch.float64)
    peak, channel = h.abs().max(-1)
    ratio, tokens, ratios = _ratio_and_top(peak, MASSIVE_ACTIVATION)
    return {"ratio": ratio, "tokens": [{"position": t, "channel": int(channel[t]), "ratio": r}
                                       for t, r in zip(tokens, ratios)]}
