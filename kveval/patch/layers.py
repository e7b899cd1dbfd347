"""Which attention layers of a model kveval quantizes, and with what: :func:`model_quantizers`, shared by the
emulation and the real cache, after the checks that refuse a design kveval does not model
(``kveval.memory.fit.check_design``, run once per model, policy and kind of evaluation: :func:`checked_design`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kveval.errors import KvevalError
from kveval.memory.arch import Arch
from kveval.memory.fit import check_design
from kveval.patch.attention import attention_modules
from kveval.patch.quantizers import TensorQuantizer, layer_quantizers, model_type_of, policy_scales
from kveval.patch.rope_capture import track_rope
from kveval.policy import KVPolicy


@dataclass(frozen=True)
class ModelQuantizers:
    """What quantizes a model under a policy: its ``arch`` (``kveval.models.model_arch``), its attention modules by
    model layer index (``modules``; the layers that hold K/V), and each one's (key, value) quantizers."""

    arch: Arch
    modules: dict[int, torch.nn.Module]
    quantizers: dict[int, tuple[TensorQuantizer, TensorQuantizer]]

    @property
    def mla(self) -> bool:
        """Whether the model's attention is MLA (its cache holds the latent, ``kveval.memory.arch``)."""
        return self.arch.mla is not None


#: per model, the ``(arch, policy, real_cache)`` whose design check passed (``checked_design``); the entry goes
#: with its model
_PASSED: weakref.WeakKeyDictionary[torch.nn.Module, set[tuple[Arch, KVPolicy, bool]]] = weakref.WeakKeyDictionary()


def checked_design(model: torch.nn.Module, arch: Arch, policy: KVPolicy, real_cache: bool = False) -> None:
    """``check_design(arch, policy, real_cache)`` for ``model`` (``arch``: its ``model_arch``), once: the check is
    pure in its arguments, so one that passed is remembered per model and skipped when the same arch, an equal
    policy and the same ``real_cache`` come again (every ``emulate`` call of a run, once per batch and policy). A
    refused design is never remembered: it is refused at every call. A policy that cannot be hashed is checked
    every time."""
    key: tuple[Arch, KVPolicy, bool] | None = (arch, policy, real_cache)
    try:
        hash(key)
    except TypeError:  # an unhashable part of the policy: nothing to remember it by
        key = None
    passed = _PASSED.setdefault(model, set())
    if key in passed:
        return
    check_design(arch, policy, real_cache=real_cache)
    if key is not None:
        passed.add(key)


def model_quantizers(model, policy: KVPolicy, real_cache: bool = False) -> ModelQuantizers:
    """The quantizers of every attention layer of ``model`` under ``policy`` (shared by ``emulate`` and
    ``QuantizedKVCache``), after the checks that refuse what kveval cannot evaluate faithfully
    (``kveval.memory.fit.check_design``, once per model, policy and ``real_cache``: ``checked_design``;
    ``real_cache``: the checks of the real cache). Layer indices are the model's: a hybrid's attention layers keep
    their index, the linear-attention or Mamba layers between them have no quantizer. KvevalError (one line) when the model's attention modules are not the layers its config says
    hold K/V, or, on an MLA model, when its attention does not expand the latent through ``expand_kv`` (where
    kveval reads the latent)."""
    from kveval.models import model_arch

    arch = model_arch(model)
    checked_design(model, arch, policy, real_cache)
    found = attention_modules(model)
    if not found:
        raise KvevalError(f"{type(model).__name__}: no attention modules with a layer index found; cannot patch")
    modules = {m.layer_idx: m for m in found}
    if sorted(modules) != list(arch.kv_layers):
        raise KvevalError(
            f"{type(model).__name__}: its attention modules sit at layers {_short(sorted(modules))} but its config "
            f"says layers {_short(arch.kv_layers)} hold K/V; kveval does not model this design"
        )
    if arch.mla is not None:
        missing = [i for i, m in modules.items() if not callable(getattr(m, "expand_kv", None))]
        if missing:
            raise KvevalError(f"{type(model).__name__}: an MLA model whose attention has no expand_kv (layers "
                              f"{_short(missing)}); kveval cannot reach its latent")
    scales = policy_scales(policy, model)
    if any(t.needs_rope for t in policy.transform_sequence()):
        track_rope(model)
    model_type = model_type_of(model)
    quantizers = {i: layer_quantizers(policy, i, arch.layers, scales, model.device, model_type, arch.sliding_layers)
                  for i in modules}
    return ModelQuantizers(arch, modules, quantizers)


def _short(layers) -> str:
    layers = list(layers)
    return ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")


__all__ = ["ModelQuantizers", "checked_design", "model_quantizers"]
