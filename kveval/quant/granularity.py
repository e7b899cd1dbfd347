"""Granularities: which elements of x [batch, kv_heads, seq, head_dim] = [B, H, T, D] share a scale (and zero point).

Each is a small frozen type that knows its scale shape and its statistics segments (views of x whose groups are
reduced over `dims`; keepdim gives the scale shape):

- `PerToken()`:    over D per token                        scale [B, H, T, 1]
- `PerGroup(g)`:   x viewed [B, H, T, D//g, g], over g     scale [B, H, T, D//g, 1]
- `PerChannel(g)`: x viewed [B, H, nb, cb, D], over the cb tokens of each block, per channel
                                                           scale [B, H, nb, 1, D], nb = ceil(T / cb)
  cb = g when the spec sets a token group size g (`QuantSpec.group_size` with granularity 'channel': KIVI's keys,
  groups of G = 32 tokens inside each flushed block), else the channel block the caller gives (the policy's
  residual block), else all T tokens (one block). When cb does not divide T, the last, partial block is its own
  block (its own segment) with statistics over its own T % cb tokens only.
- `PerHead()`:     over B, T, D per kv head                scale [1, H, 1, 1]
- `PerTensor()`:   over everything                         scale [1, 1, 1, 1]

Static (calibrated) parameters exist for tensor [1, 1, 1, 1], head [1, H, 1, 1] and channel [1, H, 1, D] (one
scale per channel and head, broadcast over every token); calibrated ranges have shape [], [H] and [H, D].
`granularity_of(spec.granularity, spec.group_size)` turns a QuantSpec's plain fields into one of these.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch


class Segment(NamedTuple):
    """A view of x whose statistics groups are reduced over `dims` (None: over everything), and the part of the
    scale along dim 2 that it owns (`scale_slice`; all of it except for a channel spec's partial last block)."""

    view: torch.Tensor
    dims: tuple[int, ...] | None
    scale_slice: slice


_ALL = slice(None)


@dataclass(frozen=True)
class Granularity(ABC):
    """Statistics groups of x [B, H, T, D] (see the module docstring)."""

    name: ClassVar[str]
    #: can take static (calibrated) parameters: tensor, head, channel
    calibratable: ClassVar[bool] = False
    #: groups span every token of the sequence: a causal cache needs static (calibrated or fixed) parameters
    static_only: ClassVar[bool] = False
    #: statistics over blocks of tokens (channel); static parameters are then broadcast over every token
    token_blocks: ClassVar[bool] = False
    #: dimensions of a calibrated range: [] (tensor), [H] (head), [H, D] (channel)
    range_ndim: ClassVar[int | None] = None

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError when the groups do not tile a head_dim row (only groups can fail)."""
        return None

    def block(self, seq: int, channel_block: int | None) -> int | None:
        """The token block of the statistics (channel granularity only; None for the others)."""
        return None

    @property
    def token_group(self) -> int | None:
        """Tokens per statistics group when the granularity fixes it (a channel spec with a token group size)."""
        return None

    @abstractmethod
    def scale_shape(self, shape: tuple[int, ...], block: int | None) -> tuple[int, ...]:
        """Scale shape for x of `shape` [B, H, T, D] (`block` from `block()`)."""

    @abstractmethod
    def segments(self, t: torch.Tensor, block: int | None) -> list[Segment]:
        """Views of t [B, H, T, D] (x, or codes of x's shape) with their reduction dims, in token order."""

    def static_scale_shape(self, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        """Shape of static (calibrated) parameters, broadcast over tokens."""
        raise ValueError(f"granularity {self.name!r} takes no static parameters")

    def groups_per_row(self, head_dim: int) -> int:
        """Statistics groups inside one head_dim row (token 1, group D/g); 0 for groups that span tokens, whose
        scales are amortised over the tokens."""
        return 0

    def label(self) -> str:
        """Short name in `QuantSpec.describe()`: 'token', 'g64', ..."""
        return self.name


@dataclass(frozen=True)
class PerToken(Granularity):
    name: ClassVar[str] = "token"

    def scale_shape(self, shape: tuple[int, ...], block: int | None) -> tuple[int, ...]:
        B, H, T, _ = shape
        return (B, H, T, 1)

    def segments(self, t: torch.Tensor, block: int | None) -> list[Segment]:
        return [Segment(t, (-1,), _ALL)]

    def groups_per_row(self, head_dim: int) -> int:
        return 1


@dataclass(frozen=True)
class PerGroup(Granularity):
    """Groups of `size` consecutive elements of head_dim."""

    name: ClassVar[str] = "group"
    size: int = 32

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.size:
            raise ValueError(f"group_size {self.size} does not divide head_dim {head_dim}")

    def scale_shape(self, shape: tuple[int, ...], block: int | None) -> tuple[int, ...]:
        B, H, T, D = shape
        return (B, H, T, D // self.size, 1)

    def segments(self, t: torch.Tensor, block: int | None) -> list[Segment]:
        B, H, T, D = t.shape
        return [Segment(t.view(B, H, T, D // self.size, self.size), (-1,), _ALL)]

    def groups_per_row(self, head_dim: int) -> int:
        return head_dim // self.size

    def label(self) -> str:
        return f"g{self.size}"


@dataclass(frozen=True)
class PerChannel(Granularity):
    """Per channel (element of head_dim) and head, over blocks of tokens (KIVI keys) or calibrated. ``size``: tokens
    per statistics group (KIVI's G, jy-yuan/KIVI ``quant/new_pack.py`` ``triton_quantize_and_pack_along_last_dim``
    on the transposed keys); None: the caller's channel block (the policy's residual block)."""

    name: ClassVar[str] = "channel"
    calibratable: ClassVar[bool] = True
    token_blocks: ClassVar[bool] = True
    range_ndim: ClassVar[int | None] = 2
    size: int | None = None

    @property
    def token_group(self) -> int | None:
        return self.size

    def block(self, seq: int, channel_block: int | None) -> int | None:
        if self.size is not None:
            return self.size
        if channel_block is None:
            return max(seq, 1)
        if isinstance(channel_block, bool) or not isinstance(channel_block, int) or channel_block <= 0:
            raise ValueError(f"channel_block must be a positive integer or None; got {channel_block!r}")
        return channel_block

    def scale_shape(self, shape: tuple[int, ...], block: int | None) -> tuple[int, ...]:
        B, H, T, D = shape
        assert block is not None
        return (B, H, -(-T // block), 1, D)

    def segments(self, t: torch.Tensor, block: int | None) -> list[Segment]:
        B, H, T, D = t.shape
        assert block is not None
        nf, r = divmod(T, block)
        segs = []
        if nf:
            segs.append(Segment(t[:, :, : nf * block].view(B, H, nf, block, D), (3,), slice(0, nf)))
        if r:
            segs.append(Segment(t[:, :, nf * block :].view(B, H, 1, r, D), (3,), slice(nf, nf + 1)))
        return segs

    def static_scale_shape(self, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        return (1, kv_heads, 1, head_dim)

    def label(self) -> str:
        return self.name if self.size is None else f"channel t{self.size}"


@dataclass(frozen=True)
class PerHead(Granularity):
    name: ClassVar[str] = "head"
    calibratable: ClassVar[bool] = True
    static_only: ClassVar[bool] = True
    range_ndim: ClassVar[int | None] = 1

    def scale_shape(self, shape: tuple[int, ...], block: int | None) -> tuple[int, ...]:
        return (1, shape[1], 1, 1)

    def segments(self, t: torch.Tensor, block: int | None) -> list[Segment]:
        return [Segment(t, (0, 2, 3), _ALL)]

    def static_scale_shape(self, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        return (1, kv_heads, 1, 1)


@dataclass(frozen=True)
class PerTensor(Granularity):
    name: ClassVar[str] = "tensor"
    calibratable: ClassVar[bool] = True
    static_only: ClassVar[bool] = True
    range_ndim: ClassVar[int | None] = 0

    def scale_shape(self, shape: tuple[int, ...], block: int | None) -> tuple[int, ...]:
        return (1, 1, 1, 1)

    def segments(self, t: torch.Tensor, block: int | None) -> list[Segment]:
        return [Segment(t, None, _ALL)]

    def static_scale_shape(self, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        return (1, 1, 1, 1)


GRANULARITY_TYPES: dict[str, type[Granularity]] = {
    g.name: g for g in (PerToken, PerGroup, PerChannel, PerHead, PerTensor)
}
GRANULARITIES: tuple[str, ...] = tuple(GRANULARITY_TYPES)


@functools.cache
def granularity_of(name: str, group_size: int | None = None) -> Granularity:
    """The granularity named by a QuantSpec's fields, e.g. ``granularity_of("group", 64) == PerGroup(64)``,
    ``granularity_of("channel", 32) == PerChannel(32)`` (groups of 32 tokens per channel)."""
    if name not in GRANULARITY_TYPES:
        raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}; got {name!r}")
    if name == PerGroup.name:
        if group_size is None:
            raise ValueError("granularity 'group' needs a group_size")
        return PerGroup(group_size)
    if name == PerChannel.name:
        return PerChannel(group_size)
    return GRANULARITY_TYPES[name]()
