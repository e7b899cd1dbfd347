"""llama-perplexity's ``--kl-divergence-base`` file: reading, writing, and the per-token statistics against it.

The format, as llama.cpp 0c1e570 writes it (``tools/perplexity/perplexity.cpp``: the header and token ids in
``perplexity()``, l. 466 and 521-524; the rows by the compressing ``log_softmax``, l. 79-107, and its caller
``process_logits``, l. 144-173; the reader ``kl_divergence()``, l. 1688-1720 and 1842), native byte order
(little-endian here), no padding between fields::

    8 bytes   "_logits_"
    int32     n_ctx       the chunk length (-c)
    int32     n_vocab
    int32     n_chunk
    int32     tokens[n_chunk * n_ctx]       the chunks' token ids as tokenized (no BOS substitution)
    uint16    rows[n_chunk * R * W]         R = n_ctx - 1 - n_ctx // 2 rows per chunk, W = 4 + n_vocab rounded up
                                            to even: float32 scale, float32 min_log_prob, then n_vocab codes

Row ``r`` of chunk ``c`` is the base model's next-token distribution at chunk position ``n_ctx // 2 + r``, which
predicts ``tokens[c, n_ctx // 2 + r + 1]``: llama-perplexity scores the second half of every chunk (positions
``n_ctx // 2 + 1 .. n_ctx - 1``, the first half being context). A row codes the log-probabilities on a 16-bit
grid spanning the 16 nats below the largest logit: ``log p[i] = scale * u[i] + min_log_prob`` (float32), a
token more than 16 nats below the maximum decoding to the bottom of the range.

:class:`BaseFile` checks a file before anything is run (magic, header, size, token ids, row headers, the vocabulary
against a model's), each problem one :class:`KvevalError` line; :func:`write_base` writes one from kveval's own
logits (:func:`encode_rows`); :func:`token_stats` computes, per scored token, what llama-perplexity's KL pass
computes against such a row (``log_softmax`` with a base row, l. 191-252), in its float32 arithmetic.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kveval.errors import KvevalError

MAGIC = b"_logits_"
HEADER_BYTES = len(MAGIC) + 3 * 4
#: llama.cpp's coding range: logits more than this many nats below the maximum share the lowest code
RANGE_NATS = 16.0
CODES = 65535


def row_width(n_vocab: int) -> int:
    """uint16 values per row: two float32 (scale, min_log_prob) and ``n_vocab`` codes, rounded up to even."""
    return 4 + 2 * ((n_vocab + 1) // 2)


def first_scored(n_ctx: int) -> int:
    """The chunk position of the first row (``n_ctx // 2``): its logits predict the token after it."""
    return n_ctx // 2


def rows_per_chunk(n_ctx: int) -> int:
    """Scored tokens per chunk: positions ``n_ctx // 2 + 1 .. n_ctx - 1``."""
    return n_ctx - 1 - n_ctx // 2


def file_size(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    return HEADER_BYTES + 4 * n_chunk * n_ctx + 2 * n_chunk * rows_per_chunk(n_ctx) * row_width(n_vocab)


# ------------------------------------------------------------------------------------------- coding
def encode_rows(logits: np.ndarray) -> np.ndarray:
    """Logits ``[n, vocab]`` -> rows ``[n, row_width(vocab)]`` (uint16), as llama.cpp codes them: in float32, the
    range from ``max(min, max - 16)`` to the maximum on 65535 steps (round half to even), ``min_log_prob`` the
    log-probability of the bottom of the range (exponentials in float32 summed in float64, their log in float32),
    and every logit at or below the bottom coded 0; a row of equal logits is all zeros with scale 0."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    n, vocab = x.shape
    top = x.max(axis=1)
    bottom = np.maximum(x.min(axis=1), (top - np.float32(RANGE_NATS)).astype(np.float32))
    lse = np.log(np.exp(x - top[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
    min_log_prob = ((bottom - top).astype(np.float32) - lse).astype(np.float32)
    scale = ((top - bottom).astype(np.float32) / np.float32(CODES)).astype(np.float32)
    out = np.zeros((n, row_width(vocab)), dtype=np.uint16)
    out[:, :4] = np.stack([scale, min_log_prob], axis=1).astype("<f4").view("<u2")
    live = scale != 0
    if live.any():
        inv = (np.float32(1) / scale[live]).astype(np.float32)
        xs, bs = x[live], bottom[live]
        codes = np.rint((inv[:, None] * (xs - bs[:, None]).astype(np.float32)).astype(np.float32))
        out[live, 4:4 + vocab] = np.where(xs > bs[:, None], codes, 0).astype(np.uint16)
    return out


def row_headers(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale ``[n]``, min_log_prob ``[n]``) float32 of rows ``[n, W]``."""
    head = np.ascontiguousarray(rows[:, :4]).astype("<u2").view("<f4")
    return head[:, 0].astype(np.float32), head[:, 1].astype(np.float32)


def decode_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """Rows ``[n, W]`` -> the base log-probabilities ``[n, n_vocab]`` as llama.cpp reads them:
    ``scale * u + min_log_prob`` in float32."""
    scale, low = row_headers(rows)
    return (scale[:, None] * rows[:, 4:4 + n_vocab].astype(np.float32) + low[:, None]).astype(np.float32)


def token_stats(logits: np.ndarray, rows: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """Per scored token, llama-perplexity's KL pass against base rows: ``nll`` (the model under test), ``nll_base``
    (from the decoded row), ``kld`` = Σ over the tokens whose decoded base log-probability exceeds -16 of
    ``p_base · (log p_base - log q)`` (the base neither renormalised nor clamped: slightly negative when the two
    agree to the coding's precision), ``p_diff`` = ``exp(-nll) - exp(-nll_base)`` and ``same_top`` (1.0 where the
    first maxima of the logits and of the decoded row coincide). Float32 arithmetic as llama.cpp's, sums in
    float64. logits ``[n, vocab]`` float32, rows ``[n, W]``, targets ``[n]`` -> ``[n]`` arrays (float64, kld and
    p_diff also exactly float32-representable where llama.cpp keeps floats)."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    n, vocab = x.shape
    idx = np.arange(n)
    t = np.asarray(targets, dtype=np.int64)
    top = x.max(axis=1)
    lse = np.log(np.exp(x - top[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
    nll = ((top + lse).astype(np.float32) - x[idx, t]).astype(np.float32)
    base = decode_rows(rows, vocab)
    nll_base = (-base[idx, t]).astype(np.float32)
    norm = (top + lse).astype(np.float32)
    keep = base > np.float32(-RANGE_NATS)
    inner = ((base - x).astype(np.float32) + norm[:, None]).astype(np.float32)
    terms = (np.exp(base).astype(np.float32) * inner).astype(np.float32)
    kld = np.where(keep, terms, np.float32(0)).sum(axis=1, dtype=np.float64)
    same = (x.argmax(axis=1) == base.argmax(axis=1)).astype(np.float64)
    p_diff = (np.exp(-nll).astype(np.float32) - np.exp(-nll_base).astype(np.float32)).astype(np.float32)
    return {"nll": nll.astype(np.float64), "nll_base": nll_base.astype(np.float64), "kld": kld,
            "p_diff": p_diff.astype(np.float64), "same_top": same}


# ------------------------------------------------------------------------------------------- the file
def write_base(path: str | Path, n_ctx: int, n_vocab: int, tokens: np.ndarray,
               chunk_rows: Iterable[np.ndarray]) -> Path:
    """Write a base file: ``tokens`` ``[n_chunk, n_ctx]`` and, per chunk, its rows ``[R, row_width(n_vocab)]``
    (:func:`encode_rows` of the logits at positions ``n_ctx // 2 .. n_ctx - 2``), chunk after chunk as they come.
    Returns the path."""
    tok = np.ascontiguousarray(tokens, dtype="<i4")
    n_chunk, width = tok.shape
    if width != n_ctx:
        raise ValueError(f"tokens are [{n_chunk}, {width}], not [n_chunk, {n_ctx}]")
    shape = (rows_per_chunk(n_ctx), row_width(n_vocab))
    path = Path(path)
    written = 0
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes())
        f.write(tok.tobytes())
        for rows in chunk_rows:
            if rows.shape != shape:
                raise ValueError(f"chunk rows are {tuple(rows.shape)}, not {shape}")
            f.write(np.ascontiguousarray(rows, dtype="<u2").tobytes())
            written += 1
    if written != n_chunk:
        raise ValueError(f"{written} chunks of rows for {n_chunk} chunks of tokens")
    return path


class BaseFile:
    """A ``--kl-divergence-base`` file, checked and memory-mapped.

    ``BaseFile(path, n_vocab=model_vocab)``: one :class:`KvevalError` line, naming the file, for a file that is
    missing or not a file, too short for a header, with another magic, a header out of range (``n_ctx`` < 4,
    ``n_vocab`` or ``n_chunk`` < 1), a size that is not the header's (truncated: how many chunks are complete; or
    longer), token ids outside the vocabulary, a row whose scale or minimum is not a finite number (or a negative
    scale), or a vocabulary that is not ``n_vocab``. Attributes: ``n_ctx``, ``n_vocab``, ``n_chunk``, ``tokens``
    ``[n_chunk, n_ctx]`` (int32); ``rows(c)`` the chunk's rows ``[R, W]`` (uint16)."""

    def __init__(self, path: str | Path, n_vocab: int | None = None, what: str = "--kl-divergence-base file"):
        self.path = Path(path).expanduser()
        where = f"{what} {self.path}"
        if not self.path.is_file():
            raise KvevalError(f"{where}: no such file" if not self.path.exists() else f"{where}: not a file")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
            raise KvevalError(f"{where}: not a llama-perplexity base file (it does not start with '_logits_'); "
                              "write one with llama-perplexity --kl-divergence-base FILE (without --kl-divergence)")
        if len(head) < HEADER_BYTES:
            raise KvevalError(f"{where}: truncated in its header ({size} bytes)")
        n_ctx, vocab, n_chunk = (int(v) for v in np.frombuffer(head[len(MAGIC):], dtype="<i4"))
        if n_ctx < 4 or vocab < 1 or n_chunk < 1:
            raise KvevalError(f"{where}: corrupt header (n_ctx {n_ctx}, n_vocab {vocab}, n_chunk {n_chunk})")
        want = file_size(n_ctx, vocab, n_chunk)
        if size < want:
            chunk = 4 * n_ctx + 2 * rows_per_chunk(n_ctx) * row_width(vocab)
            whole = max(0, (size - HEADER_BYTES - 4 * n_chunk * n_ctx) // (chunk - 4 * n_ctx))
            raise KvevalError(f"{where}: truncated: {size} bytes where its header (n_ctx {n_ctx}, n_vocab {vocab}, "
                              f"{n_chunk} chunks) needs {want}; {min(whole, n_chunk)} of {n_chunk} chunks complete")
        if size > want:
            raise KvevalError(f"{where}: {size - want} bytes more than its header (n_ctx {n_ctx}, n_vocab {vocab}, "
                              f"{n_chunk} chunks) describes; not a file llama-perplexity wrote")
        if n_vocab is not None and vocab != n_vocab:
            raise KvevalError(f"{where}: its logits are over a vocabulary of {vocab} tokens, the model's has "
                              f"{n_vocab}: it was written with another model")
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, vocab, n_chunk
        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tokens = raw[HEADER_BYTES:HEADER_BYTES + 4 * n_chunk * n_ctx].view("<i4").reshape(n_chunk, n_ctx)
        if self.tokens.min() < 0 or self.tokens.max() >= vocab:
            bad = int(np.argmax((self.tokens < 0) | (self.tokens >= vocab)))
            raise KvevalError(f"{where}: corrupt token ids (id {int(self.tokens.flat[bad])} at index {bad} is outside "
                              f"the vocabulary of {vocab})")
        self._rows = raw[HEADER_BYTES + 4 * n_chunk * n_ctx:].view("<u2").reshape(
            n_chunk, rows_per_chunk(n_ctx), row_width(vocab))
        scale, low = row_headers(self._rows[:, :, :4].reshape(-1, 4))
        bad_rows = ~np.isfinite(scale) | ~np.isfinite(low) | (scale < 0)
        if bad_rows.any():
            i = int(np.argmax(bad_rows))
            raise KvevalError(f"{where}: corrupt row {i % rows_per_chunk(n_ctx)} of chunk "
                              f"{i // rows_per_chunk(n_ctx)} (scale {scale[i]}, min log-prob {low[i]})")

    def rows(self, chunk: int) -> np.ndarray:
        """Chunk ``chunk``'s rows ``[R, W]`` (uint16, a copy)."""
        return np.array(self._rows[chunk])

    @property
    def scored(self) -> int:
        return self.n_chunk * rows_per_chunk(self.n_ctx)

    def __repr__(self) -> str:
        return f"BaseFile({os.fspath(self.path)!r}, n_ctx={self.n_ctx}, n_vocab={self.n_vocab}, n_chunk={self.n_chunk})"
