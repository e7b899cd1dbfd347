"""Position buffers of the real cache's layers: how a buffer grows (``grown_capacity``), moving its live slots into
a new one (``moved``), and the ``(cos, sin)`` table of the stored positions that pre-RoPE keys are read back
through (``RopeTable``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def grown_capacity(capacity: int, need: int, reserve: int | None) -> int:
    """Positions a buffer holding ``capacity`` allocates for ``need``: ``reserve`` (or twice the need) at the first
    call, then doubling (amortised O(1) copies per position)."""
    if not capacity:
        return max(need, reserve or 2 * need, 16)
    return capacity if need <= capacity else max(need, 2 * capacity)


def moved(buf: torch.Tensor | None, like: torch.Tensor, dim: int, start: int, stop: int,
          capacity: int) -> torch.Tensor:
    """A new buffer shaped as ``like`` with ``capacity`` along ``dim``, holding ``buf``'s slots ``[start, stop)``
    at its front."""
    shape = list(like.shape)
    shape[dim] = capacity
    new = like.new_empty(shape)
    if buf is not None and stop > start:
        new.narrow(dim, 0, stop - start).copy_(buf.narrow(dim, start, stop - start))
    return new


class RopeTable:
    """The ``(cos, sin)`` ``[batch, capacity, head_dim]`` of a layer's stored positions from ``base`` on (slot
    ``i`` holds position ``base + i``), kept only when a transform needs RoPE (pre-RoPE keys are quantized before
    RoPE and read back through it). How much it allocates when it grows is the read path's (``capacity_for``)."""

    def __init__(self) -> None:
        self.cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self.base = self.capacity = 0

    def write(self, n0: int, n1: int, rope: tuple[torch.Tensor, torch.Tensor], live: int, rows: int,
              capacity_for: Callable[[int, int], int]) -> None:
        """Hold ``rope`` ``(cos, sin)``, each ``[1 or rows, n1 - n0, head_dim]``, at positions ``[n0, n1)``. When
        it runs out of room, the table moves to a new one of ``capacity_for(capacity, n1 - live)`` positions
        keeping ``[live, n0)`` (``live``: the first position whose (cos, sin) may be read again)."""
        if n1 - self.base > self.capacity:
            capacity, old = capacity_for(self.capacity, n1 - live), self.cos_sin
            start, stop = live - self.base, n0 - self.base
            self.cos_sin = tuple(  # type: ignore[assignment]
                moved(None if old is None else old[i], rope[i].expand(rows, -1, -1), 1, start, stop, capacity)
                for i in (0, 1))
            self.base, self.capacity = live, capacity
        assert self.cos_sin is not None
        b = self.base
        self.cos_sin[0][:, n0 - b:n1 - b] = rope[0]
        self.cos_sin[1][:, n0 - b:n1 - b] = rope[1]

    def at(self, index, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) of positions ``[start, end)`` of the rows ``index``, or None without pre-RoPE."""
        if self.cos_sin is None:
            return None
        b = self.base
        return self.cos_sin[0][index, start - b:end - b], self.cos_sin[1][index, start - b:end - b]

    def trim(self, live: int) -> None:
        """Keep only the positions from ``live`` on, in tensors of their size (the window moved on)."""
        if self.cos_sin is not None and self.base < live:
            cut = live - self.base
            self.cos_sin = (self.cos_sin[0][:, cut:].clone(), self.cos_sin[1][:, cut:].clone())
            self.base, self.capacity = live, self.capacity - cut

    def nbytes(self) -> int:
        """Bytes of the table (cos and sin)."""
        if self.cos_sin is None:
            return 0
        return 2 * self.cos_sin[0].numel() * self.cos_sin[0].element_size()
