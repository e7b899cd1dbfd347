"""RMSNorm in float64 for float64 models.

transformers' Llama-family and Gemma RMSNorm layers compute in float32 whatever the model's dtype
(``hidden_states.to(torch.float32)`` / ``x.float()``). In a float64 model that float32 step is the largest rounding
left: a single pass over T tokens and token-by-token decoding then differ by ~1e-5 in the logits (measured on the
builtin model in float64 with transformers' own DynamicCache, from token 46 on), which would set the float64 noise
floor. ``make_norms_exact(model)`` replaces the forward of those layers by the same formula in the input's dtype:

* Llama style (``variance_epsilon``): ``weight * x / sqrt(mean(x²) + eps)``;
* Gemma style (``eps``, class name with "Gemma"): ``x / sqrt(mean(x²) + eps) * (1 + weight)``.

Before patching a layer, the float64 formula is checked against the layer's own forward on a random input (to
float32 precision); a layer whose formula differs (another RMSNorm variant) is left alone, as are other norm
classes. Only called for float64 models (in float32 and below the stock code is exact to its dtype already).
"""

from __future__ import annotations

import types

import torch


def _llama_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _gemma_forward(self, x: torch.Tensor) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return normed * (1.0 + self.weight)


def make_norms_exact(model: torch.nn.Module) -> int:
    """Patch every recognised RMSNorm of ``model`` to compute in its input's dtype; returns how many."""
    n = 0
    for module in model.modules():
        name = type(module).__name__
        if not name.endswith("RMSNorm") or not hasattr(module, "weight"):
            continue
        if "Gemma" in name and hasattr(module, "eps"):
            exact = types.MethodType(_gemma_forward, module)
        elif hasattr(module, "variance_epsilon"):
            exact = types.MethodType(_llama_forward, module)
        else:
            continue
        if _same_formula(module, exact):
            module.forward = exact
            n += 1
    return n


@torch.no_grad()
def _same_formula(module: torch.nn.Module, exact) -> bool:
    """Whether ``exact`` computes what the layer's own forward computes (up to its float32 rounding)."""
    weight = module.weight
    x = torch.randn(2, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
    try:
        return torch.allclose(module.forward(x), exact(x), rtol=1e-5, atol=1e-6)
    except (RuntimeError, TypeError, ValueError):
        return False
