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
from functools import lru_cache
from typing import ClassVar

import torch

from kveval.transforms.base import KVTransform, TransformContext
from kveval.transforms.hadamard import hadamard_matrix, is_power_of_two
from kveval.transforms.random_rotation import rotation_matrix
from kveval.transforms.registry import register

KINDS = ("hadamard", "hadamard_signs", "orthogonal")
ON = ("key", "value", "both")


@lru_cache(maxsize=256)
def rotate_matrix(kind: str, block: int, seed: int, head_dim: int) -> torch.Tensor:
    """M ``[head_dim, head_dim]`` float64 (module docstring); ``seed`` is the layer's (``seed + layer``)."""
    if kind not in KINDS:
        raise ValueError(f"'kind' must be one of {', '.join(KINDS)}; got {kind!r}")
    if kind == "orthogonal":
        return rotation_matrix("orthogonal", seed, head_dim)
    b = block or head_dim
    if not is_power_of_two(b) or head_dim % b:
        raise ValueError(f"a Hadamard rotation needs a power-of-two block dividing head_dim {head_dim}; got "
                         f"{'head_dim' if not block else block} (set 'block' to a power of two that divides it)")
    h = torch.block_diag(*[hadamard_matrix(b, dtype=torch.float64)] * (head_dim // b))
    if kind == "hadamard_signs":
        return rotation_matrix("signs", seed, head_dim) @ h
    return h


@register
@dataclass(frozen=True)
class Rotate(KVTransform):
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
        if self.on not in ON:
            raise ValueError(f"'on' must be one of {', '.join(ON)}; got {self.on!r}")
        if not isinstance(self.keep, bool):
            raise ValueError(f"'keep' must be true or false; got {self.keep!r}")

    def check_head_dim(self, head_dim: int) -> None:
        if self.kind != "orthogonal":
            rotate_matrix(self.kind, self.block, self.seed, head_dim)

    def matrix(self, ctx: TransformContext, x: torch.Tensor) -> torch.Tensor:
        """This layer's M in x's working dtype (float64 for float64, else float32), on x's device."""
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        m = rotate_matrix(self.kind, self.block, self.seed + ctx.layer, x.shape[-1])
        return m.to(device=x.device, dtype=work)

    def _apply(self, x: torch.Tensor, ctx: TransformContext, back: bool = False) -> torch.Tensor:
        m = self.matrix(ctx, x)
        return (x.to(m.dtype) @ (m.T if back else m)).to(x.dtype)

    # --- which tensors ------------------------------------------------------------------------------------------
    @property
    def acts_on_keys(self) -> bool:
        return self.on in ("key", "both")

    @property
    def acts_on_values(self) -> bool:
        return self.on in ("value", "both")

    @property
    def has_query_hook(self) -> bool:
        return self.keep and self.acts_on_keys

    @property
    def has_output_hook(self) -> bool:
        return self.keep and self.acts_on_values

    @property
    def keeps_keys_transformed(self) -> bool:
        return self.keep and self.acts_on_keys

    @property
    def keeps_values_transformed(self) -> bool:
        return self.keep and self.acts_on_values

    # --- hooks --------------------------------------------------------------------------------------------------
    def key_in(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self._apply(k, ctx)

    def key_out(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return k if self.keep else self._apply(k, ctx, back=True)

    def query(self, q: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self._apply(q, ctx) if self.keep else q

    def value_in(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self._apply(v, ctx)

    def value_out(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return v if self.keep else self._apply(v, ctx, back=True)

    def output(self, o: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self._apply(o, ctx, back=True) if self.keep else o


__all__ = ["KINDS", "Rotate", "rotate_matrix"]
