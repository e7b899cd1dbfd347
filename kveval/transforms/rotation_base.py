"""The base of every rotation transform (``hadamard``, ``rotate``, ``random_rotation``): an orthonormal M applied
to K (with Q) and/or V (with the attention output), kept in the cache or undone on read.

A subclass is a frozen dataclass with an ``on`` field (``key``, ``value`` or ``both``), optionally a ``keep``
field (default: the cache stays rotated), and one method, ``rotate(x, kind, ctx, back)``: ``x M`` for
``back=False``, ``x Mᵀ`` for ``back=True`` (x ``[batch, heads, T, head_dim]``). Everything else follows
(``kveval.transforms.base``, "Two ways to rotate Q and K together"):

- ``keep`` true: ``key_in(k) = kM``, ``query(q) = qM``, ``value_in(v) = vM``, ``output(o') = o'Mᵀ``; ``key_out``
  and ``value_out`` are the identity (llama.cpp, TurboQuant, QuaRot-style rotations);
- ``keep`` false: ``key_in(k) = kM``, ``key_out(k̂) = k̂Mᵀ`` (likewise for V); no query or output hook (a rotation
  undone on read, e.g. after ``pre_rope``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kveval.transforms.base import Kind, KVTransform, TransformContext

ON = ("key", "value", "both")


class RotationTransform(KVTransform):
    """An orthonormal rotation of K with Q and/or V with the output (module docstring); ``on`` and, optionally,
    ``keep`` are the subclass's dataclass fields."""

    #: the sides a subclass may name in ``on`` (all three unless it says otherwise)
    sides: ClassVar[tuple[str, ...]] = ON
    on: str

    def check_on(self) -> None:
        """ValueError (one line) unless ``on`` is one of ``sides``; subclasses call it from ``__post_init__``."""
        if self.on not in self.sides:
            raise ValueError(f"'on' must be one of {', '.join(self.sides)}; got {self.on!r}")

    def rotate(self, x: torch.Tensor, kind: Kind, ctx: TransformContext, back: bool = False) -> torch.Tensor:
        """``x M`` (``back``: ``x Mᵀ``) of this layer's M for ``kind``, in x's shape and dtype."""
        raise NotImplementedError

    @property
    def kept(self) -> bool:
        """Whether the cache stays rotated (a ``keep`` field, true when the subclass has none)."""
        return bool(getattr(self, "keep", True))

    # --- which tensors ------------------------------------------------------------------------------------------
    @property
    def acts_on_keys(self) -> bool:
        return self.on in ("both", "key")

    @property
    def acts_on_values(self) -> bool:
        return self.on in ("both", "value")

    @property
    def has_query_hook(self) -> bool:
        return self.kept and self.acts_on_keys

    @property
    def has_output_hook(self) -> bool:
        return self.kept and self.acts_on_values

    @property
    def keeps_keys_transformed(self) -> bool:
        return self.kept and self.acts_on_keys

    @property
    def keeps_values_transformed(self) -> bool:
        return self.kept and self.acts_on_values

    # --- hooks ----------------------------------------------------------------------------------------------------
    def key_in(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self.rotate(k, "key", ctx)

    def key_out(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return k if self.kept else self.rotate(k, "key", ctx, back=True)

    def query(self, q: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self.rotate(q, "key", ctx) if self.kept else q

    def value_in(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self.rotate(v, "value", ctx)

    def value_out(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return v if self.kept else self.rotate(v, "value", ctx, back=True)

    def output(self, o: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return self.rotate(o, "value", ctx, back=True) if self.kept else o


def matrix_rotate(x: torch.Tensor, m: torch.Tensor, back: bool) -> torch.Tensor:
    """``x M`` (``back``: ``x Mᵀ``) for a float64 M ``[head_dim, head_dim]``, computed in x's working dtype
    (float64 for float64 x, else float32) and returned in x's dtype."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    m = m.to(device=x.device, dtype=work)
    return (x.to(work) @ (m.T if back else m)).to(x.dtype)


__all__ = ["ON", "RotationTransform", "matrix_rotate"]
