"""The policies inspect measures: each candidate policy of the config as it is, its keys alone and its values alone
(which of the two causes the error), and the changes a finding may suggest, each a policy in config form (plain
data a config's ``kv: {policies: ...}`` takes, so that a suggestion is a runnable ``kveval run ... -s`` line).

A change that does not apply to a policy (a rotation on a policy that already transforms its keys, asymmetric
ranges on a format that has none, smaller groups on ggml's fixed blocks) is not offered; one that the policy checks
refuse is left out, with the reason (``variants``' second value).

``channel_key`` is KIVI's layout for the keys: a scale per channel over groups of 32 tokens, quantized 32 tokens at
a time (KIVI: 128), so the newest keys (up to 31) and the newest 32 values stay in full precision: it changes the
schedule too, the least that per-channel keys need.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kveval.errors import KvevalError
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec, preset
from kveval.quant.presets import preset_names

NONE = QuantSpec(format="none")
SMALL_GROUP = 32
SINKS = 4
#: the changes a finding can suggest (``Variant.change``), in the order they are tried
CHANGES = ("asymmetric_key", "asymmetric_value", "group_key", "group_value", "channel_key", "rotate", "sinks",
           "key_int8", "value_int8")
CHANNEL_BLOCK = 32  # keys per channel are quantized this many tokens at a time (KIVI: 128)


@dataclass(frozen=True)
class Variant:
    """A policy measured by inspect: ``base`` (the candidate's name), ``change`` (``as_is``, ``keys_only``,
    ``values_only`` or one of ``CHANGES``), ``config`` (config form) and ``policy``."""

    base: str
    change: str
    config: Any
    policy: KVPolicy

    @property
    def reports_logits(self) -> bool:
        """Whether inspect measures this variant's logit error: the candidate as it is (a change is judged by its
        attention output, and then by its KLD)."""
        return self.change == "as_is"

    @property
    def name(self) -> str:
        return self.base if self.change == "as_is" else f"{self.base}+{self.change}"


def spec_form(spec: QuantSpec) -> str | dict:
    """A spec as a config names it: its preset's name when one preset is exactly it, else its fields."""
    for name in preset_names():
        if preset(name) == spec:
            return name
    return {k: v for k, v in spec.to_dict().items() if v is not None}


def _alone(policy: KVPolicy, kind: str) -> KVPolicy:
    """``policy`` with only ``kind``'s tensors quantized (the other kind full precision, per-layer overrides too)."""
    if kind == "key":
        layers = tuple(replace(o, value=None) for o in policy.layers)
        return replace(policy, name=f"{policy.name}:keys", value=NONE, layers=layers)
    layers = tuple(replace(o, key=None) for o in policy.layers)
    return replace(policy, name=f"{policy.name}:values", key=NONE, layers=layers)


def _with(base_config: Any, **fields: Any) -> dict:
    """The config form of the base policy with ``fields`` replaced."""
    form = {"preset": base_config} if isinstance(base_config, str) else dict(base_config)
    form.update(fields)
    return form


def _int_spec(spec: QuantSpec) -> bool:
    return spec.format == "int" and spec.ggml is None and spec.granularity in ("token", "group")


def change_config(base_config: Any, policy: KVPolicy, change: str) -> dict | None:
    """The config form of ``change`` applied to ``policy`` (whose config form is ``base_config``), or None when the
    change does not apply to it."""
    kind = "key" if change.endswith("_key") or change == "key_int8" else "value"
    spec = getattr(policy, kind)
    if change.startswith("asymmetric"):
        if not _int_spec(spec) or spec.mapping != "symmetric":
            return None
        return _with(base_config, **{kind: spec_form(spec.replace(mapping="asymmetric"))})
    if change.startswith("group"):
        if not _int_spec(spec) or (spec.granularity == "group" and (spec.group_size or 0) <= SMALL_GROUP):
            return None
        if spec.granularity == "token" and spec.bits >= 8:
            return None
        return _with(base_config, **{kind: spec_form(spec.replace(granularity="group", group_size=SMALL_GROUP))})
    if change == "channel_key":  # KIVI's layout: a scale per channel over blocks of tokens, the newest in FP
        if not _int_spec(spec) or policy.residual or policy.mode("key") != "sliding" or policy.mode("value") != "sliding":
            return None
        channel = spec.replace(granularity="channel", group_size=SMALL_GROUP, mapping="asymmetric")
        return _with(base_config, key=spec_form(channel), residual=CHANNEL_BLOCK,
                     residual_mode={"key": "block", "value": "sliding"})
    if change == "rotate":
        if policy.transforms or policy.pre_rope or policy.is_none:
            return None
        return _with(base_config, rotate="hadamard")
    if change == "sinks":
        return None if policy.sink_tokens >= SINKS or policy.is_none else _with(base_config, sink_tokens=SINKS)
    if change in ("key_int8", "value_int8"):
        if spec.is_none or spec.bits >= 8 or getattr(policy, "value" if kind == "key" else "key").is_none:
            return None
        return _with(base_config, **{kind: "int8"})
    raise KvevalError(f"unknown change {change!r}; changes: {', '.join(CHANGES)}")


def protect_layers(base_config: Any, layers: list[int], spec: str = "int8") -> dict:
    """The base policy with ``layers`` kept at ``spec`` (a per-layer override, ``layers: {"0,3": {spec: int8}}``),
    after the overrides the policy already has (a preset's own included: ``layers`` replaces them in config form)."""
    form = _with(base_config)
    overrides = dict(KVPolicy.from_config(base_config).to_config().get("layers") or {})
    overrides[",".join(str(i) for i in sorted(layers))] = {"spec": spec}
    form["layers"] = overrides
    return form


def variants(name: str, base_config: Any, policy: KVPolicy) -> tuple[list[Variant], dict[str, str]]:
    """Every variant inspect measures for one candidate policy: as it is, its keys alone, its values alone, then
    each of ``CHANGES`` that applies; and the changes refused by the policy checks, with their reason."""
    out = [Variant(name, "as_is", base_config, policy)]
    refused: dict[str, str] = {}
    for kind in ("key", "value"):
        if not getattr(policy, kind).is_none or any(getattr(o, kind) is not None for o in policy.layers):
            alone = _alone(policy, kind)
            out.append(Variant(name, f"{kind}s_only", alone.to_config(), alone))
    for change in CHANGES:
        form = change_config(base_config, policy, change)
        if form is None:
            continue
        try:
            out.append(Variant(name, change, form, KVPolicy.from_config(form, name=f"{name}+{change}")))
        except KvevalError as exc:
            refused[change] = str(exc).splitlines()[0]
    return out, refused
