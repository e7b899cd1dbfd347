"""When a cached token is read quantized: the one schedule that emulation, the real cache and the memory bill share.

Pure functions of one tensor's windows (``sink_tokens`` S, ``residual`` R, residual ``mode``) and of the policy's
``prefill``; tensors are torch bool masks. Keys and values may follow different schedules (KIVI); a ``Schedule``
holds one tensor's. The cache is filled by calls: the first call stores the prompt (``prompt`` tokens; 1 when
every token is decoded one at a time), each later call one token. For a query decoded at position ``t`` (the
cache then holds tokens ``0..t``):

* tokens ``j < S`` are always full precision (attention sinks);
* ``sliding`` (llama.cpp, vLLM; a full-precision window otherwise): a call stores its tokens, moves every token
  older than the R newest (after the sinks) into quantized storage, then its queries read: the R most recent
  tokens (``j > t - R``) are full precision (R = 0: a token is quantized as soon as it is stored);
* ``sliding_lag`` (KIVI's values, ``models/llama_kivi.py``): a call stores its tokens, its queries read, then the
  tokens older than the R newest are quantized: a query reads R + 1 tokens in full precision (``j >= t - R``, its
  own included) and R stay in full precision between calls;
* ``block`` (KIVI's keys): tokens after the sinks wait in full precision until R of them have accumulated; the
  call that completes a block still reads it in full precision (its own token included), and the block is
  quantized after that call, so from the next call on it is read quantized. Blocks are counted from the sinks;
* ``prompt_block`` (transformers' ``QuantizedCache``, ``cache_utils.py`` ``QuantizedLayer.update``): the first
  call's tokens (the prompt) are read in full precision and quantized at the end of that call; after it, blocks of
  R tokens counted from the prompt end, as ``block`` (the call that completes one reads it in full precision);
* ``prefill == "fp"``: the prompt's queries (``t < prefill_len``) attend to the prompt in full precision; with
  ``"quantized"`` they attend to the cache as the prefill call reads it (the modes that read before quantizing
  then read it in full precision too).

Every mode but ``sliding`` reads first and quantizes after (``READ_FIRST``). A call reads
``read_quantized_end(n_before, n_after)`` and leaves ``quantized_end(n_after)`` quantized (what the bill counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RESIDUAL_MODES = ("sliding", "sliding_lag", "block", "prompt_block")
#: modes whose calls read the cache before they quantize (the query that completes a block reads it in full
#: precision; KIVI's newest value leaves the window after the step that stored it)
READ_FIRST = ("sliding_lag", "block", "prompt_block")
#: modes that quantize whole blocks of R tokens (per-channel statistics are taken inside such a block)
BLOCK_MODES = ("block", "prompt_block")


@dataclass(frozen=True)
class Schedule:
    """One tensor's schedule: ``sink_tokens`` S, ``residual`` R and ``mode`` (one of ``RESIDUAL_MODES``).

    ``prompt`` arguments: the tokens the first call stored (``max(prefill_len, 1)``); only ``prompt_block`` depends
    on it.
    """

    sink_tokens: int = 0
    residual: int = 0
    mode: str = "sliding"

    @property
    def reads_first(self) -> bool:
        """Whether a call reads the cache before it quantizes (every mode but ``sliding``)."""
        return self.mode in READ_FIRST

    @property
    def blocks(self) -> bool:
        """Whether tokens are quantized in whole blocks of ``residual`` tokens (``block``, ``prompt_block``)."""
        return self.mode in BLOCK_MODES

    def origin(self, prompt: int) -> int:
        """``prompt_block``: where the blocks start, ``max(S, prompt)``; the other modes: S."""
        return max(self.sink_tokens, prompt) if self.mode == "prompt_block" else self.sink_tokens

    def quantized_end(self, n_stored: int, prompt: int = 1) -> int:
        """Tokens ``[sink_tokens, end)`` are held quantized once ``n_stored`` tokens are cached and the call that
        stored the last of them is over (what the memory bill counts).

        ``sliding``, ``sliding_lag``: ``max(n - R, S)``; ``block``: ``S + floor((n - S) / R) * R`` (complete blocks
        only); ``prompt_block``: S before the prompt is stored, then ``o + floor((n - o) / R) * R`` with
        ``o = max(S, prompt)``. Worked: S = 4, R = 128, block, n = 300 -> 4 + 2 * 128 = 260; prompt_block, S = 0,
        R = 128, prompt 1, n = 300 -> 1 + 2 * 128 = 257; prompt 200, n = 300 -> 200 (100 tokens in the residual).
        """
        S, R = self.sink_tokens, self.residual
        if self.mode == "block":
            return S + (max(n_stored - S, 0) // R) * R
        if self.mode == "prompt_block":
            if n_stored < prompt:
                return S
            o = self.origin(prompt)
            return o + (max(n_stored - o, 0) // R) * R
        return max(n_stored - R, S)

    def read_quantized_end(self, n_before: int, n_after: int, prompt: int = 1) -> int:
        """Tokens ``[sink_tokens, end)`` that the queries of a call read quantized, for a call that brings the cache
        from ``n_before`` to ``n_after`` tokens: ``quantized_end(n_after)`` for ``sliding`` (store, then read; R = 0:
        a token's own query reads it quantized, as llama.cpp and vLLM do), ``quantized_end(n_before)`` for the modes
        that read first. Worked: R = 4, block, no sinks: the call that stores token 3 (n 3 -> 4) reads tokens 0-3 in
        full precision; the call that stores token 4 (n 4 -> 5) reads 0-3 quantized.
        """
        return self.quantized_end(n_before if self.reads_first else n_after, prompt)

    def full_precision_mask(self, q_len: int, kv_len: int, *, prefill: str, prefill_len: int = 0,
                            device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool ``[q_len, kv_len]``: True where query ``t`` sees token ``j`` in full precision in the real cache at
        the step that decodes ``t`` (a single pass from position 0; the first call stores ``max(prefill_len, 1)``
        tokens, each later call one). Entries with ``j > t`` are irrelevant (causal).

        Worked: ``residual=2, sliding, sink_tokens=1``: query ``t=5`` sees tokens 0, 4, 5 in full precision and 1, 2,
        3 quantized; with ``sliding_lag`` it sees 0, 3, 4, 5.
        """
        t = torch.arange(q_len, device=device)
        in_prompt = t < prefill_len
        in_prefill = in_prompt if prefill == "fp" else torch.zeros_like(t, dtype=torch.bool)
        # the call that decodes t: the prefill call (0 -> prefill_len tokens) for a prompt query, else t -> t + 1
        n_before = torch.where(in_prompt, torch.zeros_like(t), t)[:, None]
        n_after = torch.where(in_prompt, torch.full_like(t, prefill_len), t + 1)[:, None]
        j = torch.arange(kv_len, device=device)[None, :]
        S, R = self.sink_tokens, self.residual
        n = n_before if self.reads_first else n_after
        if self.mode in ("sliding", "sliding_lag"):
            end = n - R
        elif self.mode == "block":
            end = S + ((n - S).clamp(min=0) // R) * R  # tokens after the sinks in blocks flushed before the call
        else:
            prompt = max(prefill_len, 1)
            o = self.origin(prompt)
            end = torch.where(n < prompt, torch.full_like(n, S), o + ((n - o).clamp(min=0) // R) * R)
        fp = j >= end
        return fp | (j < S) | in_prefill[:, None]


def quantized_end(n_stored: int, sink_tokens: int, residual: int, residual_mode: str, prompt: int = 1) -> int:
    """``Schedule(sink_tokens, residual, residual_mode).quantized_end(n_stored, prompt)``."""
    return Schedule(sink_tokens, residual, residual_mode).quantized_end(n_stored, prompt)


def read_quantized_end(n_before: int, n_after: int, sink_tokens: int, residual: int, residual_mode: str,
                       prompt: int = 1) -> int:
    """``Schedule(sink_tokens, residual, residual_mode).read_quantized_end(n_before, n_after, prompt)``."""
    return Schedule(sink_tokens, residual, residual_mode).read_quantized_end(n_before, n_after, prompt)


def full_precision_mask(q_len: int, kv_len: int, *, sink_tokens: int, residual: int, residual_mode: str,
                        prefill: str, prefill_len: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """``Schedule(sink_tokens, residual, residual_mode).full_precision_mask(...)``: bool ``[q_len, kv_len]``."""
    return Schedule(sink_tokens, residual, residual_mode).full_precision_mask(
        q_len, kv_len, prefill=prefill, prefill_len=prefill_len, device=device)
