"""What a layer of the real cache holds, read without changing it (``LayerHoldings(layer)``, a view): per tensor
kind everything held as attention reads it, the quantized storage piece by piece (``StoredRun``), where each row's
quantized tokens end, and the RoPE table. For tests, parity checks and tools; the layer itself answers only what
transformers and the cache ask of it (``get_seq_length``, ``nbytes``...)."""

from __future__ import annotations

import torch

from kveval.patch.cache.layer import QuantizedKVLayer
from kveval.patch.cache.read_paths import assembled
from kveval.patch.cache.storage import StoredPiece


class StoredRun:
    """What ``LayerHoldings.chunks`` lists: one piece of quantized storage with ``read()``, the values attention
    reads at its positions (``[rows, kv_heads, tokens, head_dim]``), and ``read_storage()``, a fresh unpack and
    dequantization of its packed codes, cut to the same tokens."""

    def __init__(self, layer: QuantizedKVLayer, kind: str, piece: StoredPiece):
        self.layer, self.kind, self.piece = layer, kind, piece

    def _first(self) -> int:
        return max(self.piece.start, self.layer.evicted, self.layer.base)

    def read(self) -> torch.Tensor:
        layer = self.layer
        return layer.stores[self.kind].piece_values(self.piece, self._first(), layer.base, layer.rope)

    def read_storage(self) -> torch.Tensor:
        return self.piece.chunk.read_storage()[:, :, self._first() - self.piece.start:]

    def nbytes(self) -> dict[str, int]:
        return self.piece.chunk.nbytes()


class LayerHoldings:
    """A read-only view of one ``QuantizedKVLayer`` (the module docstring). Positions are stored positions
    (``RowPositions``)."""

    def __init__(self, layer: QuantizedKVLayer):
        layer.settle()  # a call stopped before its last layer: its queued flushes first
        self.layer = layer

    def held(self, kind: str) -> torch.Tensor:
        """Everything held of ``kind`` (``"key"``/``"value"``) as attention reads it: positions ``[evicted, n)``,
        ``[batch, kv_heads, n - evicted, head_dim]``: a view of the read buffer, or, on the lean read path between
        calls, assembled from the codes and the full-precision tokens."""
        layer = self.layer
        store = layer.stores[kind]
        if store.view is None:
            return assembled(layer, store, layer.n_stored)[0]
        store.apply_pending(layer.base)
        return store.view[:, :, layer.evicted - layer.base:layer.n_stored - layer.base]

    def chunks(self, kind: str) -> list[StoredRun]:
        """The quantized ``kind`` storage, piece by piece (``read()`` / ``read_storage()`` / ``nbytes()``)."""
        return [StoredRun(self.layer, kind, p) for p in self.layer.stores[kind].pieces]

    def quantized_end(self, kind: str, row: int = 0) -> int:
        """Stored position where row ``row``'s quantized ``kind`` tokens end (``sink_tokens`` before any)."""
        layer = self.layer
        sched = layer.stores[kind].sched
        return layer.positions().quantized_end(sched, row) if layer.pads else sched.sink_tokens

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) ``[batch, positions, head_dim]`` of the held positions (pre-RoPE keys), else None."""
        return self.layer.rope.cos_sin


__all__ = ["LayerHoldings", "StoredRun"]
