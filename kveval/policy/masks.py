"""When a cached token is read quantized: the one schedule that emulation, the real cache and the memory bill share.

Pure functions of a policy's windows (``sink_tokens`` S, ``residual`` R, ``residual_mode``, ``prefill``); tensors
are torch bool masks. For a query decoded at position ``t`` (the cache then holds tokens ``0..t``):

* tokens ``j < S`` are always full precision (attention sinks);
* ``sliding``: the R most recent tokens (``j > t - R``) are full precision; a token is quantized when it leaves the
  window (R = 0: as soon as it is stored);
* ``block`` (KIVI): tokens after the sinks wait in full precision until R of them have accumulated, then that
  block of R is quantized at once;
* ``prefill == "fp"``: the prompt's queries (``t < prefill_len``) attend to the prompt in full precision; with
  ``"quantized"`` they attend to the cache as it stands at the end of the prompt.
"""

from __future__ import annotations

import torch


def quantized_end(n_stored: int, sink_tokens: int, residual: int, residual_mode: str) -> int:
    """Tokens ``[sink_tokens, end)`` are held quantized once ``n_stored`` tokens are cached.

    Sliding: ``max(n - R, S)``; block: ``S + floor((n - S) / R) * R`` (complete blocks only).
    Worked: S = 4, R = 128, block, n = 300 -> 4 + 2 * 128 = 260.
    """
    S, R = sink_tokens, residual
    if residual_mode == "block":
        return S + (max(n_stored - S, 0) // R) * R
    return max(n_stored - R, S)


def full_precision_mask(q_len: int, kv_len: int, *, sink_tokens: int, residual: int, residual_mode: str,
                        prefill: str, prefill_len: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[q_len, kv_len]``: True where query ``t`` sees token ``j`` in full precision in the real cache at the
    step that decodes ``t`` (a single pass from position 0). Entries with ``j > t`` are irrelevant (causal).

    Worked: ``residual=2, sliding, sink_tokens=1``: query ``t=5`` sees tokens 0, 4, 5 in full precision and 1, 2, 3
    quantized.
    """
    t = torch.arange(q_len, device=device)
    if prefill_len > 0:
        in_prefill = t < prefill_len if prefill == "fp" else torch.zeros_like(t, dtype=torch.bool)
        # during a prefill the cache answers every prompt query with its state at the end of the prompt
        t_state = torch.where(t < prefill_len, torch.full_like(t, prefill_len - 1), t)
    else:
        in_prefill = torch.zeros_like(t, dtype=torch.bool)
        t_state = t
    j = torch.arange(kv_len, device=device)
    S, R = sink_tokens, residual
    n_stored = (t_state + 1)[:, None]  # tokens in the cache at that step
    if residual_mode == "sliding":
        fp = j[None, :] >= n_stored - R
    else:
        complete = ((n_stored - S).clamp(min=0) // R) * R  # tokens after the sinks that sit in complete blocks
        fp = j[None, :] >= S + complete
    return fp | (j[None, :] < S) | in_prefill[:, None]
