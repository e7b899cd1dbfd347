"""KVPolicy: which QuantSpec the keys and values of each layer get, plus the full-precision windows.

A policy is pure data (no transformers import). It answers two questions for the patching code:

* ``specs_for_layer(i, num_layers) -> (key_spec, value_spec)``: per-layer mixed precision;
* ``full_precision_mask(...)``: which cached tokens a query sees in full precision (residual window, sinks,
  prefill) and which it sees quantized. Emulation and the real cache both derive their behaviour from it.

Semantics of the windows, for a query decoded at position ``t`` (the cache then holds tokens ``0..t``):

* ``sink_tokens = S``: tokens ``j < S`` are always full precision (StreamingLLM attention sinks).
* ``residual_mode = "sliding"``, ``residual = R``: the ``R`` most recent tokens (``j > t - R``) are full precision;
  a token is quantized when it leaves the window. ``R = 0``: every token is quantized as soon as it is stored.
* ``residual_mode = "block"`` (KIVI): tokens after the sinks wait in full precision until ``R`` of them have
  accumulated; then that block of ``R`` is quantized at once. Per-channel statistics are taken over such a block,
  so they never use tokens after the query.
* ``prefill = "fp"``: queries of the prompt (the first ``prefill_len`` positions) attend to the prompt in full
  precision, as serving engines do; the prompt is stored quantized for the decode steps that follow.
  ``prefill = "quantized"``: the prompt queries attend to the cache as it stands at the end of the prefill.

Calibrated (static) scales: ``scales: PATH`` names a scales file written by ``kveval calibrate`` (``auto``: the run
calibrates one itself on a slice of the corpus disjoint from the evaluation). Specs of granularity ``tensor``,
``head`` or ``channel`` then use the file's parameters for every token (a calibrated per-channel spec needs no
token blocks); token and group specs stay dynamic. ``pre_rope: true`` quantizes keys before the rotary embedding
(KVQuant): the cache stores pre-RoPE keys and rotates them again when they are read.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kveval.errors import KvevalError
from kveval.quant import QuantSpec, preset, preset_names

RESIDUAL_MODES = ("sliding", "block")
PREFILL_MODES = ("fp", "quantized")
_POLICY_KEYS = ("preset", "key", "value", "spec", "layers", "residual", "residual_mode", "sink_tokens", "prefill",
                "scales", "pre_rope")
AUTO_SCALES = "auto"
_OVERRIDE_KEYS = ("key", "value", "spec")


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


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
            spec = preset(base) if base else None
            if spec is None:
                return QuantSpec.from_dict(fields)
            return QuantSpec.from_dict({**spec.to_dict(), **fields})
        except (KeyError, ValueError, TypeError) as exc:
            raise KvevalError(f"{where}: {exc}") from None
    raise KvevalError(f"{where}: expected a preset name or a mapping of QuantSpec fields, got {value!r}")


def parse_layer_selector(selector: str | int, num_layers: int) -> list[int]:
    """Layer indices named by a selector.

    Accepted forms: ``5``, ``"5"``, ``"0-3"`` (inclusive), ``"0,2,7"``, ``"first 2"``, ``"last 4"``, ``"all"``.
    Negative numbers count from the end (``-1`` is the last layer).
    """
    text = str(selector).strip().lower()
    indices: list[int] = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        if part == "all":
            indices.extend(range(num_layers))
        elif m := re.fullmatch(r"(first|last)\s+(\d+)", part):
            n = int(m.group(2))
            indices.extend(range(min(n, num_layers)) if m.group(1) == "first" else range(max(num_layers - n, 0), num_layers))
        elif m := re.fullmatch(r"(\d+)\s*-\s*(\d+)", part):
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise KvevalError(f"layer range '{part}' is reversed; write it as '{hi}-{lo}'")
            indices.extend(range(lo, hi + 1))
        elif re.fullmatch(r"-?\d+", part):
            i = int(part)
            indices.append(i + num_layers if i < 0 else i)
        else:
            raise KvevalError(
                f"layer selector '{selector}' is not understood; use an index, '0-3', '0,2,5', 'first N', 'last N' or 'all'"
            )
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad:
        raise KvevalError(f"layer selector '{selector}' names layer {bad[0]}, but the model has {num_layers} layers (0-{num_layers - 1})")
    return sorted(set(indices))


@dataclass(frozen=True)
class LayerOverride:
    """Specs for the layers named by ``selector``; ``None`` keeps the policy default for that tensor."""

    selector: str
    key: QuantSpec | None = None
    value: QuantSpec | None = None


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
    residual_mode: str = "sliding"
    sink_tokens: int = 0
    prefill: str = "fp"
    scales: str | None = None
    pre_rope: bool = False

    def __post_init__(self):
        if self.residual < 0 or self.sink_tokens < 0:
            raise KvevalError(f"policy '{self.name}': residual and sink_tokens must be >= 0")
        if self.residual_mode not in RESIDUAL_MODES:
            raise KvevalError(f"policy '{self.name}': residual_mode must be one of {RESIDUAL_MODES}, got '{self.residual_mode}'")
        if self.prefill not in PREFILL_MODES:
            raise KvevalError(f"policy '{self.name}': prefill must be one of {PREFILL_MODES}, got '{self.prefill}'")
        if self.residual_mode == "block" and self.residual == 0:
            raise KvevalError(f"policy '{self.name}': residual_mode 'block' needs residual > 0 (the block size)")
        if self.scales is not None and (not isinstance(self.scales, str) or not self.scales.strip()):
            raise KvevalError(f"policy '{self.name}': scales must be a path to a scales file or 'auto'; got {self.scales!r}")
        for spec in self.all_specs():
            if spec.granularity == "channel" and not spec.is_none and self.scales is None:
                if self.residual_mode != "block":
                    raise KvevalError(
                        f"policy '{self.name}': per-channel quantization takes its statistics over a block of tokens; "
                        "set residual_mode: block and residual: N (e.g. 128, as KIVI does), or calibrate static "
                        "scales (scales: auto)"
                    )
            if spec.granularity in ("tensor", "head") and not spec.is_none and spec.static_scale is None \
                    and self.scales is None:
                raise KvevalError(
                    f"policy '{self.name}': '{spec.granularity}' granularity needs static scales (scales: auto, "
                    "scales: FILE from kveval calibrate, or static_scale: 1.0); dynamic per-tensor statistics would "
                    "look at tokens that are not decoded yet"
                )

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> KVPolicy:
        """A named policy (``kveval ls`` lists them): the policy presets below, or any QuantSpec preset used for K and V."""
        if name in POLICY_PRESETS:
            return cls.from_config(POLICY_PRESETS[name], name=name)
        if name in preset_names():
            spec = preset(name)
            return cls(name=name, key=spec, value=spec)
        raise KvevalError(
            f"unknown KV policy '{name}'{_suggest(name, policy_names())} (kveval ls lists the presets)"
        )

    @classmethod
    def from_config(cls, cfg: dict | str, name: str | None = None) -> KVPolicy:
        """A policy from its config form: a preset name, or a mapping with the keys
        ``preset, key, value, spec (both), layers, residual, residual_mode, sink_tokens, prefill``."""
        if isinstance(cfg, str):
            policy = cls.preset(cfg)
            return replace(policy, name=name) if name else policy
        if not isinstance(cfg, dict):
            raise KvevalError(f"policy '{name}': expected a preset name or a mapping, got {cfg!r}")
        where = f"policy '{name or 'custom'}'"
        for key in cfg:
            if key not in _POLICY_KEYS:
                raise KvevalError(f"{where}: unknown key '{key}'{_suggest(key, _POLICY_KEYS)}")
        base = cls.preset(cfg["preset"]) if "preset" in cfg else cls()
        fields: dict[str, Any] = {"name": name or (cfg.get("preset") or "custom")}
        if "spec" in cfg:
            fields["key"] = fields["value"] = parse_spec(cfg["spec"], f"{where}.spec")
        if "key" in cfg:
            fields["key"] = parse_spec(cfg["key"], f"{where}.key")
        if "value" in cfg:
            fields["value"] = parse_spec(cfg["value"], f"{where}.value")
        for key in ("residual", "sink_tokens"):
            if key in cfg:
                if not isinstance(cfg[key], int) or isinstance(cfg[key], bool):
                    raise KvevalError(f"{where}.{key}: expected an integer, got {cfg[key]!r}")
                fields[key] = cfg[key]
        for key in ("residual_mode", "prefill"):
            if key in cfg:
                fields[key] = str(cfg[key])
        if "scales" in cfg:
            if cfg["scales"] is not None and not isinstance(cfg["scales"], str):
                raise KvevalError(f"{where}.scales: expected a scales file path or 'auto', got {cfg['scales']!r}")
            fields["scales"] = cfg["scales"]
        if "pre_rope" in cfg:
            if not isinstance(cfg["pre_rope"], bool):
                raise KvevalError(f"{where}.pre_rope: expected true or false, got {cfg['pre_rope']!r}")
            fields["pre_rope"] = cfg["pre_rope"]
        if "layers" in cfg:
            fields["layers"] = _parse_overrides(cfg["layers"], where)
        return replace(base, **fields)

    def to_config(self) -> dict:
        """The config form (plain data) of this policy; ``from_config(p.to_config())`` gives back ``p``."""
        out: dict[str, Any] = {
            "key": self.key.to_dict(),
            "value": self.value.to_dict(),
            "residual": self.residual,
            "residual_mode": self.residual_mode,
            "sink_tokens": self.sink_tokens,
            "prefill": self.prefill,
        }
        if self.scales is not None:
            out["scales"] = self.scales
        if self.pre_rope:
            out["pre_rope"] = True
        if self.layers:
            out["layers"] = {
                o.selector: {k: s.to_dict() for k, s in (("key", o.key), ("value", o.value)) if s is not None}
                for o in self.layers
            }
        return out

    # --- queries ------------------------------------------------------------------------------------------------
    def all_specs(self) -> list[QuantSpec]:
        specs = [self.key, self.value]
        for o in self.layers:
            specs.extend(s for s in (o.key, o.value) if s is not None)
        return specs

    def specs_for_layer(self, layer: int, num_layers: int) -> tuple[QuantSpec, QuantSpec]:
        """(key_spec, value_spec) of one layer; later overrides win over earlier ones."""
        key, value = self.key, self.value
        for o in self.layers:
            if layer in parse_layer_selector(o.selector, num_layers):
                key = o.key or key
                value = o.value or value
        return key, value

    @property
    def is_none(self) -> bool:
        """True when no tensor of any layer is quantized (the policy is the full-precision baseline)."""
        return all(s.is_none for s in self.all_specs())

    def uses_static(self, spec: QuantSpec) -> bool:
        """Whether ``spec`` takes its parameters from the policy's scales file (tensor, head, channel granularity)."""
        return self.scales is not None and not spec.is_none and spec.ggml is None and \
            spec.granularity in ("tensor", "head", "channel")

    def needs_scales_file(self) -> bool:
        """Whether any spec of the policy reads the scales file."""
        return any(self.uses_static(s) for s in self.all_specs())

    def check_model(self, num_layers: int, head_dim: int) -> None:
        """Errors that need the model's shape: layer selectors in range, group sizes that divide head_dim."""
        for o in self.layers:
            parse_layer_selector(o.selector, num_layers)
        for spec in self.all_specs():
            try:
                spec.check_head_dim(head_dim)
            except ValueError as exc:
                raise KvevalError(f"policy '{self.name}': {exc}") from None

    def describe(self) -> str:
        """A one-line human description, e.g. ``K int4 asym g64 (fp16 scales) / V int8 ..., residual 128 (block)``."""
        kv = (
            f"K/V {self.key.describe()}" if self.key == self.value
            else f"K {self.key.describe()} / V {self.value.describe()}"
        )
        extra = []
        if self.residual:
            extra.append(f"residual {self.residual} ({self.residual_mode})")
        if self.sink_tokens:
            extra.append(f"{self.sink_tokens} sink tokens")
        if self.layers:
            extra.append(f"{len(self.layers)} layer override(s)")
        if self.pre_rope:
            extra.append("pre-RoPE keys")
        if self.needs_scales_file():
            extra.append("calibrated scales" + ("" if self.scales == AUTO_SCALES else f" ({self.scales})"))
        return ", ".join([kv, *extra])

    def has_full_precision_tokens(self, prefill_len: int = 0) -> bool:
        """Whether any query sees any earlier-or-same token in full precision (else every read is quantized)."""
        return self.residual > 0 or self.sink_tokens > 0 or (prefill_len > 0 and self.prefill == "fp")

    def full_precision_mask(
        self, q_len: int, kv_len: int, prefill_len: int = 0, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Which (query, key) pairs use the full-precision key/value.

        Queries are positions ``0..q_len-1``, keys ``0..kv_len-1`` (a single pass from position 0, ``q_len ==
        kv_len``). Returns a bool tensor ``[q_len, kv_len]``: True where query ``t`` sees token ``j`` in full
        precision in the real cache at the step that decodes ``t``. Entries with ``j > t`` are irrelevant (causal).

        Worked example: ``residual=2, sliding, sink_tokens=1``, query ``t=5`` sees tokens 0, 4, 5 in full precision
        and 1, 2, 3 quantized.
        """
        t = torch.arange(q_len, device=device)
        if prefill_len > 0:
            if self.prefill == "fp":
                # the prompt's queries attend to the prompt in full precision
                in_prefill = t < prefill_len
            else:
                in_prefill = torch.zeros_like(t, dtype=torch.bool)
            # during a prefill the cache answers every prompt query with its state at the end of the prompt
            t_state = torch.where(t < prefill_len, torch.full_like(t, prefill_len - 1), t)
        else:
            in_prefill = torch.zeros_like(t, dtype=torch.bool)
            t_state = t
        j = torch.arange(kv_len, device=device)
        S, R = self.sink_tokens, self.residual
        n_stored = (t_state + 1)[:, None]  # tokens in the cache at that step
        if self.residual_mode == "sliding":
            fp = j[None, :] >= n_stored - R
        else:
            complete = ((n_stored - S).clamp(min=0) // R) * R  # tokens after the sinks that sit in complete blocks
            fp = j[None, :] >= S + complete
        fp = fp | (j[None, :] < S) | in_prefill[:, None]
        return fp

    def quantized_block_end(self, n_stored: int) -> int:
        """In block mode: tokens ``[sink_tokens, end)`` sit in complete (quantized) blocks once ``n_stored`` tokens are
        cached. In sliding mode: tokens ``[sink_tokens, end)`` are quantized."""
        S, R = self.sink_tokens, self.residual
        if self.residual_mode == "block":
            return S + (max(n_stored - S, 0) // R) * R
        return max(n_stored - R, S)


_SELECTOR_PART = re.compile(r"all|(first|last)\s+\d+|\d+\s*-\s*\d+|-?\d+")


def _check_selector_syntax(selector) -> None:
    parts = [p.strip() for p in str(selector).strip().lower().split(",")]
    if not parts or not all(_SELECTOR_PART.fullmatch(p) for p in parts):
        raise KvevalError(
            f"layer selector '{selector}' is not understood; use an index, '0-3', '0,2,5', 'first N', 'last N' or 'all'"
        )


def _parse_overrides(layers: Any, where: str) -> tuple[LayerOverride, ...]:
    if not isinstance(layers, dict):
        raise KvevalError(f"{where}.layers: expected a mapping of layer selector -> {{key, value, spec}}")
    out = []
    for selector, body in layers.items():
        _check_selector_syntax(selector)  # the range is checked against the model later (check_model)
        w = f"{where}.layers['{selector}']"
        if isinstance(body, str):
            body = {"spec": body}
        if not isinstance(body, dict):
            raise KvevalError(f"{w}: expected a preset name or a mapping with key/value/spec")
        for k in body:
            if k not in _OVERRIDE_KEYS:
                raise KvevalError(f"{w}: unknown key '{k}'{_suggest(k, _OVERRIDE_KEYS)}")
        key = value = parse_spec(body["spec"], f"{w}.spec") if "spec" in body else None
        if "key" in body:
            key = parse_spec(body["key"], f"{w}.key")
        if "value" in body:
            value = parse_spec(body["value"], f"{w}.value")
        out.append(LayerOverride(selector=str(selector), key=key, value=value))
    return tuple(out)


# Policy presets: plain data in the same form as a config's policy entry.
POLICY_PRESETS: dict[str, dict] = {
    "fp16": {"spec": "none"},
    "int8": {"spec": "int8"},
    "int4_g32": {"spec": "int4_g32"},
    "int4_g64": {"spec": "int4_g64"},
    "int4_g128": {"spec": "int4_g128"},
    "int2_g32": {"spec": "int2_g32"},
    "k4v8": {"key": "int4_g64", "value": "int8"},
    "k8v4": {"key": "int8", "value": "int4_g64"},
    "kivi2": {"key": "int2_channel", "value": "int2_g32", "residual": 128, "residual_mode": "block"},
    "kivi4": {"key": "int4_channel", "value": "int4_g32", "residual": 128, "residual_mode": "block"},
    "fp8_e4m3": {"spec": "fp8_e4m3"},
    "q8_0": {"spec": "q8_0"},
    "q4_0": {"spec": "q4_0"},
    # serving engines (see docs/engines.md for what each reproduces and where it differs)
    "vllm_fp8": {"spec": "fp8_e4m3", "prefill": "quantized"},
    "vllm_fp8_per_head": {"spec": "fp8_e4m3_head", "scales": "auto", "prefill": "quantized"},
    "trtllm_int8": {"spec": "int8_tensor", "scales": "auto"},
    "llamacpp_q8_0": {"spec": "q8_0", "prefill": "quantized"},
    "llamacpp_q4_0": {"spec": "q4_0", "prefill": "quantized"},
    "hf_quanto_int4": {"spec": "int4_g64", "residual": 128, "residual_mode": "block"},
    "kvquant4_1pct": {"key": {"preset": "int4_channel", "outliers": 0.01},
                      "value": {"preset": "int4_token", "outliers": 0.01}, "pre_rope": True, "scales": "auto"},
}

POLICY_DESCRIPTIONS: dict[str, str] = {
    "fp16": "no quantization (the full-precision baseline)",
    "int8": "INT8 symmetric per-token keys and values",
    "int4_g32": "INT4 asymmetric, groups of 32, keys and values",
    "int4_g64": "INT4 asymmetric, groups of 64, keys and values",
    "int4_g128": "INT4 asymmetric, groups of 128, keys and values",
    "int2_g32": "INT2 asymmetric, groups of 32, keys and values",
    "k4v8": "keys INT4 g64, values INT8 per-token",
    "k8v4": "keys INT8 per-token, values INT4 g64",
    "kivi2": "KIVI 2-bit: keys per-channel, values per-token g32, 128-token full-precision residual (block mode)",
    "kivi4": "KIVI 4-bit: keys per-channel, values per-token g32, 128-token full-precision residual (block mode)",
    "fp8_e4m3": "FP8 E4M3 with a static scale of 1.0 (a plain saturating cast)",
    "q8_0": "llama.cpp -ctk q8_0 -ctv q8_0: blocks of 32, fp16 scale",
    "q4_0": "llama.cpp -ctk q4_0 -ctv q4_0: blocks of 32, fp16 scale",
    "vllm_fp8": "vLLM --kv-cache-dtype fp8: E4M3, per-tensor scale 1.0 (no checkpoint scales; add scales: auto "
                "to calibrate), prompt attends to the quantized cache",
    "vllm_fp8_per_head": "vLLM FP8 E4M3 with calibrated per-head scales (as llm-compressor writes them)",
    "trtllm_int8": "TensorRT-LLM INT8 KV cache: symmetric, one calibrated per-tensor scale per layer and K/V",
    "llamacpp_q8_0": "llama.cpp -ctk q8_0 -ctv q8_0 (the prompt reads the quantized cache too)",
    "llamacpp_q4_0": "llama.cpp -ctk q4_0 -ctv q4_0 (the prompt reads the quantized cache too)",
    "hf_quanto_int4": "transformers QuantizedCache (quanto, nbits 4, group 64, residual_length 128): prompt "
                      "attended in full precision, new tokens quantized in blocks of 128",
    "kvquant4_1pct": "KVQuant-4bit-1%: pre-RoPE per-channel keys with calibrated scales, per-token values, 1% "
                     "outliers of each vector kept exactly (uniform INT4 instead of KVQuant's non-uniform codes)",
}


def policy_names() -> list[str]:
    """Every name ``KVPolicy.preset`` accepts: policy presets, then QuantSpec presets."""
    return list(POLICY_PRESETS) + [n for n in preset_names() if n not in POLICY_PRESETS]
