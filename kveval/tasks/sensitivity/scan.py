"""The per-layer sensitivity scan's engine: prefix reuse and the naive reference (figures: kveval.report).

A scan cell quantizes one tensor (K or V) of one layer ``i`` with one spec, everything else at full precision.
Layers ``0..i-1`` then compute exactly what the baseline computed, so the cell needs only layers ``i..L-1``,
the final norm and the LM head, started from the baseline's hidden state at the input of layer ``i``:

    prefix = baseline_prefix(model, ids)                 # one FP pass; hidden [1, T, hidden] at each layer input
    logits = replay(model, prefix, i, cell_policy(i, "key", spec))   # == the naive full forward of the cell

``baseline_prefix`` records, with forward pre-hooks, the exact arguments each decoder layer was called with (hidden
state, causal mask, position embeddings, position ids), so per-layer masks (sliding-window layers) and rotary
embeddings are replayed as the model built them, not rebuilt here. The baseline pass runs under ``emulate`` with
an all-``none`` policy, so the captured mask is the one the emulated implementation expects.
Cost of a cell: ``(L - i) / L`` of the layers plus the head, about half of a full pass on average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.errors import KvevalError
from kveval.patch import emulate
from kveval.policy import KVPolicy, LayerOverride
from kveval.quant import QuantSpec, preset

TENSORS = ("key", "value")
_DROP_KWARGS = ("cache", "past_key_values", "past_key_value")


def cell_policy(layer: int, tensor: str, spec: QuantSpec | str) -> KVPolicy:
    """Only ``tensor`` ("key" or "value") of ``layer`` quantized with ``spec``; everything else full precision."""
    spec = preset(spec) if isinstance(spec, str) else spec
    override = LayerOverride(str(layer), **{tensor: spec})
    return KVPolicy(name=f"L{layer}.{tensor[0].upper()}", layers=(override,))


def _parts(model):
    """(decoder layers, final norm, lm head) of a decoder-only causal LM; KvevalError if it has another shape."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if layers is None or norm is None or head is None:
        raise KvevalError(
            f"{type(model).__name__}: prefix reuse needs decoder.layers, decoder.norm and an LM head; "
            "run the scan with naive: true (--naive)"
        )
    return layers, norm, head


def check_reusable(model) -> None:
    """Raise KvevalError when the model's structure is not one that ``replay`` can run."""
    _parts(model)


@dataclass
class Prefix:
    """The baseline pass of one window: ``inputs[i]`` is the hidden state entering layer i ``[1, T, hidden]``,
    ``kwargs[i]`` what else the layer got (mask, position embeddings); ``logits`` ``[1, T, vocab]``."""

    inputs: list
    kwargs: list
    logits: torch.Tensor


@torch.no_grad()
def baseline_prefix(model, ids: torch.Tensor, capture: bool = True) -> Prefix:
    """The full-precision forward pass of ``ids`` ``[1, T]``, with the inputs of every decoder layer when ``capture``."""
    layers = _parts(model)[0] if capture else []
    inputs: list = [None] * len(layers)
    kwargs: list = [None] * len(layers)

    def hook(index):
        def pre(_module, args, kw):
            hidden = args[0] if args else kw["hidden_states"]
            inputs[index] = hidden
            kwargs[index] = {k: v for k, v in kw.items() if k != "hidden_states" and k not in _DROP_KWARGS}
            kwargs[index]["use_cache"] = False

        return pre

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with emulate(model, KVPolicy(name="fp16")):
            logits = model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    if capture and any(x is None for x in inputs):
        raise KvevalError("prefix reuse: some decoder layers were not called with their inputs; use naive: true")
    return Prefix(inputs, kwargs, logits)


def _head(model, norm, head, hidden: torch.Tensor) -> torch.Tensor:
    logits = head(norm(hidden))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def replay(model, prefix: Prefix, start: int, policy: KVPolicy) -> torch.Tensor:
    """Logits ``[1, T, vocab]`` of the model under ``policy`` computed from layer ``start`` on.

    Exact only when ``policy`` quantizes nothing in layers ``< start`` (then those layers equal the baseline's).
    """
    layers, norm, head = _parts(model)
    n = len(layers)
    for i in range(start):
        if any(not s.is_none for s in policy.specs_for_layer(i, n)):
            raise ValueError(f"replay from layer {start}: policy '{policy.name}' quantizes layer {i}")
    hidden = prefix.inputs[start]
    with emulate(model, policy):
        for i in range(start, n):
            out = layers[i](hidden, **prefix.kwargs[i])
            hidden = out[0] if isinstance(out, tuple) else out
        return _head(model, norm, head, hidden)


@torch.no_grad()
def naive_logits(model, ids: torch.Tensor, policy: KVPolicy) -> torch.Tensor:
    """The reference: the full forward pass under ``policy`` (what ``replay`` must reproduce)."""
    with emulate(model, policy):
        return model(ids, use_cache=False).logits


def verify_replay(model, prefix: Prefix, rtol: float = 1e-4) -> float:
    """Replay the last layer at full precision and compare with the baseline logits (a cheap self-check that
    ``replay`` reproduces this model's forward); KvevalError if the relative gap exceeds ``rtol``."""
    n = len(prefix.inputs)
    again = replay(model, prefix, n - 1, KVPolicy(name="fp16"))
    gap = float((again - prefix.logits).abs().max() / prefix.logits.abs().max().clamp(min=1e-30))
    if gap > rtol:
        raise KvevalError(
            f"prefix reuse does not reproduce {type(model).__name__}'s forward pass (relative gap {gap:.2e}); "
            "run the scan with naive: true (--naive)"
        )
    return gap
