"""The config form of a policy: plain data -> validated ``KVPolicy`` fields, every error one line with its path.

Accepted (a config's ``kv: {policies: {NAME: ...}}`` entry, or a preset's config in ``presets.py``)::

    int4_g64                                     # a preset name
    {preset: kivi2, residual: 64}                # a preset with fields replaced
    {key: int4_g64, value: int8, residual: 128, residual_mode: sliding, sink_tokens: 4, prefill: fp,
     scales: auto, pre_rope: true, layers: {"0-1": {spec: int8}, "last 2": {key: int8}}}
    {key: int2_channel, value: int2_g32, residual: 128, residual_mode: {key: block, value: sliding_lag}}
    {spec: int4_g64, transforms: [pre_rope, {name: NAME, PARAM: VALUE}]}   # K/V transforms, in order
    {spec: int4_g64, rotate: hadamard}           # a rotation on any policy (kveval.transforms.rotate)
    {spec: int4_g64, skip_sliding: true}         # sliding-window layers in full precision (vLLM skip-layers)
    {key: fp8_e4m3_g128, value: none, mla: latent}   # on an MLA model: key spec -> latent c_kv, value -> k_pe
    {spec: int4_g64, rotate: {kind: orthogonal, seed: 0, on: key}, pre_rope: true}   # pre-RoPE: undone on read

A spec is a QuantSpec preset name or a mapping of QuantSpec fields (``{preset: int4_channel, outliers: 0.01}``).
"""

from __future__ import annotations

from typing import Any

from kveval.errors import KvevalError, did_you_mean
from kveval.policy.selectors import check_syntax
from kveval.quant import QuantSpec, preset
from kveval.transforms import parse_transforms

POLICY_KEYS = ("preset", "key", "value", "spec", "layers", "residual", "residual_mode", "sink_tokens", "prefill",
               "scales", "pre_rope", "transforms", "rotate", "skip_sliding", "mla", "designs")
MLA_LAYOUTS = ("latent", "decompressed")
#: the attention designs a preset's ``designs`` may name (``kveval.memory.fit`` reads a model's)
DESIGNS = ("gqa", "sliding", "chunked", "state", "sinks", "mla")


def design_known(design: str) -> bool:
    """Whether ``design`` is one of ``DESIGNS`` or ``mla:RANK:ROPE`` (MLA with those latent and RoPE widths)."""
    if design in DESIGNS:
        return True
    parts = design.split(":")
    return len(parts) == 3 and parts[0] == "mla" and all(p.isdigit() and int(p) > 0 for p in parts[1:])
ROTATE_KEYS = ("kind", "block", "seed", "on", "keep")
OVERRIDE_KEYS = ("key", "value", "spec")


def parse_spec(value: Any, where: str) -> QuantSpec:
    """A QuantSpec from a preset name (``"int4_g64"``) or a dict of QuantSpec fields."""
    if isinstance(value, QuantSpec):
        return value
    if isinstance(value, str):
        try:
            return preset(value)
        except (KeyError, ValueError) as exc:
            raise KvevalError(f"{where}: {exc}") from None
    if isinstance(value, dict):
        base = value.get("preset")
        fields = {k: v for k, v in value.items() if k != "preset"}
        try:
            if not base:
                return QuantSpec.from_dict(fields)
            return QuantSpec.from_dict({**preset(base).to_dict(), **fields})
        except (KeyError, ValueError, TypeError) as exc:
            raise KvevalError(f"{where}: {exc}") from None
    raise KvevalError(f"{where}: expected a preset name or a mapping of QuantSpec fields, got {value!r}")


def policy_fields(cfg: dict, where: str) -> dict[str, Any]:
    """The KVPolicy fields a mapping sets (all but ``preset``, which the caller resolves to the base policy)."""
    for key in cfg:
        if key not in POLICY_KEYS:
            raise KvevalError(f"{where}: unknown key '{key}'{did_you_mean(key, POLICY_KEYS)}")
    fields: dict[str, Any] = {}
    if "spec" in cfg:
        fields["key"] = fields["value"] = parse_spec(cfg["spec"], f"{where}.spec")
    for kind in ("key", "value"):
        if kind in cfg:
            fields[kind] = parse_spec(cfg[kind], f"{where}.{kind}")
    for key in ("residual", "sink_tokens"):
        if key in cfg:
            if not isinstance(cfg[key], int) or isinstance(cfg[key], bool):
                raise KvevalError(f"{where}.{key}: expected an integer, got {cfg[key]!r}")
            fields[key] = cfg[key]
    if "residual_mode" in cfg:
        mode = cfg["residual_mode"]
        if isinstance(mode, dict):
            unknown = [k for k in mode if k not in ("key", "value")]
            if unknown or len(mode) != 2:
                raise KvevalError(f"{where}.residual_mode: a mapping needs exactly the keys 'key' and 'value'; "
                                  f"got {sorted(map(str, mode))}")
            fields["residual_mode"] = (str(mode["key"]), str(mode["value"]))
        else:
            fields["residual_mode"] = str(mode)
    if "prefill" in cfg:
        fields["prefill"] = str(cfg["prefill"])
    if "scales" in cfg:
        if cfg["scales"] is not None and not isinstance(cfg["scales"], str):
            raise KvevalError(f"{where}.scales: expected a scales file path or 'auto', got {cfg['scales']!r}")
        fields["scales"] = cfg["scales"]
    if "pre_rope" in cfg:
        if not isinstance(cfg["pre_rope"], bool):
            raise KvevalError(f"{where}.pre_rope: expected true or false, got {cfg['pre_rope']!r}")
        fields["pre_rope"] = cfg["pre_rope"]
    for key in ("pre_rope", "skip_sliding"):
        if key in cfg and not isinstance(cfg[key], bool):
            raise KvevalError(f"{where}.{key}: expected true or false, got {cfg[key]!r}")
    if "skip_sliding" in cfg:
        fields["skip_sliding"] = cfg["skip_sliding"]
    if "mla" in cfg:
        if cfg["mla"] not in MLA_LAYOUTS:
            raise KvevalError(f"{where}.mla: expected one of {', '.join(MLA_LAYOUTS)}, got {cfg['mla']!r}")
        fields["mla"] = cfg["mla"]
    if "designs" in cfg:
        designs = cfg["designs"]
        if not isinstance(designs, list) or not all(isinstance(d, str) and design_known(d) for d in designs):
            raise KvevalError(f"{where}.designs: expected a list of attention designs ({', '.join(DESIGNS)}, or "
                              f"mla:RANK:ROPE); got {designs!r}")
        fields["designs"] = tuple(designs)
    if "transforms" in cfg:
        fields["transforms"] = parse_transforms(cfg["transforms"] or [], f"{where}.transforms")
    if "rotate" in cfg:
        fields["rotate"] = parse_rotate(cfg["rotate"], f"{where}.rotate")
    if "layers" in cfg:
        fields["layers"] = parse_overrides(cfg["layers"], where)
    return fields


def parse_rotate(value: Any, where: str) -> dict[str, Any] | None:
    """``rotate: KIND`` or ``rotate: {kind, block, seed, on, keep}`` -> the ``rotate`` transform's parameters;
    ``rotate: none`` / ``false`` -> None (no rotation). ``KVPolicy.from_config`` adds the transform: first in the
    sequence when it keeps the cache rotated, last (after ``pre_rope``) when it is undone on read; ``keep``
    defaults to ``not pre_rope``."""
    from kveval.transforms.rotate import KINDS

    if value is None or value is False or value == "none":
        return None
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        raise KvevalError(f"{where}: expected a rotation kind ({', '.join(KINDS)}) or a mapping of "
                          f"{', '.join(ROTATE_KEYS)}; got {value!r}")
    for key in value:
        if key not in ROTATE_KEYS:
            raise KvevalError(f"{where}: unknown key '{key}'{did_you_mean(str(key), ROTATE_KEYS)}")
    kind = value.get("kind", "hadamard")
    if kind not in KINDS:
        raise KvevalError(f"{where}: unknown rotation '{kind}'{did_you_mean(str(kind), KINDS)} "
                          f"(known: {', '.join(KINDS)})")
    return dict(value)


def parse_overrides(layers: Any, where: str) -> list[tuple[str, QuantSpec | None, QuantSpec | None]]:
    """``layers: {SELECTOR: spec | {key, value, spec}}`` -> [(selector, key spec or None, value spec or None)]."""
    if not isinstance(layers, dict):
        raise KvevalError(f"{where}.layers: expected a mapping of layer selector -> {{key, value, spec}}")
    out = []
    for selector, body in layers.items():
        check_syntax(selector)  # the range is checked against the model later (KVPolicy.check_model)
        w = f"{where}.layers['{selector}']"
        if isinstance(body, str):
            body = {"spec": body}
        if not isinstance(body, dict):
            raise KvevalError(f"{w}: expected a preset name or a mapping with key/value/spec")
        for k in body:
            if k not in OVERRIDE_KEYS:
                raise KvevalError(f"{w}: unknown key '{k}'{did_you_mean(k, OVERRIDE_KEYS)}")
        key = value = parse_spec(body["spec"], f"{w}.spec") if "spec" in body else None
        if "key" in body:
            key = parse_spec(body["key"], f"{w}.key")
        if "value" in body:
            value = parse_spec(body["value"], f"{w}.value")
        out.append((str(selector), key, value))
    return out
