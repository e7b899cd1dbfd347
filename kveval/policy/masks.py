"""When a cached token is read quantized: the one schedule that emulation, the real cache and the memory bill share.

Pure functions of a policy's windows (``sink_tokens`` S, ``residual`` R, ``residual_mode``, ``prefill``); tensors
are torch bool masks. For a query decoded at position ``t`` (the cache then holds tokens ``0..t``):

* tokens ``j < S`` are always full precision (attention sinks);
* ``sliding``: the R most recent tokens (``j > t - R``) are full precision; a token is quantized when it leaves the
  window (R = 0: as soon as it is stored);
* ``block`` (KIVI, transformers' QuantizedCache): tokens after the sinks wait in full precision until R of them
  have accumulated; the step that completes a block still attends to it in full precision (its own key and value
  included), and the block is quantized after that step's attention, so from the next step on it is read
  quantized. A call reads the cache as it stood before the call's own flush;
* ``prefill == "fp"``: the prompt's queries (``t < prefill_len``) attend to the prompt in full precision; with
  ``"quantized"`` they attend to the cache as it stands at the end of the prompt.
"""

from __future__ import annotations

import torch


def quantized_end(n_stored: int, sink_tokens: int, residual: int, residual_mode: str) -> int:
    """Tokens ``[sink_tokens, end)`` are held quantized once ``n_stored`` tokens are cached and the step that
    stored the last of them is over (what the memory bill counts).

    Sliding: ``max(n - R, S)``; block: ``S + floor((n - S) / R) * R`` (complete blocks only).
    Worked: S = 4, R = 128, block, n = 300 -> 4 + 2 * 128 = 260.
    """
    S, R = sink_tokens, residual
    if residual_mode == "block":
        return S + (max(n_stored - S, 0) // R) * R
    return max(n_stored - R, S)


def read_quantized_end(n_before: int, n_after: int, sink_tokens: int, residual: int, residual_mode: str) -> int:
    """Tokens ``[sink_tokens, end)`` that the queries of a call read quantized, for a call that brings the cache
    from ``n_before`` to ``n_after`` tokens.

    Sliding: the call stores, then reads: ``quantized_end(n_after)`` (R = 0: a token's own query reads it
    quantized, as llama.cpp and vLLM do). Block: the call reads, then flushes complete blocks:
    ``quantized_end(n_before)`` (the query that completes a block reads it in full precision, as KIVI and
    transformers' QuantizedCache do). Worked: R = 4, block, no sinks: the call that stores token 3 (n 3 -> 4)
    reads tokens 0-3 in full precision; the call that stores token 4 (n 4 -> 5) reads 0-3 quantized.
    """
    n = n_before if residual_mode == "block" else n_after
    return quantized_end(n, sink_tokens, residual, residual_mode)


def full_precision_mask(q_len: int, kv_len: int, *, sink_tokens: int, residual: int, residual_mode: str,
                        prefill: str, prefill_len: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[q_len, kv_len]``: True where query ``t`` sees token ``j`` in full precision in the real cache at the
    step that decodes ``t`` (a single pass from position 0). Entries with ``j > t`` are irrelevant (causal).

    Worked: ``residual=2, sliding, sink_tokens=1``: query ``t=5`` sees tokens 0, 4, 5 in full precision and 1, 2, 3
    quantized.
    """
    t = torch.arange(q_len, device=device)
    in_prompt = t < prefill_len
    in_prefill = in_prompt if prefill == "fp" else torch.zeros_like(t, dtype=torch.bool)
    # the call that decodes t: the prefill call (0 -> prefill_len tokens) for a prompt query, else t -> t + 1
    n_before = torch.where(in_prompt, torch.zeros_like(t), t)[:, None]
    n_after = torch.where(in_prompt, torch.full_like(t, prefill_len), t + 1)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    S, R = sink_tokens, residual
    if residual_mode == "sliding":
        fp = j >= n_after - R
    else:
        complete = ((n_before - S).clamp(min=0) // R) * R  # tokens after the sinks in blocks flushed before the call
        fp = j >= S + complete
    return fp | (j < S) | in_prefill[:, None]
