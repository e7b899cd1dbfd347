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
from typing import ClassVar

import torch

from kveval.quant.rotation import RANDOM_KINDS, random_matrix
from kveval.transforms.base import Kind, TransformContext
from kveval.transforms.registry import register
from kveval.transforms.rotation_base import RotationTransform, matrix_rotate

KINDS = RANDOM_KINDS


@register
@dataclass(frozen=True)
class RandomRotation(RotationTransform):
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
        self.check_on()

    def matrix(self, ctx: TransformContext, x: torch.Tensor) -> torch.Tensor:
        """This layer's Q in the working dtype of x (float64 for float64, else float32), on x's device."""
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        return random_matrix(self.kind, self.seed + ctx.layer, x.shape[-1]).to(device=x.device, dtype=work)

    def rotate(self, x: torch.Tensor, kind: Kind, ctx: TransformContext, back: bool = False) -> torch.Tensor:
        return matrix_rotate(x, random_matrix(self.kind, self.seed + ctx.layer, x.shape[-1]), back)


__all__ = ["KINDS", "RandomRotation"]
