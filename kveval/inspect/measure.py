"""What a policy does to the captured tensors, without another model pass.

For each layer of a captured window, ``measure_window`` runs the emulation's own attention call
(``kveval.patch.emulate.LayerEmulation.attend``: the policy's quantizers, transforms and schedule, sinks and
residual windows included; every token decoded one at a time, as perplexity scores them) on the captured queries,
keys and values, and compares it with the stock call's output. Per layer it adds up (``LayerSums``):

- ``key`` / ``value``: ``Σ(x̂ - x)²`` and ``Σx²`` per KV head over every token (as attention reads them, after the
  transforms that keep a tensor in their domain; the tokens the policy keeps in full precision add no error);
- ``logit``: ``Σ(ŝ - s)²`` per query head over the causal (query, key) pairs, ``s = scaling · q·k`` (the query as
  the key quantizer's hooks hand it over, against the model's own logits), and the number of pairs; for the
  candidates as they are (``Variant.reports_logits``);
- ``output``: ``Σ‖ô - o‖²`` and ``Σ‖o‖²`` per query head. Their ratio over the heads, ``output_rel``, is what
  variants are compared by and what predicts a layer's sensitivity (``kveval.inspect.predict``): on the builtin
  model its rank correlation with the scan's measured KLD is 0.82-0.89 per format, against 0.52-0.66 for the error
  the layer writes into the residual stream relative to that stream (docs/inspect.md).

Shapes as in ``kveval.inspect.capture``. Sums are float64; a window adds to the same sums.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from kveval.inspect.capture import LayerCall, Window
from kveval.inspect.variants import Variant
from kveval.patch import attention as attn
from kveval.patch.layers import model_quantizers
from kveval.patch.rope_capture import rope_for

_emulate = importlib.import_module("kveval.patch.emulate")  # the module (``kveval.patch.emulate`` is the function)


@dataclass
class LayerSums:
    """The running sums of one (variant, layer) (module docstring); tensors per head, float64."""

    key_err: torch.Tensor | None = None
    key_ref: torch.Tensor | None = None
    value_err: torch.Tensor | None = None
    value_ref: torch.Tensor | None = None
    logit_err: torch.Tensor | None = None
    pairs: int = 0
    out_err: torch.Tensor | None = None
    out_ref: torch.Tensor | None = None
    tokens: int = 0

    def add(self, name: str, value: torch.Tensor) -> None:
        old = getattr(self, name)
        setattr(self, name, value if old is None else old + value)

    @staticmethod
    def _ratio(err: torch.Tensor | None, ref: torch.Tensor | None) -> list[float] | None:
        if err is None or ref is None:
            return None
        return [float(e / r) if r > 0 else 0.0 for e, r in zip(err, ref)]

    def summary(self) -> dict:
        """Per-head relative errors (``key_rel``, ``value_rel``, ``output_rel``), the logits' RMS error per head
        (``logit_rmse``), and their totals over heads."""
        out: dict = {"tokens": self.tokens}
        for name in ("key", "value", "out"):
            err, ref = getattr(self, f"{name}_err"), getattr(self, f"{name}_ref")
            label = "output" if name == "out" else name
            out[f"{label}_rel_heads"] = self._ratio(err, ref)
            out[f"{label}_rel"] = float(err.sum() / ref.sum()) if err is not None and float(ref.sum()) > 0 else 0.0
        if self.logit_err is not None and self.pairs:
            out["logit_rmse_heads"] = [float((e / self.pairs) ** 0.5) for e in self.logit_err]
            out["logit_rmse"] = float((self.logit_err.mean() / self.pairs) ** 0.5)
        return out

    @property
    def output_rel(self) -> float:
        """``Σ‖ô - o‖² / Σ‖o‖²`` over every head (0 before any window)."""
        if self.out_err is None or self.out_ref is None or float(self.out_ref.sum()) <= 0:
            return 0.0
        return float(self.out_err.sum() / self.out_ref.sum())


@dataclass
class Measurements:
    """``sums[(variant name, layer)]`` over the windows measured so far."""

    sums: dict[tuple[str, int], LayerSums] = field(default_factory=dict)

    def of(self, variant: str, layer: int) -> LayerSums:
        return self.sums.setdefault((variant, layer), LayerSums())

    def summary(self, variant: str) -> dict[int, dict]:
        """layer -> ``LayerSums.summary`` of one variant."""
        return {layer: s.summary() for (v, layer), s in sorted(self.sums.items()) if v == variant}

    def total(self, variant: str) -> float:
        """The variant's ``output_rel`` summed over layers (what the changes are compared by)."""
        return sum(s.output_rel for (v, _), s in self.sums.items() if v == variant)


def _heads_sq(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return (x * x).sum(dim=dims, dtype=torch.float64)


def _logit_error(call: LayerCall, query: torch.Tensor, k_hat: torch.Tensor, scaling: float,
                 rows: int = 512) -> tuple[torch.Tensor, int]:
    """(``Σ(ŝ - s)²`` per query head over the causal pairs, the number of pairs) of ``query`` (after the key
    quantizer's hooks) against ``k_hat`` ``[1, kv_heads, T, head_dim]``, with the model's own logits as reference.
    Without a query hook the difference is ``q·(k̂ - k)``, one product in the model's dtype; a hooked query takes
    both products in float64."""
    Hkv, T, D = call.key.shape[1:]
    group = call.query.shape[1] // Hkv
    hooked = query is not call.query
    dtype = torch.float64 if hooked else call.key.dtype
    # queries of one KV head side by side: [kv_heads, group * T, head_dim]
    q0 = call.query[0].reshape(Hkv, group * T, D).to(dtype)
    q1 = query[0].reshape(Hkv, group * T, D).to(dtype) if hooked else q0
    k0, k1 = call.key[0].to(dtype), k_hat[0].to(dtype)
    device = call.key.device
    total = torch.zeros(Hkv, group, dtype=torch.float64, device=device)
    rows_of = torch.arange(T, device=device).repeat(group)  # the position of each query row
    for start in range(0, T, rows):
        stop = min(start + rows, T)
        sel = ((rows_of >= start) & (rows_of < stop)).nonzero().squeeze(-1)
        if hooked:
            diff = (torch.matmul(q1[:, sel], k1[:, :stop].transpose(-1, -2))
                    - torch.matmul(q0[:, sel], k0[:, :stop].transpose(-1, -2)))
        else:
            diff = torch.matmul(q0[:, sel], (k1[:, :stop] - k0[:, :stop]).transpose(-1, -2))
        causal = torch.arange(stop, device=device)[None, :] <= rows_of[sel][:, None]
        if diff.element_size() < 4:  # a 16-bit model's differences would overflow when squared
            diff = diff.float()
        sq = (diff * diff * causal).sum(-1, dtype=torch.float64) * scaling ** 2  # [kv_heads, rows]
        total += sq.reshape(Hkv, group, -1).sum(-1)
    return total.reshape(-1), T * (T + 1) // 2


def scaling_of(call: LayerCall) -> float:
    s = call.kwargs.get("scaling")
    if s is None:
        s = getattr(call.module, "scaling", None)
    return float(s) if s is not None else call.query.shape[-1] ** -0.5


@torch.no_grad()
def measure_window(model, window: Window, variants: list[Variant], into: Measurements) -> None:
    """Add one captured window's errors under each variant to ``into`` (module docstring)."""
    base = attn.base_implementation(model)
    for variant in variants:
        mq = model_quantizers(model, variant.policy)
        masks: dict = {}
        for i, (kq, vq) in mq.quantizers.items():
            call = window.calls[i]
            sums = into.of(variant.name, i)
            state = _emulate.LayerEmulation(i, kq, vq, variant.policy, base, mask_cache=masks)
            rope = rope_for(call.module, call.key.shape[-1], kq, vq)
            for kind, q, x in (("key", kq, call.key), ("value", vq, call.value)):
                if q.is_none:
                    continue
                fp = q.full_precision(x, rope)
                x_hat = _emulate.quantized_version(x, q, variant.policy.schedule(kind), rope, fp)
                sums.add(f"{kind}_err", _heads_sq(x_hat - fp, (0, 2, 3)))
                sums.add(f"{kind}_ref", _heads_sq(fp, (0, 2, 3)))
                if kind == "key" and variant.reports_logits:
                    err, pairs = _logit_error(call, q.query(call.query, rope), x_hat, scaling_of(call))
                    sums.add("logit_err", err)
                    sums.pairs += pairs
            out, _ = state.attend(call.module, call.query, call.key, call.value, call.mask, *call.args,
                                  **call.kwargs)
            diff = (out - call.output).to(torch.float64)
            sums.add("out_err", _heads_sq(diff, (0, 1, 3)))
            sums.add("out_ref", _heads_sq(call.output, (0, 1, 3)))
            sums.tokens += diff.shape[1]
