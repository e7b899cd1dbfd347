"""A seeded random rotation of K (with Q) and/or V (with the attention output), kept in the cache: the random part
of TurboQuant's rotation (Zandieh et al., ICLR 2026, arXiv:2504.19874, Algorithm 1: a random orthogonal matrix).

``kind``:

- ``orthogonal``: a Haar-random orthogonal Q [head_dim, head_dim], the QR factorisation of a standard Gaussian
  matrix with the signs of R's diagonal moved into Q (Q <- Q diag(sign(diag R)), a zero sign counted as +1), drawn
  in float64 from ``torch.Generator().manual_seed(seed + layer)``;
- ``signs``: Q = diag(s), s in {-1, +1}^head_dim from ``torch.randint(0, 2, ...)`` with the same generator. Alone it
  only flips channels; before a format that rotates by a Hadamard matrix H (``turboquant``, ``turboquant_nc``) the
  two make the randomised Hadamard transform x -> x diag(s) H that vLLM used before its PR #40194 (vLLM >= 0.20.1
  uses H alone; which side of H its signs were applied on is not reproduced here).

A row vector x [..., head_dim] is stored as x Q (``key_in`` / ``value_in``); the query is rotated with the keys,
(q Q) . (k Q) = q . k, and the attention output is rotated back, o = o' Q^T. Each layer draws its own matrix
(generator seed ``seed + layer``). Arithmetic in float32 (float64 for float64 tensors). Worked: ``kind: signs``
with s = [1, -1] stores k = [3, 1] as [3, -1].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch

from kveval.transforms.base import KVTransform, TransformContext
from kveval.transforms.registry import register

KINDS = ("orthogonal", "signs")
ON = ("key", "value", "both")


@lru_cache(maxsize=256)
def rotation_matrix(kind: str, seed: int, head_dim: int) -> torch.Tensor:
    """Q [head_dim, head_dim] in float64 (module docstring) drawn from ``torch.Generator().manual_seed(seed)``;
    orthogonal to float64 rounding (Q Q^T = I to about 1e-15)."""
    if kind not in KINDS:
        raise ValueError(f"'kind' must be one of {', '.join(KINDS)}; got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    if kind == "signs":
        s = torch.randint(0, 2, (head_dim,), generator=g).to(torch.float64) * 2 - 1
        return torch.diag(s)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    sign = torch.sign(torch.diagonal(r))
    return q * torch.where(sign == 0, 1.0, sign)[None, :]


@register
@dataclass(frozen=True)
class RandomRotation(KVTransform):
    """Seeded random rotation kept in the cache (module docstring): ``kind`` = ``orthogonal`` or ``signs``, ``seed``
    (layer l uses ``seed + l``), ``on`` = ``key`` (Q with K), ``value`` (V with the output) or ``both``."""

    name: ClassVar[str] = "random_rotation"
    kind: str = "orthogonal"
    seed: int = 42
    on: str = "key"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"'kind' must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"'seed' must be a non-negative integer; got {self.seed!r}")
        if self.on not in ON:
            raise ValueError(f"'on' must be one of {', '.join(ON)}; got {self.on!r}")

    def matrix(self, ctx: TransformContext, x: torch.Tensor) -> torch.Tensor:
        """This layer's Q in the working dtype of x (float64 for float64, else float32), on x's device."""
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        return rotation_matrix(self.kind, self.seed + ctx.layer, x.shape[-1]).to(device=x.device, dtype=work)

    def _apply(self, x: torch.Tensor, ctx: TransformContext, transpose: bool = False) -> torch.Tensor:
        q = self.matrix(ctx, x)
        return (x.to(q.dtype) @ (q.T if transpose else q)).to(x.dtype)

    # --- which tensors ------------------------------------------------------------------------------------------
    @property
    def acts_on_keys(self) -> bool:
        return self.on in ("key", "both")

    @property
    def acts_on_values(self) -> bool:
        return self.on in ("value", "both")

    @property
    def has_query_hook(self) -> bool:
        return self.acts_on_keys

    @property
    def has_output_hook(self) -> bool:
        return self.acts_on_values

    @property
    def keeps_keys_transformed(self) -> bool:
        return self.acts_on_keys

    @property
    def keeps_values_transformed(self) -> bool:
        return self.acts_on_values

    # --- hooks: [batch, heads, T, head_dim] ------------------------------------------------------------------------
    def key_in(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self._apply(k, ctx)

    def query(self, q: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self._apply(q, ctx)

    def value_in(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self._apply(v, ctx)

    def output(self, o: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self._apply(o, ctx, transpose=True)


__all__ = ["KINDS", "RandomRotation", "rotation_matrix"]
