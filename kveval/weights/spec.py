"""Weight variants: what ``model.weights`` in a config names (plain data; the maths is in ``quantize``).

A variant is a name, a QuantSpec (``quantize`` says how a spec reads on a weight matrix ``[out, in]``) and the
module groups it covers::

    model:
      name: builtin:smollm2-135m
      weights: [int8_channel, int4_g64]               # one variant per preset, named after it
      # or {w4: {spec: int4_g64, modules: [attention, mlp, lm_head]}, w8: int8_channel}

The checkpoint's own weights are always the reference (named ``fp`` in tables); a variant name must not be ``fp``
or ``none``. ``weights: none`` (or leaving it out) runs the checkpoint alone.

Specs: the weight presets below (``WEIGHT_PRESETS``), any K/V preset of ``kveval ls`` (``int4_g64``, ``q4_0``...:
the same spec read on weight rows), or a mapping of QuantSpec fields (``{format: int, bits: 4, mapping:
symmetric, granularity: group, group_size: 32}``, optionally ``preset: NAME`` plus fields to change).

Module groups (``MODULE_GROUPS``): ``attention`` (the q/k/v/o projections of every layer), ``mlp`` (the gate/up/down
projections), ``lm_head`` (the output projection), ``embeddings`` (the input token embeddings). Default: attention
and mlp; norms and biases are never quantized. With tied embeddings, ``lm_head`` and ``embeddings`` are one tensor.

A GGUF file's own quantized tensors (``GgufVariant``), against a higher-precision source of the same model::

    model:
      name: ./SmolLM2-135M-Instruct             # the source: an HF folder, or an F16/F32 .gguf (the reference fp)
      weights:
        q4_k_m: {gguf: ./SmolLM2-135M-Instruct.Q4_K_M.gguf}
        q4_k_m_mlp: {gguf: ./SmolLM2-135M-Instruct.Q4_K_M.gguf, modules: [mlp]}

The variant's weights are the file's tensors dequantized (by transformers' GGUF loader, through kveval's conversion
cache: names mapped and llama.cpp's Q/K row order undone), copied into the source model's parameters: all of them
by default (norms included: the file's F32 copies), or those of ``modules``. The file's parameters must be the
source's (the same names and shapes, the same attention head counts); ``gguf`` and ``spec`` together are
refused. ``kveval.weights.apply`` says in env.json and metrics.json which file (name, size, xxh3-128 of its
content), which tensors differed from the source's, and the file's tensor types per group (Q4_K, Q6_K...).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kveval.errors import KvevalError
from kveval.gguf import check_gguf
from kveval.policy.parse import parse_spec
from kveval.quant import QuantSpec, preset_names

from .quantize import check_matrix, check_weight_spec

#: The module groups a variant may cover (see the module docstring), and the default.
MODULE_GROUPS = ("attention", "mlp", "lm_head", "embeddings")
DEFAULT_MODULES = ("attention", "mlp")

#: The name of the checkpoint's own weights (the reference) in tables and metrics; no variant may take it.
REFERENCE = "fp"
RESERVED_NAMES = (REFERENCE, "none")

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
MAX_NAME_CHARS = 100

#: Weight-specific presets: name -> (QuantSpec, one line). The K/V presets of ``kveval.quant`` are taken too.
WEIGHT_PRESETS: dict[str, tuple[QuantSpec, str]] = {
    "int8_channel": (QuantSpec(format="int", bits=8, mapping="symmetric", granularity="token"),
                     "INT8 symmetric, one fp16 scale per output channel (round to nearest)"),
    "int4_channel": (QuantSpec(format="int", bits=4, mapping="asymmetric", granularity="token"),
                     "INT4 asymmetric, one fp16 scale + min per output channel (round to nearest)"),
    "fp8_e4m3_channel": (QuantSpec(format="fp8_e4m3", granularity="token"),
                         "FP8 E4M3, one fp16 scale absmax/448 per output channel"),
}


def _close(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(name), choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def weight_preset_names() -> list[str]:
    """The weight presets, then every K/V preset (which read the same on weight rows)."""
    return [*WEIGHT_PRESETS, *preset_names()]


def parse_weight_spec(value: Any, where: str) -> QuantSpec:
    """A QuantSpec for weights from a weight preset, a K/V preset or a mapping of QuantSpec fields (``preset:``
    may name either kind); KvevalError (one line, starting with ``where``) for an unknown name, a bad field or a
    K/V-only granularity."""
    if isinstance(value, str):
        if value in WEIGHT_PRESETS:
            return WEIGHT_PRESETS[value][0]
        if value not in preset_names():
            raise KvevalError(f"{where}: unknown weight spec '{value}'{_close(value, weight_preset_names())} "
                              f"(weight presets: {', '.join(WEIGHT_PRESETS)}, or any preset of kveval ls)")
    if isinstance(value, dict) and value.get("preset") in WEIGHT_PRESETS:
        fields = {k: v for k, v in value.items() if k != "preset"}
        value = {**WEIGHT_PRESETS[value["preset"]][0].to_dict(), **fields}
    spec = parse_spec(value, where)
    try:
        check_weight_spec(spec)
    except ValueError as exc:
        raise KvevalError(f"{where}: {exc}") from None
    return spec


@dataclass(frozen=True)
class WeightVariant:
    """One set of weights to evaluate beside the checkpoint's: ``spec`` applied to the weight matrices of the
    module groups ``modules`` (``MODULE_GROUPS``). ``label``: the preset the spec was named by, if any."""

    name: str
    spec: QuantSpec
    modules: tuple[str, ...] = DEFAULT_MODULES
    label: str | None = None

    @classmethod
    def from_config(cls, cfg: Any, name: str, where: str | None = None) -> WeightVariant:
        """From a spec (preset name or QuantSpec mapping) or ``{spec: SPEC, modules: [GROUP, ...]}``."""
        where = where or f"model.weights.{name}"
        check_variant_name(name, where)
        modules: Any = DEFAULT_MODULES
        label = cfg if isinstance(cfg, str) else None
        if isinstance(cfg, dict) and ("spec" in cfg or "modules" in cfg):
            unknown = [k for k in cfg if k not in ("spec", "modules")]
            if unknown:
                raise KvevalError(f"{where}: unknown key '{unknown[0]}'{_close(unknown[0], ['spec', 'modules'])}")
            if "spec" not in cfg:
                raise KvevalError(f"{where}: 'spec' is missing (e.g. spec: int8_channel)")
            modules = cfg.get("modules", DEFAULT_MODULES)
            label = cfg["spec"] if isinstance(cfg["spec"], str) else None
            cfg = cfg["spec"]
            where_spec = f"{where}.spec"
        else:
            where_spec = where
        spec = parse_weight_spec(cfg, where_spec)
        return cls(name=name, spec=spec, modules=parse_modules(modules, f"{where}.modules"), label=label)

    def to_config(self) -> dict:
        """The full form (config.resolved.yaml): ``{spec: {QuantSpec fields}, modules: [...]}``."""
        return {"spec": self.spec.to_dict(), "modules": list(self.modules)}

    def describe(self) -> str:
        """One line: ``int4 asym g64 (fp16 scales) on attention, mlp``."""
        return f"{self.spec.describe()} on {', '.join(self.modules)}"


@dataclass(frozen=True)
class GgufVariant:
    """One set of weights to evaluate beside the checkpoint's: the tensors of the GGUF file ``gguf`` (the path as
    the config gives it), dequantized, in place of the source model's, for the module groups ``modules`` (None:
    every tensor the file holds, norms included). Plain data: ``kveval.weights.apply`` reads the file."""

    name: str
    gguf: str
    modules: tuple[str, ...] | None = None

    @classmethod
    def from_config(cls, cfg: Any, name: str, where: str | None = None) -> GgufVariant:
        """From ``{gguf: PATH}`` or ``{gguf: PATH, modules: [GROUP, ...]}``."""
        where = where or f"model.weights.{name}"
        check_variant_name(name, where)
        if not isinstance(cfg, dict) or "gguf" not in cfg:
            raise KvevalError(f"{where}: expected {{gguf: PATH}} (a GGUF file's tensors)")
        if "spec" in cfg:
            raise KvevalError(f"{where}: give spec (kveval quantizes the source's weights) or gguf (a file's own "
                              "quantized tensors), not both; make them two variants")
        unknown = [k for k in cfg if k not in GGUF_KEYS]
        if unknown:
            raise KvevalError(f"{where}: unknown key '{unknown[0]}'{_close(str(unknown[0]), list(GGUF_KEYS))} "
                              f"(a gguf variant takes {', '.join(GGUF_KEYS)})")
        path = cfg["gguf"]
        if not isinstance(path, str) or not path.strip():
            raise KvevalError(f"{where}.gguf: expected the path of a .gguf file; got {path!r}")
        modules = parse_modules(cfg["modules"], f"{where}.modules") if "modules" in cfg else None
        return cls(name=name, gguf=path, modules=modules)

    def to_config(self) -> dict:
        """The full form (config.resolved.yaml): ``{gguf: PATH}``, with ``modules`` when given."""
        return {"gguf": self.gguf, **({"modules": list(self.modules)} if self.modules is not None else {})}

    def describe(self) -> str:
        """One line: ``the tensors of model.Q4_K_M.gguf on mlp``."""
        on = ", ".join(self.modules) if self.modules is not None else "every tensor it holds"
        return f"the tensors of {Path(self.gguf).name} on {on}"


#: The keys of a gguf variant's mapping.
GGUF_KEYS = ("gguf", "modules")

#: A variant of either kind.
AnyVariant = WeightVariant | GgufVariant


def parse_variant(cfg: Any, name: str, where: str | None = None) -> AnyVariant:
    """One variant from its config value: ``{gguf: ...}`` is a :class:`GgufVariant`, anything else a
    :class:`WeightVariant` (a spec, or ``{spec: ..., modules: [...]}``)."""
    if isinstance(cfg, dict) and "gguf" in cfg:
        return GgufVariant.from_config(cfg, name, where)
    return WeightVariant.from_config(cfg, name, where)


def check_variant_name(name: Any, where: str) -> None:
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not _NAME_RE.fullmatch(name):
        raise KvevalError(f"{where}: variant name {name!r}: use letters, digits, '_', '-' and '.' only, not "
                          f"starting with '.' or '-', at most {MAX_NAME_CHARS} characters")
    if name in RESERVED_NAMES:
        raise KvevalError(f"{where}: the name '{name}' is reserved for the checkpoint's own weights (always the "
                          "reference); name the variant otherwise")


def parse_modules(value: Any, where: str) -> tuple[str, ...]:
    """The module groups, in ``MODULE_GROUPS`` order, from a list (or one name)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise KvevalError(f"{where}: expected a list of module groups ({', '.join(MODULE_GROUPS)})")
    for item in items:
        if item not in MODULE_GROUPS:
            raise KvevalError(f"{where}: unknown module group {item!r}{_close(str(item), list(MODULE_GROUPS))} "
                              f"(groups: {', '.join(MODULE_GROUPS)})")
    return tuple(g for g in MODULE_GROUPS if g in items)


def normalise_weights(value: Any) -> Any:
    """The friendly forms of ``model.weights`` as the schema's one form, a mapping ``{NAME: VARIANT}``:
    ``none`` / ``fp`` / null / ``[]`` -> ``{}``; ``"int8_channel"`` -> ``{int8_channel: int8_channel}``; a list of
    names and one-key mappings -> their union. A mapping is returned as it is (the schema then checks it)."""
    if value is None or (isinstance(value, str) and value in RESERVED_NAMES):
        return {}
    if isinstance(value, str):
        return {value: value}
    if isinstance(value, list):
        out: dict[str, Any] = {}
        for i, item in enumerate(value):
            if isinstance(item, str):
                name, cfg = item, item
            elif isinstance(item, dict) and len(item) == 1:
                name, cfg = next(iter(item.items()))
            else:
                raise KvevalError(f"model.weights[{i}]: expected a preset name or a one-key mapping {{NAME: SPEC}}")
            if name in out:
                raise KvevalError(f"model.weights[{i}]: the variant '{name}' is listed twice")
            out[str(name)] = cfg
        return out
    return value


def parse_variants(value: Any) -> dict[str, AnyVariant]:
    """``{NAME: WeightVariant | GgufVariant}`` from ``model.weights`` in any of its forms (``normalise_weights``)."""
    value = normalise_weights(value)
    if not isinstance(value, dict):
        raise KvevalError("model.weights: expected a preset name, a list of them or a mapping {NAME: SPEC}")
    return {str(n): parse_variant(cfg, str(n)) for n, cfg in value.items()}


def widths_from_config(cfg: Any) -> dict[str, set[int]] | None:
    """The input widths (in_features) of each module group of a Llama-like decoder, from its config dict (its
    ``text_config`` when it has one): attention q/k/v ``hidden_size`` and o ``num_attention_heads * head_dim``;
    mlp gate/up ``hidden_size`` and down ``intermediate_size``; lm_head and embeddings ``hidden_size``. None when
    the config does not name these (GPT-2's ``n_embd``...): the run checks the loaded model's matrices anyway."""
    text = cfg.get("text_config") if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict) else cfg
    if not isinstance(text, dict):
        return None
    dims = [v for v in (text.get(k) for k in ("hidden_size", "num_attention_heads", "intermediate_size"))
            if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if len(dims) != 3:
        return None
    hidden, heads, inter = dims
    head_dim = text.get("head_dim") or hidden // heads
    return {"attention": {hidden, heads * head_dim}, "mlp": {hidden, inter}, "lm_head": {hidden},
            "embeddings": {hidden}}


def check_widths(variants: dict[str, AnyVariant], widths: dict[str, set[int]], model: str) -> None:
    """KvevalError (one line) for a variant whose spec cannot tile the rows of a module group's matrices (a group
    size that does not divide in_features), from the widths of :func:`widths_from_config`, before the model loads
    (a GGUF variant has no spec: its file is checked against the loaded model)."""
    for name, v in variants.items():
        if not isinstance(v, WeightVariant):
            continue
        for group in v.modules:
            for width in sorted(widths.get(group, ())):
                try:
                    check_matrix(v.spec, width)
                except ValueError as exc:
                    raise KvevalError(f"model.weights.{name}: {exc} (the {group} matrices of {model}); choose a "
                                      "spec whose groups divide every input width") from None



def check_gguf_file(value: Any, where: str) -> Path:
    """The path of an existing GGUF file (``~`` expanded) named by a variant's ``gguf``; KvevalError (one line,
    starting with ``where``) when it does not exist, is not a file, has no GGUF magic and a version 2 or 3
    (:func:`kveval.gguf.check_gguf`), or lacks the ``.gguf`` suffix transformers' loader needs."""
    path = Path(str(value)).expanduser()
    if not path.exists():
        raise KvevalError(f"{where}: gguf file '{value}' does not exist")
    if not path.is_file():
        raise KvevalError(f"{where}: gguf '{value}' is not a file (give the path of a .gguf file)")
    check_gguf(path, where, shown=str(value))
    if path.suffix.lower() != ".gguf":
        raise KvevalError(f"{where}: '{value}' is a GGUF file without the .gguf suffix; rename it to end in .gguf "
                          "(transformers' loader needs it)")
    return path


def check_variant_files(variants: dict) -> None:
    """:func:`check_gguf_file` for every GGUF variant of ``{NAME: variant}`` (what ``kveval validate`` can say of
    the files without loading a model)."""
    for name, v in variants.items():
        file = getattr(v, "gguf", None)
        if file is not None:
            check_gguf_file(file, f"model.weights.{name}.gguf")


__all__ = ["DEFAULT_MODULES", "GGUF_KEYS", "MODULE_GROUPS", "REFERENCE", "RESERVED_NAMES", "WEIGHT_PRESETS",
           "AnyVariant", "GgufVariant", "WeightVariant", "check_gguf_file", "check_variant_files", "check_variant_name", "check_widths", "normalise_weights",
           "widths_from_config", "parse_modules", "parse_variant", "parse_variants", "parse_weight_spec",
           "weight_preset_names"]
