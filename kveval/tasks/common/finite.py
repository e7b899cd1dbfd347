"""NaN or infinity in what a task scores: the one check every task runs, and the one line it stops the run with.

A task never writes a NaN metric silently: before a unit of work is recorded, the logits it scores pass
:func:`check_finite_logits` (and generation passes :func:`finite_generation`, a logits processor), so a run whose
model or quantizer produces NaN or infinity stops with one :class:`KvevalError` line (exit status 2) that says
whose fault it is, and nothing non-finite reaches ``records.jsonl``, ``metrics.json`` or a scan's cells:

* the full-precision model's own logits (``quantized_by=None``): the model overflows in its dtype (its weights
  or activations; float16 typically), nothing kveval can fix;
* the logits under a policy (``quantized_by="policy 'int8'"``, a scan cell...) where the baseline's are finite: a
  fault of the quantizer or of the emulation (a bug to report);
* the keys or values handed to a quantizer (the quantizers raise ``ValueError(NONFINITE)``):
  :func:`finite_quantizer_inputs` turns that into the same kind of line.

Helpers of the task modules (the leading underscore keeps the task registry from taking this for a task); torch
only, so that importing a task module stays light.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from kveval.errors import KvevalError
from kveval.quant.formats.base import NONFINITE, all_finite

_NARROW_DTYPES = ("float16", "bfloat16")


def non_finite_kind(values: torch.Tensor) -> str | None:
    """None when every element of ``values`` is finite, else what is wrong: ``"NaN"`` (when any element is NaN)
    or ``"infinity"`` (``all_finite``: one sum answers the common case)."""
    if all_finite(values):
        return None
    return "NaN" if bool(torch.isnan(values).any()) else "infinity"


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` or ``"float16"`` -> ``"float16"`` (for messages)."""
    return str(dtype).removeprefix("torch.")


def model_fault(kind: str, where: str, dtype: Any) -> KvevalError:
    """The line for non-finite logits of the model itself (no KV quantization involved)."""
    dtype = dtype_name(dtype)
    why = (f"the model overflows in {dtype} (its weights or activations); try model.dtype float32, or another model"
           if dtype in _NARROW_DTYPES else
           f"the model's weights or activations overflow even in {dtype}; try another model")
    return KvevalError(f"the model's own logits hold {kind} in {where} without any KV quantization: {why}")


def quantizer_fault(kind: str, where: str, quantized_by: str) -> KvevalError:
    """The line for non-finite logits under a KV quantization (``quantized_by``: ``"policy 'int8'"``, a scan cell)
    whose full-precision counterpart is finite."""
    return KvevalError(f"{quantized_by}: its logits hold {kind} in {where} where the baseline's are finite: a "
                       "fault of the quantizer or of the emulation under it (please report it)")


def check_finite_logits(logits: torch.Tensor, *, where: str, dtype: Any, quantized_by: str | None = None) -> None:
    """Raise the one-line :class:`KvevalError` when ``logits`` hold NaN or infinity.

    ``where``: the unit of work in words (``"window 3 (corpus tokens 96-128)"``, ``"needle trial 0 (context 64,
    depth 0.5)"``); ``dtype``: the model's dtype (for the hint); ``quantized_by``: None for the model's own
    logits (the baseline: the model's fault), else what quantized the cache (``"policy 'int8'"``: the
    quantizer's or the emulation's fault).
    """
    kind = non_finite_kind(logits)
    if kind is None:
        return
    if quantized_by is None:
        raise model_fault(kind, where, dtype)
    raise quantizer_fault(kind, where, quantized_by)


@contextmanager
def finite_quantizer_inputs(where: str, quantized_by: str) -> Iterator[None]:
    """Within the block, a quantizer's refusal of NaN or infinity in its input (``ValueError(NONFINITE)``)
    becomes one :class:`KvevalError` line naming ``quantized_by`` and ``where``; other errors pass unchanged."""
    try:
        yield
    except ValueError as exc:
        if NONFINITE not in str(exc):
            raise
        raise KvevalError(f"{quantized_by}: the keys or values given to its quantizer hold NaN or infinity in "
                          f"{where} although the baseline's logits are finite") from None


def finite_generation(*, where: str, dtype: Any, quantized_by: str | None = None):
    """A transformers ``LogitsProcessorList`` for ``generate(logits_processor=...)`` that stops generation with
    the line of :func:`check_finite_logits` when a generated token's scores hold NaN or +infinity (then passes
    them on unchanged), so that greedy decoding never turns NaN logits into an answer silently. Minus infinity is
    let through: generation's own processors use it to rule tokens out (``min_new_tokens``, suppressed tokens)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class _FiniteLogits(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            if bool(torch.isnan(scores).any()):
                kind = "NaN"
            elif bool(torch.isposinf(scores).any()):
                kind = "infinity"
            else:
                return scores
            if quantized_by is None:
                raise model_fault(kind, where, dtype)
            raise quantizer_fault(kind, where, quantized_by)

    return LogitsProcessorList([_FiniteLogits()])


def non_finite_numbers(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of the float values in a (nested) mapping that are NaN or infinite, in order."""
    out: list[str] = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(non_finite_numbers(value, f"{name}."))
        elif isinstance(value, float) and not math.isfinite(value):
            out.append(name)
    return out


def quantized_by(policy) -> str | None:
    """What quantized the cache, for the non-finite check's message: None for the unpatched model."""
    return None if policy is None else f"policy '{policy.name}'"


__all__ = ["check_finite_logits", "dtype_name", "finite_generation", "finite_quantizer_inputs", "model_fault",
           "non_finite_kind", "non_finite_numbers", "quantized_by", "quantizer_fault"]
