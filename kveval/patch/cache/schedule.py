"""Which stored positions of each batch row the real cache holds quantized, in full precision, or not at all.

Row ``b`` of a batch starts with ``pads[b]`` padding positions: its real token ``i`` is stored at position
``pads[b] + i``, and it follows the schedule of its own tokens (``kveval.policy.masks.Schedule``) exactly as if it
were decoded alone. ``RowPositions`` answers, from where the rows stand, what a layer quantizes at a call (its
flush plan), what it holds in full precision (its bill) and where each row's quantized tokens end.
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.errors import KvevalError
from kveval.policy.masks import Schedule

#: a flush plan: ``(rows, start, end)`` groups, the rows of a group quantizing stored positions ``[start, end)``
FlushPlan = tuple[tuple[tuple[int, ...], int, int], ...]
#: ``(row, start, end)``: stored positions ``[start, end)`` of one row
Span = tuple[int, int, int]


def quantized_end(sched: Schedule, n: int, prompt: int) -> int:
    """Tokens ``[sink_tokens, end)`` of a row holding ``n`` real tokens are quantized (``Schedule.quantized_end``,
    at most ``n``); ``prompt``: the row's real tokens in the first call."""
    return min(sched.quantized_end(n, prompt), n) if n > 0 else 0


@dataclass(frozen=True)
class RowPositions:
    """Where the rows of a layer's batch stand: ``pads`` per row, ``prompt`` positions stored by the first call
    (row ``b``'s prompt: ``prompt - pads[b]`` real tokens), ``n_stored`` positions stored, ``[0, evicted)``
    forgotten (sliding-window layers). Hashable: flush plans are shared by the layers of one cache under it."""

    pads: tuple[int, ...]
    prompt: int
    n_stored: int
    evicted: int

    def _row(self, sched: Schedule, pad: int) -> tuple[int, int]:
        """(real tokens held, where the quantized ones end) of the row padded by ``pad``."""
        n = self.n_stored - pad
        return n, quantized_end(sched, n, self.prompt - pad)

    def quantized_end(self, sched: Schedule, row: int) -> int:
        """Stored position where row ``row``'s quantized tokens end (``sink_tokens`` of its real tokens before
        any)."""
        pad = self.pads[row]
        n = max(self.n_stored - pad, 0)
        return pad + max(quantized_end(sched, n, self.prompt - pad), sched.sink_tokens)

    def flush_plan(self, sched: Schedule, n0: int) -> FlushPlan:
        """Which stored positions each row quantizes in a call from ``n0`` to ``n_stored`` positions: ``(rows,
        start, end)`` groups (rows quantizing the same positions together). Per row, in its real tokens: from where
        its quantized tokens ended (or, later, from where the window evicted) to ``Schedule.quantized_end``."""
        groups: dict[tuple[int, int], list[int]] = {}
        S = sched.sink_tokens
        for b, pad in enumerate(self.pads):
            prompt = self.prompt - pad
            lo = max(self.evicted - pad, 0)
            start = max(quantized_end(sched, max(n0 - pad, 0), prompt), S, lo)
            end = quantized_end(sched, self.n_stored - pad, prompt)
            if end > start:
                groups.setdefault((pad + start, pad + end), []).append(b)
        return tuple((tuple(rows), a, e) for (a, e), rows in groups.items())

    def full_precision_tokens(self, sched: Schedule, quantizes: bool) -> int:
        """Real tokens held in full precision, summed over the rows: sinks and residual window not yet evicted
        (every held token when the tensor is not quantized, ``quantizes`` False)."""
        total, S = 0, sched.sink_tokens
        for pad in self.pads:
            lo = max(self.evicted - pad, 0)
            if not quantizes:
                total += max(self.n_stored - pad - lo, 0)
                continue
            n, q_end = self._row(sched, pad)
            total += max(min(S, n) - lo, 0) + max(n - max(q_end, lo), 0)
        return total

    def unquantized(self, sched: Schedule, quantizes: bool) -> tuple[dict[int, list[int]], list[Span]]:
        """What each row holds in full precision, in stored positions: (``{start: rows}``: the rows whose positions
        ``[start, n_stored)`` are not quantized, ``[(row, start, end)]``: a row's sinks still held). No padding
        position, none before ``evicted``."""
        starts: dict[int, list[int]] = {}
        sinks: list[Span] = []
        S, lo = sched.sink_tokens, self.evicted
        for b, pad in enumerate(self.pads):
            q_end = self._row(sched, pad)[1] if quantizes else 0
            if q_end <= S:  # nothing of this row is quantized: all of it is held as is
                starts.setdefault(max(pad, lo), []).append(b)
                continue
            starts.setdefault(max(pad + q_end, lo), []).append(b)
            if pad + S > max(pad, lo):
                sinks.append((b, max(pad, lo), pad + S))
        return starts, sinks


def row_pads(left_padding: list[int] | None, batch: int) -> list[int]:
    """Each row's padding positions for a batch of ``batch`` rows: ``left_padding``, or none (0 per row).
    KvevalError when ``left_padding`` gives another number of rows (beam search and ``num_return_sequences``
    repeat the rows, which the cache does not model)."""
    pads = left_padding if left_padding is not None else [0] * batch
    if len(pads) != batch:
        why = ("; beam search and num_return_sequences repeat the rows, which QuantizedKVCache does not model: "
               "generate with num_beams=1, one sequence per prompt"
               if batch > len(pads) and batch % len(pads) == 0 else "")
        raise KvevalError(f"left_padding has {len(pads)} rows; the batch has {batch}{why}")
    return pads
