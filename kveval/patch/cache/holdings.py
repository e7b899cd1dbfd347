"""What a layer of the real cache holds, read without changing it (``LayerHoldings``): per tensor kind
everything held as attention reads it, the quantized storage piece by piece (``StoredRun``), where each row's
quantized tokens end, the RoPE table, and the bytes held (``nbytes``, the memory bill of the layer)."""

from __future__ import annotations

import torch

from kveval.patch.cache.buffers import RopeTable
from kveval.patch.cache.schedule import RowPositions
from kveval.patch.cache.storage import StoredPiece, TensorStore


class StoredRun:
    """What ``LayerHoldings.chunks_k`` / ``chunks_v`` list: one piece of quantized storage with ``read()``, the
    values attention reads at its positions (``[rows, kv_heads, tokens, head_dim]``), and ``read_storage()``, a
    fresh unpack and dequantization of its packed codes, cut to the same tokens."""

    def __init__(self, layer: LayerHoldings, kind: str, piece: StoredPiece):
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
    """The read-only side of ``QuantizedKVLayer`` (its base): what tests, parity checks, tools and the memory bill
    read of a layer. Positions are stored positions (``RowPositions``)."""

    stores: dict[str, TensorStore]
    rope: RopeTable
    pads: list[int]
    prompt: int | None
    n_stored: int
    evicted: int
    base: int
    is_initialized: bool

    def positions(self) -> RowPositions:
        """Where the rows stand now (``RowPositions``)."""
        return RowPositions(tuple(self.pads), self.prompt or 1, self.n_stored, self.evicted)

    def held(self, kind: str) -> torch.Tensor:
        """Everything held of ``kind`` (``"key"``/``"value"``) as attention reads it: positions ``[evicted, n)``,
        ``[batch, kv_heads, n - evicted, head_dim]`` (a view of the read buffer)."""
        store = self.stores[kind]
        assert store.view is not None
        store.apply_pending(self.base)
        return store.view[:, :, self.evicted - self.base:self.n_stored - self.base]

    @property
    def chunks_k(self) -> list[StoredRun]:
        """The quantized key storage, piece by piece (``read()`` / ``read_storage()`` / ``nbytes()``)."""
        return [StoredRun(self, "key", p) for p in self.stores["key"].pieces]

    @property
    def chunks_v(self) -> list[StoredRun]:
        return [StoredRun(self, "value", p) for p in self.stores["value"].pieces]

    def quantized_end(self, kind: str, row: int = 0) -> int:
        """Stored position where row ``row``'s quantized ``kind`` tokens end (``sink_tokens`` before any)."""
        sched = self.stores[kind].sched
        return self.positions().quantized_end(sched, row) if self.pads else sched.sink_tokens

    @property
    def q_end_k(self) -> int:
        return self.quantized_end("key")

    @property
    def q_end_v(self) -> int:
        return self.quantized_end("value")

    @property
    def rope_buf(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) ``[batch, positions, head_dim]`` of the held positions (pre-RoPE keys), else None."""
        return self.rope.cos_sin

    def nbytes(self) -> dict:
        """Bytes held: ``codes`` (packed), ``scales`` (scales and zero points, outliers), ``residual``
        (full-precision tokens: sinks, residual windows, and tensors whose spec is ``none``), summed over the rows'
        real tokens (padding positions are not held)."""
        out = {"codes": 0, "scales": 0, "residual": 0}
        if not self.is_initialized:
            return {**out, "total": 0}
        positions = self.positions()
        for store in self.stores.values():
            for part, n in store.nbytes(positions).items():
                out[part] += n
        out["total"] = out["codes"] + out["scales"] + out["residual"]
        return out
