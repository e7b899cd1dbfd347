"""The keys and values one chunk of queries of the emulation attends to, side by side in buffers kept for a whole
attention call (``KeyWorkspace``, used by ``kveval.patch.emulate.LayerEmulation._chunk``), and the version parts
they come from (``version_reads``, ``version_pairs``: shared by the chunk plans and ``kveval.patch.lse_merge``).

Shapes: keys and values ``[batch, kv_heads, tokens, dim]``.
"""

from __future__ import annotations

import torch


class KeyWorkspace:
    """The keys and values one chunk of queries attends to (``LayerEmulation._chunk``), side by side in two
    buffers ``[batch, kv_heads, capacity, dim]`` kept for all the chunks of one attention call: a chunk's parts are
    copied into the front of the buffers and attention reads views of them. Concatenating them instead allocates
    a new tensor per chunk, each longer than the last: the C allocator cannot reuse the freed ones for the next and
    keeps them (kivi2 at 32k tokens: 2.9 GB of RSS growth, docs/scale.md). The capacity grows to
    the longest chunk, first to the call's ``T`` keys (what most chunks take), then by doubling."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.like = (key, value)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.allocations = 0  # how many times the buffers were (re)allocated

    def filled(self, parts: list[tuple[torch.Tensor, torch.Tensor, slice | torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[batch, kv_heads, n, dim]`` of the buffers holding each part's ``(keys, values, selection)``
        tokens (a slice or an index tensor along dim 2) one after the other, n their total."""
        lengths = [_selected(k, sel) for k, _, sel in parts]
        n = sum(lengths)
        key, value = self.like
        if self.keys is None or self.keys.shape[2] < n:
            capacity = max(n, key.shape[2]) if self.keys is None else max(n, 2 * self.keys.shape[2])
            self.keys = key.new_empty((key.shape[0], key.shape[1], capacity, key.shape[3]))
            self.values = value.new_empty((value.shape[0], value.shape[1], capacity, value.shape[3]))
            self.allocations += 1
        assert self.values is not None
        at = 0
        for (k, v, sel), length in zip(parts, lengths):
            for source, buffer in ((k, self.keys), (v, self.values)):
                target = buffer[:, :, at:at + length]
                target.copy_(source[:, :, sel] if isinstance(sel, slice) else source.index_select(2, sel))
            at += length
        return self.keys[:, :, :n], self.values[:, :, :n]


def version_reads(mk: torch.Tensor, mv: torch.Tensor | None) -> list[torch.Tensor]:
    """The masks of a chunk's version parts from the full-precision masks of its keys ``mk`` and values ``mv``
    (None: the values share the keys' schedule): ``[mk, ~mk]`` (full precision, quantized), else one part per
    (key version, value version), ``[mk & mv, ~mk & mv, mk & ~mv, ~mk & ~mv]``; the order of
    ``version_pairs``."""
    if mv is None:
        return [mk, ~mk]
    return [mk & mv, ~mk & mv, mk & ~mv, ~mk & ~mv]


def version_pairs(key: torch.Tensor, value: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor,
                  four: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) each part of ``version_reads`` reads: ``(k, v), (k̂, v̂)``, or with ``four`` (keys and
    values on different schedules) ``(k, v), (k̂, v), (k, v̂), (k̂, v̂)``."""
    if four:
        return [(key, value), (k_hat, value), (key, v_hat), (k_hat, v_hat)]
    return [(key, value), (k_hat, v_hat)]


def _selected(x: torch.Tensor, selection: slice | torch.Tensor) -> int:
    """How many tokens of ``x`` (dim 2) ``selection`` takes."""
    if isinstance(selection, slice):
        return len(range(*selection.indices(x.shape[2])))
    return int(selection.numel())


__all__ = ["KeyWorkspace", "version_pairs", "version_reads"]
