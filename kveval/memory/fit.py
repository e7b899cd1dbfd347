"""Whether a policy can act on a model, from the model's shape alone (pure; no transformers import): one
KvevalError line naming what does not fit and what to do.

- :func:`check_policy` (the bill, the real cache and the emulation): layer selectors in range, group sizes that
  divide the width of what each spec quantizes (``head_dim``; on an MLA model the latent ``kv_lora_rank`` for the
  key spec and ``qk_rope_head_dim`` for the value spec), per-channel token blocks no longer than a layer's window
  (sliding or chunked).
- :func:`check_design` (what kveval evaluates: the emulation and the real cache): the attention designs kveval
  models faithfully under this policy, and the designs the system a preset is named after supports
  (``KVPolicy.designs``).

A model's designs (:func:`model_designs`): ``gqa`` (per-head K/V: MHA, GQA, MQA), ``mla`` (a latent cache),
``sliding`` / ``chunked`` (layers that keep a window), ``state`` (linear-attention or Mamba layers holding a fixed
state), ``sinks`` (learned attention-sink logits, GPT-OSS).
"""

from __future__ import annotations

from kveval.errors import KvevalError
from kveval.memory.arch import Arch
from kveval.policy import KVPolicy
from kveval.policy.parse import DESIGNS

#: model types whose attention adds learned sink logits (parameters, not cache: ``s_aux`` in transformers)
SINK_MODEL_TYPES = frozenset({"gpt_oss"})


def model_designs(arch: Arch) -> tuple[str, ...]:
    """The attention designs of ``arch`` (module docstring), in ``DESIGNS`` order."""
    found = {"mla" if arch.mla is not None else "gqa"}
    if arch.sliding_layers:
        found.add("sliding")
    if arch.chunked_layers:
        found.add("chunked")
    if arch.state_layers:
        found.add("state")
    if arch.model_type in SINK_MODEL_TYPES:
        found.add("sinks")
    return tuple(d for d in DESIGNS if d in found)


_DESIGN_WORDS = {"gqa": "per-head K/V", "mla": "an MLA latent cache", "sliding": "sliding-window layers",
                 "chunked": "chunked-attention layers", "state": "linear-attention or Mamba layers",
                 "sinks": "learned attention sinks"}


def _widths_note(arch: Arch, layout: str) -> str:
    if arch.mla is None:
        return ""
    (_, dk), (_, dv) = arch.kv_shapes(layout)
    if layout == "latent":
        return (f" (on this MLA model the key spec quantizes the latent c_kv, {dk} wide, and the value spec the "
                f"RoPE part k_pe, {dv} wide)")
    return f" (decompressed MLA keys are {dk} wide, values {dv})"


def check_policy(arch: Arch, policy: KVPolicy) -> None:
    """KvevalError (one line) when ``policy`` cannot be laid out on ``arch`` (module docstring)."""
    (_, dk), (_, dv) = arch.kv_shapes(policy.mla)
    policy.check_model(arch.layers, dk, dv, _widths_note(arch, policy.mla))
    _check_windows(arch, policy)


def _check_windows(arch: Arch, policy: KVPolicy) -> None:
    """Refuse a policy whose per-channel token blocks (a dynamic channel spec, quantized ``residual`` tokens at a
    time) are longer than a sliding-window or chunked layer's window: the oldest tokens of a block would leave the
    window before the block is complete, and its statistics could not be those of the whole block."""
    for i in arch.kv_layers:
        window = arch.window(i)
        if window is None:
            continue
        what = "sliding window" if i in arch.sliding_layers else "attention chunk"
        for kind, spec in zip(("key", "value"), policy.specs_for_layer(i, arch.layers, arch.sliding_layers)):
            if spec.is_none or not spec.gran.token_blocks or policy.uses_static(spec):
                continue
            if policy.residual > window:
                raise KvevalError(
                    f"policy '{policy.name}': its {kind}s are quantized per channel in blocks of {policy.residual} "
                    f"tokens, longer than the {window}-token {what} of layer {i}; use residual <= {window} "
                    f"or a per-token {kind} spec on the {what.split()[0]} layers"
                )


def check_design(arch: Arch, policy: KVPolicy, real_cache: bool = False) -> None:
    """KvevalError (one line) when kveval cannot evaluate ``policy`` faithfully on ``arch``'s attention:

    - the designs of the system a preset is named after (``policy.designs``): a model with another design is
      refused (vLLM's ``fp8_ds_mla`` on a model without DeepSeek's 512 + 64 latent, transformers' QuantizedCache
      on sliding-window layers, ...);
    - MLA: K/V transforms (they act on per-head keys and queries; the latent is neither), keys and values on
      different schedules (c_kv feeds both the keys and the values), calibrated scales (kveval calibrates per-head
      K/V), and the ``decompressed`` layout in the real cache (transformers 5 caches the latent; the decompressed
      layout is an emulation of what attention sees);
    - transforms that need RoPE (pre-RoPE keys) on a model with partial rotary embeddings or layers without RoPE.
    """
    name = f"policy '{policy.name}'"
    if policy.designs:
        for design in model_designs(arch):
            if design in policy.designs:
                continue
            if design == "mla" and arch.mla is not None:
                m = arch.mla
                if f"mla:{m.kv_lora_rank}:{m.qk_rope_head_dim}" in policy.designs:
                    continue
                dims = [d for d in policy.designs if d.startswith("mla:")]
                if dims:
                    rank, rope = dims[0].split(":")[1:]
                    raise KvevalError(
                        f"{name} is written for an MLA latent of kv_lora_rank {rank} and qk_rope_head_dim {rope} "
                        f"(what its system's kernel accepts); this model's latent is {m.kv_lora_rank} + "
                        f"{m.qk_rope_head_dim}: use a generic spec on the latent (e.g. fp8_e4m3)")
            supported = ", ".join(_DESIGN_WORDS.get(d.split(":")[0], d) for d in policy.designs)
            raise KvevalError(f"{name} models a system that supports {supported} only; this model has "
                              f"{_DESIGN_WORDS[design]} (kveval memory --model shows its layers)")
    check_policy(arch, policy)
    transforms = policy.transform_sequence()
    if arch.mla is not None:
        if transforms:
            names = ", ".join(t.name for t in transforms)
            raise KvevalError(f"{name}: K/V transforms ({names}) are not modelled on an MLA model (they act on "
                              "per-head keys and queries; the cache holds the latent); use a policy without them")
        if policy.split_modes and policy.schedule("key") != policy.schedule("value"):
            raise KvevalError(f"{name}: keys and values on different schedules cannot be emulated on an MLA "
                              "latent (c_kv feeds both the keys and the values); use one residual_mode")
        if policy.needs_scales_file():
            raise KvevalError(f"{name}: calibrated scales are not modelled on an MLA latent (kveval calibrates "
                              "per-head K/V); use dynamic specs")
        if real_cache and policy.mla == "decompressed":
            raise KvevalError(f"{name}: mla: decompressed is an emulation of the per-head K/V attention sees; the "
                              "real cache holds what transformers caches, the latent (use mla: latent)")
    if any(t.needs_rope for t in transforms):
        if arch.partial_rotary != 1.0:
            raise KvevalError(f"{name}: pre-RoPE keys need RoPE on the whole head; this model rotates "
                              f"{arch.partial_rotary:g} of head_dim (partial rotary); use a policy without pre_rope")
        if arch.nope_layers:
            nope = ", ".join(map(str, arch.nope_layers[:4])) + (", ..." if len(arch.nope_layers) > 4 else "")
            raise KvevalError(f"{name}: pre-RoPE keys are not modelled on a model with layers without RoPE "
                              f"(NoPE layers {nope}); use a policy without pre_rope")


__all__ = ["SINK_MODEL_TYPES", "check_design", "check_policy", "model_designs"]
