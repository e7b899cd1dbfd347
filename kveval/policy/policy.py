"""KVPolicy: which QuantSpec the keys and values of each layer get, plus the full-precision windows.

A policy is pure data (no transformers import). It answers two questions for the patching code:

* ``specs_for_layer(i, num_layers) -> (key_spec, value_spec)``: per-layer mixed precision;
* ``full_precision_mask(...)``: which cached tokens a query sees in full precision (residual window, sinks,
  prefill) and which it sees quantized. Emulation and the real cache both derive their behaviour from it.

Semantics of the windows, for a query decoded at position ``t`` (the cache then holds tokens ``0..t``):

* ``sink_tokens = S``: tokens ``j < S`` are always full precision (StreamingLLM attention sinks).
* ``residual_mode = "sliding"``, ``residual = R``: the ``R`` most recent tokens (``j > t - R``) are full precision;
  a token is quantized when it leaves the window. ``R = 0``: every token is quantized as soon as it is stored.
* ``residual_mode = "sliding_lag"`` (KIVI's values): as sliding, but a step reads before the oldest token leaves
  the window: a query reads the ``R + 1`` newest tokens in full precision (its own included).
* ``residual_mode = "block"`` (KIVI's keys): tokens after the sinks wait in full precision until ``R`` of them have
  accumulated; the query that completes a block still reads it in full precision, and the block is quantized after
  that step (read, then flush). Per-channel statistics are taken over such a block (or over groups of
  ``group_size`` tokens inside it), so they never use tokens after the query.
* ``residual_mode = "prompt_block"`` (transformers' QuantizedCache): the prompt is read in full precision and
  quantized at the end of its call; then blocks of ``R`` tokens counted from the prompt end, as ``block``.
* ``residual_mode = {key: MODE, value: MODE}``: keys and values follow different schedules (KIVI: keys ``block``,
  values ``sliding_lag``), with the same ``residual`` and ``sink_tokens``.
* ``prefill = "fp"``: queries of the prompt (the first ``prefill_len`` positions) attend to the prompt in full
  precision, as serving engines do; the prompt is stored quantized for the decode steps that follow.
  ``prefill = "quantized"``: the prompt queries attend to the cache as the prefill call reads it (sliding: after
  storing the prompt; block: before flushing it, so in full precision).

``kveval.policy.masks`` is the one definition of this schedule; emulation, the real cache and the bill use it.

Calibrated (static) scales: ``scales: PATH`` names a scales file written by ``kveval calibrate`` (``auto``: the run
calibrates one itself on a slice of the corpus disjoint from the evaluation). Specs of granularity ``tensor``,
``head`` or ``channel`` then use the file's parameters for every token (a calibrated per-channel spec needs no
token blocks); token and group specs stay dynamic. ``pre_rope: true`` quantizes keys before the rotary embedding
(KVQuant): the cache stores pre-RoPE keys and rotates them again when they are read. It is the first transform of
the policy's sequence (``transform_sequence()``); ``transforms: [...]`` adds more (``kveval.transforms``: maps
applied to K/V before quantization and undone on read, with hooks on the query and the attention output).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kveval.errors import KvevalError, did_you_mean
from kveval.policy.checks import KINDS, check_spec, check_values, check_widths, resolve_modes, resolve_transforms
from kveval.policy.checks import PREFILL_MODES as PREFILL_MODES  # re-exported (kveval.policy)
from kveval.policy.masks import RESIDUAL_MODES as RESIDUAL_MODES  # re-exported (kveval.policy)
from kveval.policy.masks import Schedule
from kveval.policy.parse import policy_fields
from kveval.policy.presets import POLICY_PRESETS, policy_names
from kveval.policy.selectors import layers_of
from kveval.quant import QuantSpec, preset, preset_names
from kveval.transforms import KVTransform, PreRope, check_sequence, parse_transforms

AUTO_SCALES = "auto"


@dataclass(frozen=True)
class LayerOverride:
    """Specs for the layers named by ``selector``; ``None`` keeps the policy default for that tensor."""

    selector: str
    key: QuantSpec | None = None
    value: QuantSpec | None = None


def _with_rotation(params: dict[str, Any] | None, pre_rope: bool, transforms: Any, name: str) -> tuple:
    """``transforms`` with the ``rotate`` transform of a policy's ``rotate:`` key added: first when it keeps the
    cache rotated (the default without pre_rope), last when it is undone on read (the default with pre_rope)."""
    from kveval.transforms.rotate import Rotate

    given = parse_transforms(transforms, f"policy '{name}'.transforms") if not isinstance(transforms, tuple) \
        else transforms
    if params is None:
        return tuple(t for t in given if not isinstance(t, Rotate))
    params = {"keep": not pre_rope, **params}
    try:
        rotation = Rotate(**params)
    except (TypeError, ValueError) as exc:
        raise KvevalError(f"policy '{name}'.rotate: {exc}") from None
    rest = tuple(t for t in given if not isinstance(t, Rotate))
    return (rotation, *rest) if rotation.keep else (*rest, rotation)


@dataclass(frozen=True)
class KVPolicy:
    """A KV-cache quantization policy.

    Example: ``KVPolicy.preset("kivi2")``; ``KVPolicy.from_config({"key": "int4_g64", "value": "int8",
    "residual": 128, "layers": {"0-1": {"spec": "int8"}}})``.
    """

    name: str = "custom"
    key: QuantSpec = field(default_factory=lambda: QuantSpec(format="none"))
    value: QuantSpec = field(default_factory=lambda: QuantSpec(format="none"))
    layers: tuple[LayerOverride, ...] = ()
    residual: int = 0
    #: one mode for keys and values, or (key mode, value mode) when they differ (a ``{key, value}`` mapping in
    #: config form)
    residual_mode: str | tuple[str, str] = "sliding"
    sink_tokens: int = 0
    prefill: str = "fp"
    scales: str | None = None
    pre_rope: bool = False
    transforms: tuple[KVTransform, ...] = ()
    #: keep sliding-window layers in full precision (vLLM ``--kv-cache-dtype-skip-layers sliding_window``)
    skip_sliding: bool = False
    #: what an MLA model's cache holds (kveval.memory.arch): ``latent`` (c_kv and k_pe, as engines store them: the
    #: key spec quantizes c_kv, the value spec k_pe) or ``decompressed`` (per-head K/V as attention sees them;
    #: emulation only). Other models ignore it.
    mla: str = "latent"
    #: the attention designs the system a preset is named after supports (``kveval.memory.fit.DESIGNS``: ``gqa``,
    #: ``sliding``, ``chunked``, ``state``, ``sinks``, ``mla`` or ``mla:RANK:ROPE``); empty: any design. A model
    #: with a design outside them is refused in one line (``kveval.memory.fit.check_design``).
    designs: tuple[str, ...] = ()

    def __post_init__(self):
        """Fields given in config form resolved, then every field checked (``kveval.policy.checks``)."""
        pre_rope, transforms = resolve_transforms(self.transforms, self.pre_rope, self.name)
        object.__setattr__(self, "pre_rope", pre_rope)
        object.__setattr__(self, "transforms", transforms)
        check_sequence(self.transform_sequence(), f"policy '{self.name}'")
        if self.residual < 0 or self.sink_tokens < 0:
            raise KvevalError(f"policy '{self.name}': residual and sink_tokens must be >= 0")
        object.__setattr__(self, "residual_mode", resolve_modes(self.residual_mode, self.name))
        check_values(self.name, self.prefill, self.scales, [self.schedule(kind) for kind in KINDS])
        for kind, spec in self.kind_specs():
            check_spec(self.name, kind, spec, self.schedule(kind), static=self.uses_static(spec))

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> KVPolicy:
        """A named policy (``kveval ls`` lists them): the policy presets below, or any QuantSpec preset used for K and V."""
        if name in POLICY_PRESETS:
            return cls.from_config(POLICY_PRESETS[name][0], name=name)
        if name in preset_names():
            spec = preset(name)
            return cls(name=name, key=spec, value=spec)
        raise KvevalError(
            f"unknown KV policy '{name}'{did_you_mean(name, policy_names())} (kveval ls lists the presets)"
        )

    @classmethod
    def from_config(cls, cfg: dict | str, name: str | None = None) -> KVPolicy:
        """A policy from its config form (``kveval.policy.parse``): a preset name, or a mapping with the keys
        ``preset, key, value, spec (both), layers, residual, residual_mode, sink_tokens, prefill, scales, pre_rope,
        transforms``."""
        if isinstance(cfg, str):
            policy = cls.preset(cfg)
            return replace(policy, name=name) if name else policy
        if not isinstance(cfg, dict):
            raise KvevalError(f"policy '{name}': expected a preset name or a mapping, got {cfg!r}")
        fields = policy_fields(cfg, f"policy '{name or 'custom'}'")
        if "layers" in fields:
            fields["layers"] = tuple(LayerOverride(sel, k, v) for sel, k, v in fields["layers"])
        base = cls.preset(cfg["preset"]) if "preset" in cfg else cls()
        if "rotate" in fields:
            fields["transforms"] = _with_rotation(fields.pop("rotate"), fields.get("pre_rope", base.pre_rope),
                                                  fields.get("transforms", base.transforms), name or "custom")
        return replace(base, name=name or (cfg.get("preset") or "custom"), **fields)

    def to_config(self) -> dict:
        """The config form (plain data) of this policy; ``from_config(p.to_config())`` gives back ``p``."""
        out: dict[str, Any] = {
            "key": self.key.to_dict(),
            "value": self.value.to_dict(),
            "residual": self.residual,
            "residual_mode": (dict(zip(KINDS, self.residual_mode)) if isinstance(self.residual_mode, tuple)
                              else self.residual_mode),
            "sink_tokens": self.sink_tokens,
            "prefill": self.prefill,
        }
        if self.scales is not None:
            out["scales"] = self.scales
        if self.pre_rope:
            out["pre_rope"] = True
        if self.transforms:
            out["transforms"] = [t.to_config() for t in self.transforms]
        if self.skip_sliding:
            out["skip_sliding"] = True
        if self.mla != "latent":
            out["mla"] = self.mla
        if self.designs:
            out["designs"] = list(self.designs)
        if self.layers:
            out["layers"] = {
                o.selector: {k: s.to_dict() for k, s in (("key", o.key), ("value", o.value)) if s is not None}
                for o in self.layers
            }
        return out

    # --- queries ------------------------------------------------------------------------------------------------
    def transform_sequence(self) -> tuple[KVTransform, ...]:
        """The K/V transforms in the order they apply before quantization: ``pre_rope`` first when set, then
        ``transforms``."""
        return ((PreRope(),) if self.pre_rope else ()) + self.transforms

    def mode(self, kind: str) -> str:
        """The residual mode of ``kind`` (``"key"`` or ``"value"``)."""
        if isinstance(self.residual_mode, tuple):
            return self.residual_mode[KINDS.index(kind)]
        return self.residual_mode

    @property
    def split_modes(self) -> bool:
        """Whether keys and values follow different schedules."""
        return isinstance(self.residual_mode, tuple)

    def schedule(self, kind: str) -> Schedule:
        """``kind``'s schedule (``kveval.policy.masks.Schedule``): this policy's sinks and residual, its mode."""
        return Schedule(self.sink_tokens, self.residual, self.mode(kind))

    def kind_specs(self) -> list[tuple[str, QuantSpec]]:
        """(``"key"``/``"value"``, spec) of every spec of the policy, layer overrides included."""
        out = [("key", self.key), ("value", self.value)]
        for o in self.layers:
            out.extend((kind, s) for kind, s in (("key", o.key), ("value", o.value)) if s is not None)
        return out

    def all_specs(self) -> list[QuantSpec]:
        return [s for _, s in self.kind_specs()]

    def specs_for_layer(self, layer: int, num_layers: int,
                        sliding_layers: tuple[int, ...] | list[int] | None = None) -> tuple[QuantSpec, QuantSpec]:
        """(key_spec, value_spec) of one layer; later overrides win over earlier ones. With ``skip_sliding`` a
        layer in ``sliding_layers`` (the model's sliding-window layers) is full precision; such a policy needs
        them (None: unknown, KvevalError)."""
        if self.skip_sliding:
            if sliding_layers is None:
                raise KvevalError(f"policy '{self.name}': skip_sliding needs the model's sliding-window layers")
            if layer in sliding_layers:
                none = QuantSpec(format="none")
                return none, none
        key, value = self.key, self.value
        for o in self.layers:
            if layer in layers_of(o.selector, num_layers):
                key = o.key or key
                value = o.value or value
        return key, value

    @property
    def is_none(self) -> bool:
        """True when no tensor of any layer is quantized (the policy is the full-precision baseline)."""
        return all(s.is_none for s in self.all_specs())

    def uses_static(self, spec: QuantSpec) -> bool:
        """Whether ``spec`` takes its parameters from the policy's scales file (tensor, head, channel granularity,
        a format that takes calibrated parameters: ``spec.calibratable``)."""
        return self.scales is not None and spec.calibratable

    def needs_scales_file(self) -> bool:
        """Whether any spec of the policy reads the scales file."""
        return any(self.uses_static(s) for s in self.all_specs())

    def check_model(self, num_layers: int, head_dim: int, value_dim: int | None = None, note: str = "") -> None:
        """Errors that need the model's shape: layer selectors in range, group sizes that divide the width of what
        each spec quantizes (``head_dim`` for keys, ``value_dim``, default ``head_dim``, for values), transforms
        that cannot act on it (``KVTransform.check_head_dim``). ``note`` ends the error line (what the widths are,
        on a model where they are not the head dimension)."""
        for o in self.layers:
            layers_of(o.selector, num_layers)
        dims = {"key": head_dim, "value": head_dim if value_dim is None else value_dim}
        check_widths(self.name, self.kind_specs(), self.transform_sequence(), dims, note)

    def describe(self) -> str:
        """A one-line human description, e.g. ``K int4 asym g64 (fp16 scales) / V int8 ..., residual 128 (block)``."""
        kv = (
            f"K/V {self.key.describe()}" if self.key == self.value
            else f"K {self.key.describe()} / V {self.value.describe()}"
        )
        extra = []
        if self.residual:
            modes = (f"K {self.mode('key')}, V {self.mode('value')}" if self.split_modes
                     else str(self.residual_mode))
            extra.append(f"residual {self.residual} ({modes})")
        if self.sink_tokens:
            extra.append(f"{self.sink_tokens} sink tokens")
        if self.layers:
            extra.append(f"{len(self.layers)} layer override(s)")
        if self.pre_rope:
            extra.append("pre-RoPE keys")
        if self.skip_sliding:
            extra.append("sliding-window layers in full precision")
        if self.transforms:
            extra.append("transforms " + " > ".join(t.describe() for t in self.transforms))
        if self.needs_scales_file():
            extra.append("calibrated scales" + ("" if self.scales == AUTO_SCALES else f" ({self.scales})"))
        return ", ".join([kv, *extra])

    def has_full_precision_tokens(self, prefill_len: int = 0) -> bool:
        """Whether any query sees any earlier-or-same token in full precision (else every read is quantized)."""
        return self.residual > 0 or self.sink_tokens > 0 or (prefill_len > 0 and self.prefill == "fp")

    def _kind(self, kind: str | None) -> str:
        if kind is None:
            if self.split_modes:
                raise KvevalError(f"policy '{self.name}': keys and values follow different schedules; name the kind")
            return "key"
        if kind not in KINDS:
            raise KvevalError(f"kind must be one of {KINDS}; got {kind!r}")
        return kind

    def full_precision_mask(
        self, q_len: int, kv_len: int, prefill_len: int = 0, device: torch.device | str = "cpu",
        kind: str | None = None,
    ) -> torch.Tensor:
        """Bool ``[q_len, kv_len]``: which (query, token) pairs read the full-precision key (``kind="key"``) or
        value (``kind="value"``; ``None``: both, when they share a schedule), ``Schedule.full_precision_mask``."""
        return self.schedule(self._kind(kind)).full_precision_mask(q_len, kv_len, prefill=self.prefill,
                                                                   prefill_len=prefill_len, device=device)

    def quantized_block_end(self, n_stored: int, kind: str | None = None, prompt: int = 1) -> int:
        """Tokens ``[sink_tokens, end)`` of ``kind`` are held quantized once ``n_stored`` tokens are cached, the
        first call having stored ``prompt`` of them (``Schedule.quantized_end``)."""
        return self.schedule(self._kind(kind)).quantized_end(n_stored, prompt)
