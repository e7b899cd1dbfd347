"""What a layer of the real cache stores, per tensor kind (keys or values).

- ``StoredChunk``: quantized tokens as stored: the codes packed by the spec's format, the scales, zero points and
  outliers in their storage dtype, and what it reads back (``[batch, kv_heads, tokens, head_dim]``).
- ``StoredPiece``: a chunk and the stored positions ``[start, end)`` of the batch rows it holds.
- ``TensorStore``: one tensor kind of one layer: its quantized pieces (merged in a binary-counter pattern), the
  read buffer attention reads during a call, the read-back values that wait for the next call, and the
  full-precision tokens the lean read path holds between calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kveval.patch.cache.buffers import RopeTable
from kveval.patch.cache.schedule import FlushPlan, RowPositions
from kveval.patch.quantizers import TensorQuantizer
from kveval.policy import KVPolicy
from kveval.quant import QuantizedTensor, dequantize, dequantize_into


@dataclass
class StoredChunk:
    """A run of quantized tokens: the codes as the spec's format packs them (``spec.fmt.pack``: uint8 rows along
    head_dim, e.g. two INT4 codes per byte, one FP8 byte per element) plus the QuantizedTensor's scales and zero
    points.

    ``decoded`` holds the values read back from that storage (dequantized once, when the tokens are stored: a decode
    step then costs O(new tokens), not O(context)); a kernel would dequantize on every read and get the same
    numbers. It is a compute cache, not counted in ``nbytes``; the layer moves it into its read buffer
    and drops it from the chunk (None).
    """

    qt: QuantizedTensor  # scales, zero points, outliers and shape; its codes are empty (``packed`` holds them)
    packed: torch.Tensor  # uint8 [batch, kv_heads, tokens, spec.fmt.row_nbytes(spec, head_dim)]
    n_codes: int  # codes per row (head_dim)
    decoded: torch.Tensor | None = None

    @classmethod
    def store(cls, x: torch.Tensor, quantizer: TensorQuantizer, channel_block: int | None, rope=None,
              decode: bool = True) -> StoredChunk:
        """Quantize x ``[batch, kv_heads, n, head_dim]`` (``rope``: its ``(cos, sin)`` for pre-RoPE keys) and pack
        the codes through the spec's format, whatever the format. ``decoded`` is read back from the codes before
        packing (packing is lossless: ``read_storage`` gives the same numbers, which the tests check); with
        ``decode`` False it is left None (a caller that reads the tokens back from their codes later). Where the
        quantizer has a fused path (``TensorQuantizer.quantize_packed``: integer codes of per-token or per-group
        statistics, no transform), the three steps are one native pass with the same bits."""
        fused = quantizer.quantize_packed(x, decode)
        if fused is not None:
            qt, packed, decoded = fused
            return cls(qt=qt, packed=packed, n_codes=x.shape[-1], decoded=decoded)
        qt = quantizer.quantize(x, channel_block, rope)
        spec = qt.spec
        packed = spec.fmt.pack(qt.codes, spec)
        chunk = cls(qt=replace(qt, codes=torch.empty(0, dtype=qt.codes.dtype)), packed=packed,
                    n_codes=qt.codes.shape[-1])
        if decode:
            chunk.decoded = quantizer.read_back(dequantize(qt), rope)
        return chunk

    @property
    def static(self) -> bool:
        """Whether the scales are static (per-tensor, per-head or calibrated): the same in every chunk, kept once."""
        return self.qt.static or self.qt.spec.gran.static_only

    def extend(self, other: StoredChunk) -> StoredChunk:
        """One chunk holding this chunk's tokens followed by ``other``'s (same rows).

        Codes, packed rows, scales, zero points and outliers all carry tokens (or token blocks) on dim 2;
        per-tensor, per-head and calibrated scales are static, the same in both chunks, and kept once."""
        a, b = self.qt, other.qt
        static = self.static

        def cat(x, y, keep_once=static):
            if x is None or keep_once:
                return x
            return torch.cat([x, y], dim=2)

        shape = torch.Size([*a.shape[:2], a.shape[2] + b.shape[2], a.shape[3]])
        qt = replace(a, scale=cat(a.scale, b.scale), zero_point=cat(a.zero_point, b.zero_point), shape=shape,
                     outlier_values=cat(a.outlier_values, b.outlier_values, False),
                     outlier_index=cat(a.outlier_index, b.outlier_index, False))
        decoded = None
        if self.decoded is not None and other.decoded is not None:
            decoded = torch.cat([self.decoded, other.decoded], dim=2)
        return StoredChunk(qt=qt, packed=torch.cat([self.packed, other.packed], dim=2), n_codes=self.n_codes,
                           decoded=decoded)

    def rows(self, lo: int, hi: int) -> StoredChunk:
        """The chunk of batch rows ``[lo, hi)`` (views: a chunk quantized for several layers at once, cut back into
        each layer's, ``kveval.patch.cache.flush_batch``). Dynamic scales only: every tensor carries rows on dim 0."""
        assert not self.static, "static scales are kept once per layer, not per row"

        def cut(x):
            return None if x is None else x[lo:hi]

        a = self.qt
        qt = replace(a, scale=cut(a.scale), zero_point=cut(a.zero_point), shape=torch.Size([hi - lo, *a.shape[1:]]),
                     outlier_values=cut(a.outlier_values), outlier_index=cut(a.outlier_index))
        return StoredChunk(qt=qt, packed=self.packed[lo:hi], n_codes=self.n_codes, decoded=cut(self.decoded))

    def read_storage(self) -> torch.Tensor:
        """Unpack (``spec.fmt.unpack``) and dequantize everything stored: ``[batch, kv_heads, tokens,
        head_dim]``."""
        return dequantize(self._unpacked())

    def read_storage_into(self, out: torch.Tensor) -> None:
        """``out[...] = read_storage()`` without a temporary of the tokens' size (``out``: a slice of a read
        buffer, ``[batch, kv_heads, tokens, head_dim]``): the lean path's decode step, from the packed rows
        (``spec.fmt.read_packed_into``: one native pass for integer codes)."""
        spec = self.qt.spec
        if spec.is_none or not self.packed.numel():
            dequantize_into(self._unpacked(), out)
        else:
            spec.fmt.read_packed_into(self.qt, self.packed, self.n_codes, out)

    def _unpacked(self) -> QuantizedTensor:
        """The QuantizedTensor with its codes unpacked from ``packed`` (``spec.fmt.unpack``)."""
        spec = self.qt.spec
        return replace(self.qt, codes=spec.fmt.unpack(self.packed, spec, self.n_codes))

    def read(self) -> torch.Tensor | None:
        return self.decoded

    def drop_front(self, read_tokens: int, stored_tokens: int, blocks: int = 0, copy: bool = False) -> None:
        """Forget the oldest tokens (a sliding-window layer): ``read_tokens`` of what is read, ``stored_tokens`` of
        the packed rows and per-token side data, and ``blocks`` token blocks of per-channel scales (a block's
        scale and codes are kept while any of its tokens is in the window; static scales are kept). ``copy``:
        copy what is kept into tensors of its size (a slice alone keeps the forgotten bytes alive)."""
        if self.decoded is not None:
            self.decoded = self.decoded[:, :, read_tokens:]
        if stored_tokens == 0 and blocks == 0:
            return
        a = self.qt
        static = self.static

        def cut(x, n, keep_once=static):
            if x is None or keep_once:
                return x
            return x[:, :, n:].clone() if copy else x[:, :, n:]

        per_block = a.spec.gran.token_blocks
        drop_scales = blocks if per_block else stored_tokens
        shape = torch.Size([*a.shape[:2], a.shape[2] - stored_tokens, a.shape[3]])
        self.qt = replace(a, scale=cut(a.scale, drop_scales), zero_point=cut(a.zero_point, drop_scales),
                          shape=shape,
                          outlier_values=cut(a.outlier_values, stored_tokens, False),
                          outlier_index=cut(a.outlier_index, stored_tokens, False))
        self.packed = cut(self.packed, stored_tokens, False)

    def share_static(self, first: StoredChunk) -> None:
        """Hold ``first``'s static scales and zero points (equal to this chunk's: static) instead of a copy."""
        a, b = self.qt, first.qt
        if a.scale is not None and b.scale is not None and torch.equal(a.scale, b.scale):
            self.qt = replace(a, scale=b.scale)
        a = self.qt
        if a.zero_point is not None and b.zero_point is not None and torch.equal(a.zero_point, b.zero_point):
            self.qt = replace(a, zero_point=b.zero_point)

    def static_nbytes(self) -> int:
        """Bytes of the side data a layer keeps once whatever its tokens and rows: static scales and zero points
        and a calibrated codebook (counted in ``nbytes`` of every chunk that holds them)."""
        once = [self.qt.codebook]
        if self.static:
            once += [self.qt.scale, self.qt.zero_point]
        return sum(t.numel() * t.element_size() for t in once if t is not None)

    def nbytes(self) -> dict[str, int]:
        """Bytes held: the packed code bytes as stored, plus scales and zero points in their storage dtype and the
        outliers (values + indices), counted with the scales as side data."""
        side = (self.qt.scale, self.qt.zero_point, self.qt.outlier_values, self.qt.outlier_index,
                self.qt.codebook)  # a calibrated codebook (nuq) is held once per layer and tensor
        scales = sum(t.numel() * t.element_size() for t in side if t is not None)
        codes = self.packed.numel() * self.packed.element_size()
        return {"codes": codes, "scales": scales, "total": codes + scales}


@dataclass
class StoredPiece:
    """Quantized tokens of the rows ``rows``: stored positions ``[start, end)`` of each of them (the same positions
    for all: rows that quantize different positions at a call get different pieces), as one ``StoredChunk`` of
    shape ``[len(rows), kv_heads, end - start, head_dim]``. ``token_block``: the statistics block of a dynamic
    per-channel spec (eviction then drops whole blocks), else None."""

    rows: tuple[int, ...]
    start: int
    end: int
    chunk: StoredChunk
    token_block: int | None = None


class TensorStore:
    """One tensor kind (keys or values) of one layer: the read buffer, the quantized pieces, and the read-buffer
    writes that wait for the next call (modes that read before they quantize).

    ``view`` ``[batch, kv_heads, capacity, head_dim]``: what attention reads at each stored position (slot ``i``
    holds position ``layer.base + i``): the full-precision token as attention reads it
    (``TensorQuantizer.full_precision``) until the token is quantized, its read-back value after. ``raw`` (same
    shape) holds the model's own tensor when a transform keeps full-precision tokens in its domain (the
    quantizer needs x itself); otherwise ``view`` holds x until it is quantized and ``raw`` is None."""

    def __init__(self, kind: str, quantizer: TensorQuantizer, policy: KVPolicy,
                 rows_index: Callable[[tuple[int, ...]], slice | torch.Tensor]):
        self.kind, self.q, self.sched = kind, quantizer, policy.schedule(kind)
        spec = quantizer.spec
        # dynamic per-channel statistics, by blocks of tokens: a piece keeps each block whole (``evict``)
        self.token_blocks = (not quantizer.is_none and spec.gran.token_blocks and spec.granularity == "channel"
                             and not policy.uses_static(spec))
        self.view: torch.Tensor | None = None
        self.raw: torch.Tensor | None = None
        self.pieces: list[StoredPiece] = []
        # (rows, start, end, read-back values): quantized this call, written into ``view`` at the next call
        self.pending: list[tuple[tuple[int, ...], int, int, torch.Tensor]] = []
        self.rows_index = rows_index  # the layer's: rows -> index for dim 0
        # the lean read path between calls (``view`` and ``raw`` are None then): ``tails`` ``(rows, start,
        # values)``: the positions ``[start, n)`` of those rows not quantized (``raw``'s tensor when a transform
        # keeps one, else ``view``'s); ``sinks`` ``(row, start, values)``: a row's sinks, as attention reads them
        self.tails: list[tuple[tuple[int, ...], int, torch.Tensor]] = []
        self.sinks: list[tuple[int, int, torch.Tensor]] = []
        self.shape: tuple[int, int, torch.dtype] | None = None  # (kv_heads, head_dim, dtype), set at the first call

    def store_new(self, x: torch.Tensor, n0: int, n1: int, base: int,
                  rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Write ``x`` ``[batch, kv_heads, n1 - n0, head_dim]``, the model's tensor at positions ``[n0, n1)``, into
        the read buffer in full precision as attention reads it (x itself into ``raw`` when that differs); returns
        what attention reads (``rope``: its (cos, sin) for pre-RoPE keys)."""
        assert self.view is not None
        self.apply_pending(base)
        fresh = self.q.full_precision(x, rope)
        self.view[:, :, n0 - base:n1 - base] = fresh
        if self.raw is not None:
            self.raw[:, :, n0 - base:n1 - base] = x
        return fresh

    def source(self) -> torch.Tensor:
        """What the quantizer quantizes: ``raw`` when a transform keeps it, else ``view``."""
        assert self.view is not None
        return self.view if self.raw is None else self.raw

    def write_view(self, rows: tuple[int, ...], start: int, end: int, values: torch.Tensor, base: int) -> None:
        """Overwrite positions ``[start, end)`` of ``rows`` (those still in the buffer) with ``values``."""
        assert self.view is not None
        first = max(start, base)
        if end <= first:
            return
        self.view[self.rows_index(rows), :, first - base:end - base] = values[:, :, first - start:]

    def apply_pending(self, base: int) -> None:
        for rows, start, end, values in self.pending:
            self.write_view(rows, start, end, values, base)
        self.pending.clear()

    def read_back(self, piece: StoredPiece, rope: RopeTable) -> torch.Tensor:
        """What attention reads at ``piece``'s positions, from its packed codes (``[rows, kv_heads, tokens,
        head_dim]``): unpacked, dequantized and read back through the transforms, as ``StoredChunk.store``
        computed it."""
        at = rope.at(self.rows_index(piece.rows), piece.start, piece.end) if self.q.needs_rope else None
        return self.q.read_back(piece.chunk.read_storage(), at)

    def piece_values(self, piece: StoredPiece, first: int, base: int, rope: RopeTable) -> torch.Tensor:
        """What attention reads at ``piece``'s positions from ``first`` on: a slice of the read buffer, or, when
        there is none (the lean read path between calls), read back from the codes."""
        if self.view is None:
            return self.read_back(piece, rope)[:, :, first - piece.start:]
        self.apply_pending(base)
        return self.view[self.rows_index(piece.rows), :, first - base:piece.end - base]

    def flush(self, plan: FlushPlan, base: int, rope: RopeTable, keep: bool, defer: bool) -> None:
        """Quantize the stored positions of ``plan`` (``RowPositions.flush_plan``) into pieces: one quantize call
        per group of rows (per row for whole-tensor formats, whose statistics span the batch). With ``keep``, the
        read-back values go into the read buffer (slot ``i``: position ``base + i``) now, or at the next call
        (``defer``); without, they are read back from the codes when needed."""
        q, sched = self.q, self.sched
        block = sched.residual if sched.blocks else None
        channel_block = block if q.spec.granularity == "channel" else None
        for rows, start, end in plan:
            parts = [(r,) for r in rows] if q.spec.fmt.whole_tensor and len(rows) > 1 else [rows]
            for part in parts:
                index = self.rows_index(part)
                x = self.source()[index, :, start - base:end - base]
                at = rope.at(index, start, end) if q.needs_rope else None
                chunk = StoredChunk.store(x, q, channel_block, at, decode=keep)
                decoded, chunk.decoded = chunk.decoded, None
                token_block = (q.spec.gran.block(end - start, block) if self.token_blocks and block is not None
                               else None)
                self.push(StoredPiece(part, start, end, chunk, token_block))
                if not keep:
                    continue
                assert decoded is not None
                if defer:
                    self.pending.append((part, start, end, decoded))
                else:
                    self.write_view(part, start, end, decoded, base)

    def push(self, piece: StoredPiece) -> None:
        """Append ``piece``; merge the last two pieces while the older is no longer than the newer (same rows,
        adjacent positions): each token's codes are then copied O(log n) times over a whole generation."""
        pieces = self.pieces
        if pieces and piece.chunk.static:  # one static scale per layer and tensor, as billed
            piece.chunk.share_static(pieces[0].chunk)
        pieces.append(piece)
        while len(pieces) >= 2:
            a, b = pieces[-2], pieces[-1]
            if (a.rows != b.rows or a.end != b.start or a.end - a.start > b.end - b.start
                    or a.chunk.qt.spec.fmt.whole_tensor):
                break
            pieces[-2:] = [StoredPiece(a.rows, a.start, b.end, a.chunk.extend(b.chunk), a.token_block)]

    def evict(self, lo: int, copy: bool = False) -> None:
        """Forget stored positions before ``lo``: pieces that end before it, and the front of the piece it cuts (by
        whole token blocks for per-channel statistics: a block is kept while any of its tokens is held; ``copy``:
        as ``StoredChunk.drop_front``)."""
        kept = []
        for p in self.pieces:
            if p.end <= lo:
                continue
            if p.start < lo:
                if p.token_block is None:
                    drop, blocks = lo - p.start, 0
                else:
                    blocks = (lo - p.start) // p.token_block
                    drop = blocks * p.token_block
                if drop:
                    p.chunk.drop_front(0, drop, blocks, copy)
                    p.start += drop
            kept.append(p)
        self.pieces = kept

    def nbytes(self, positions: RowPositions) -> dict[str, int]:
        """Bytes held, summed over the rows of ``positions``: ``codes`` and ``scales`` of the pieces (static side
        data, static scales and a codebook, counted once), ``residual``: the full-precision tokens (sinks, residual
        windows, every token of a tensor kept in full precision)."""
        codes = scales = 0
        for i, p in enumerate(self.pieces):
            b = p.chunk.nbytes()
            codes += b["codes"]
            scales += b["scales"] - (p.chunk.static_nbytes() if i else 0)
        assert self.shape is not None
        heads, dim, dtype = self.shape
        tokens = positions.full_precision_tokens(self.sched, quantizes=not self.q.is_none)
        return {"codes": codes, "scales": scales, "residual": tokens * heads * dim * dtype.itemsize}
