"""A rotation of K (with Q) and/or V (with the attention output) on any policy: the general form of the rotations
of QuaRot/SpinQuant-style KV rotation (kept in the cache, post-RoPE) and RotateKV-style pre-RoPE rotation (undone on
read, after ``pre_rope``), so that a format can be compared with and without a rotation at the same bits.

``kind`` (an orthonormal matrix M ``[head_dim, head_dim]``, a row vector x stored as ``x M``):

- ``hadamard``: ``blockdiag(H_b, ..., H_b)``, the normalised Sylvester-Hadamard matrix of order ``b = block``
  (0: the whole head_dim, which must then be a power of two) on consecutive groups of channels
  (``kveval.transforms.hadamard.rotate_blocks``);
- ``hadamard_signs``: ``diag(s) blockdiag(H_b)``, random signs s in {-1, +1}^head_dim then the Hadamard matrix
  (the randomised Hadamard transform of QuaRot; s from ``random_rotation``'s ``signs`` generator);
- ``orthogonal``: a Haar-random orthogonal matrix (``random_rotation``'s ``orthogonal``).

The random kinds draw per layer from ``torch.Generator().manual_seed(seed + layer)``. ``keep``:

- ``true`` (default): the cache stays rotated; the query is rotated with the keys ((q M)·(k M) = q·k) and the
  attention output rotated back (o = o' Mᵀ): post-RoPE only, and first in a sequence (``check_sequence``);
- ``false``: keys/values are rotated before quantization and rotated back on read (``key_out``/``value_out``
  apply Mᵀ); usable anywhere in a sequence, e.g. after ``pre_rope`` (a pre-RoPE rotation).

``on``: ``key``, ``value`` or ``both``. Arithmetic in float32 (float64 for float64 tensors). Shapes: hooks see
``[batch, heads, T, head_dim]``. Worked: ``kind: hadamard``, head_dim 2: M = [[1, 1], [1, -1]] / sqrt(2), so
k = [3, 1] is stored as [4, 2] / sqrt(2) and read back as [3, 1] (``keep: false``).

In a policy: ``rotate: hadamard`` (or ``{kind: orthogonal, seed: 0, on: key, block: 64, keep: false}``) adds this
transform (``kveval.policy.parse``); with ``pre_rope: true`` the shorthand defaults to ``keep: false``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kveval.quant.rotation import ROTATION_KINDS, is_power_of_two, rotation_matrix
from kveval.transforms.base import Kind, TransformContext
from kveval.transforms.registry import register
from kveval.transforms.rotation_base import RotationTransform, matrix_rotate

KINDS = ROTATION_KINDS


@register
@dataclass(frozen=True)
class Rotate(RotationTransform):
    """A rotation of K with Q and/or V with the output (module docstring): ``kind``, ``block`` (Hadamard kinds; 0 =
    head_dim), ``seed`` (random kinds; layer l uses ``seed + l``), ``on``, ``keep`` (cache stays rotated, or
    rotated back on read)."""

    name: ClassVar[str] = "rotate"
    kind: str = "hadamard"
    block: int = 0
    seed: int = 0
    on: str = "both"
    keep: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"'kind' must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 0 \
                or (self.block and not is_power_of_two(self.block)):
            raise ValueError(f"'block' must be 0 (the whole head_dim) or a power of two; got {self.block!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"'seed' must be a non-negative integer; got {self.seed!r}")
        self.check_on()
        if not isinstance(self.keep, bool):
            raise ValueError(f"'keep' must be true or false; got {self.keep!r}")

    def check_head_dim(self, head_dim: int) -> None:
        if self.kind != "orthogonal":
            rotation_matrix(self.kind, self.block, self.seed, head_dim)

    def matrix(self, ctx: TransformContext, x: torch.Tensor) -> torch.Tensor:
        """This layer's M in x's working dtype (float64 for float64, else float32), on x's device."""
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        m = rotation_matrix(self.kind, self.block, self.seed + ctx.layer, x.shape[-1])
        return m.to(device=x.device, dtype=work)

    def rotate(self, x: torch.Tensor, kind: Kind, ctx: TransformContext, back: bool = False) -> torch.Tensor:
        return matrix_rotate(x, rotation_matrix(self.kind, self.block, self.seed + ctx.layer, x.shape[-1]), back)


__all__ = ["KINDS", "Rotate"]
