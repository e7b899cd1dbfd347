"""Scales files: calibrated K/V ranges per layer, written by ``kveval calibrate`` and read by policies (``scales:``).

A scales file is a safetensors file with float32 tensors named ``{kind}.{granularity}.{stat}``:

* kind: ``key`` (post-RoPE, as the cache sees keys), ``key_pre_rope`` (before the rotary embedding; rotary
  models only) and ``value``;
* granularity: ``tensor`` ``[layers]``, ``head`` ``[layers, kv_heads]``, ``channel`` ``[layers, kv_heads, head_dim]``;
* stat: ``absmax`` (symmetric specs), ``lo`` and ``hi`` (asymmetric specs); see ``kveval.scales.ranges``.

and, for the 'nuq' specs of the config's policies (KVQuant, ``kveval.scales.codebooks``), float32
``kvquant.{kind}[@p].channel.hi`` / ``.lo`` ``[layers, kv_heads, head_dim]`` (per-channel bounds) and
``kvquant.{kind}[@p].{channel|token}.nuq{b}`` ``[layers, 2^b]`` (ascending k-means codebooks); the header's ``nuq``
says what was fitted.

and a JSON header (safetensors metadata key ``kveval_scales``): ``format`` (1), ``model``, ``layers``,
``kv_heads``, ``head_dim``, ``corpus``, ``tokenizer`` (fingerprint), ``token_start``/``token_end`` (the corpus
token range used), ``tokens``, ``seq_len``, ``method``, ``percentile``, ``target`` (the spec an ``mse`` file was
searched for, else null), ``dtype``, ``created``, ``kveval``.

Reading checks the file before any run uses it (one :class:`KvevalError` line each): a safetensors file with the
header, the format, positive integer ``layers``/``kv_heads``/``head_dim``, the key and value ranges, every tensor
of the shape that the header's sizes give (a file whose tensors disagree with its header fails here, not
mid-run; a codebook ``[layers, 2^b]``, ascending), finite, ``absmax >= 0`` and ``lo <= hi``. A file that cannot be read says how to get a new one: delete
it and recalibrate (``kveval calibrate``, or rerun a ``scales: auto`` run, which calibrates again).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from kveval.errors import KvevalError
from kveval.fileio import atomic_path
from kveval.quant import QParams, QuantSpec, qparams_from_range
from kveval.quant.formats.base import SCALE_TORCH_DTYPES, store
from kveval.scales.ranges import STATIC_GRANULARITIES, Ranges

FORMAT_VERSION = 1
KINDS = ("key", "key_pre_rope", "value")
_META_KEY = "kveval_scales"


@dataclass
class ScalesFile:
    """A loaded scales file: ``header`` (dict) and ``tensors`` (name -> float32 tensor)."""

    header: dict
    tensors: dict[str, torch.Tensor]
    path: str = ""

    @property
    def kinds(self) -> list[str]:
        return [k for k in KINDS if f"{k}.tensor.absmax" in self.tensors]

    def ranges(self, layer: int, kind: str, granularity: str) -> Ranges:
        """The calibrated range of one layer's ``kind`` at ``granularity`` (shapes ``[]``, ``[H]``, ``[H, D]``)."""
        name = f"{kind}.{granularity}"
        if f"{name}.absmax" not in self.tensors:
            have = ", ".join(self.kinds) or "none"
            raise KvevalError(f"scales file {self.path}: no '{kind}' ranges (it holds: {have}); recalibrate")
        return Ranges(*(self.tensors[f"{name}.{stat}"][layer] for stat in ("absmax", "lo", "hi")))

    def qparams(self, layer: int, kind: str, spec: QuantSpec) -> QParams:
        """Static parameters for ``spec`` (granularity tensor, head or channel) of one layer's keys or values."""
        if spec.fmt.name == "nuq":
            return self.nuq_qparams(layer, kind, spec)
        target = self.header.get("target")
        if self.header.get("method") == "mse" and target:
            t = QuantSpec.from_dict(target)
            if (t.format, t.bits) != (spec.format, spec.bits):
                raise KvevalError(
                    f"scales file {self.path} was searched (mse) for {t.describe()}; the policy uses {spec.describe()}: "
                    "calibrate for that format, or use method absmax or percentile"
                )
        name = f"{kind}@{spec.outliers:g}" if spec.outliers else kind
        if spec.outliers and f"{name}.tensor.absmax" not in self.tensors:
            raise KvevalError(
                f"scales file {self.path} has no ranges without {spec.outliers:g} outliers; calibrate with "
                f"calibration.outliers: [{spec.outliers:g}] (scales: auto does this by itself)"
            )
        r = self.ranges(layer, name, spec.granularity)
        lo, hi = (-r.absmax, r.absmax) if spec.mapping == "symmetric" else (r.lo, r.hi)
        return qparams_from_range(lo, hi, spec)

    def nuq_qparams(self, layer: int, kind: str, spec: QuantSpec) -> QParams:
        """A 'nuq' spec's calibrated parameters for one layer: the codebook (float32 [2^b]), and per channel the
        bounds hi / lo as scale / zero point ``[1, H, 1, D]`` rounded to the spec's scale dtype (KVQuant: fp16)."""
        from kveval.scales.codebooks import bounds_names, codebook_name

        style = "channel" if spec.granularity == "channel" else "token"
        p = spec.outliers
        name = codebook_name(kind, p, style, spec.bits)
        if name not in self.tensors:
            have = sorted(n.removeprefix("kvquant.") for n in self.tensors if n.startswith("kvquant.") and ".nuq" in n)
            held = f"it holds {', '.join(have[:6])}{' ...' if len(have) > 6 else ''}" if have else "it holds none"
            raise KvevalError(
                f"scales file {self.path} has no nuq{spec.bits} codebook for {kind}s per {style} with {p:g} outliers "
                f"({held}); calibrate with a config whose policies use this spec (scales: auto does this by itself)"
            )
        book = self.tensors[name][layer]
        if style == "token":
            return QParams(torch.empty(0), None, book)
        H, D = self.header["kv_heads"], self.header["head_dim"]
        sdt = SCALE_TORCH_DTYPES[spec.resolved(torch.float32).scale_dtype]
        hi, lo = (store(self.tensors[n][layer], sdt).reshape(1, H, 1, D) for n in bounds_names(kind, p))
        return QParams(hi, lo, book)

    def check_model(self, model_name: str, layers: int, kv_heads: int, head_dim: int) -> None:
        """One clear error when the file was calibrated for another model or shape."""
        h = self.header
        want = (layers, kv_heads, head_dim)
        have = (h.get("layers"), h.get("kv_heads"), h.get("head_dim"))
        if have != want:
            raise KvevalError(
                f"scales file {self.path} is for {have[0]} layers x {have[1]} kv heads x head_dim {have[2]}, the model "
                f"has {want[0]} x {want[1]} x {want[2]}; calibrate for this model (kveval calibrate CONFIG)"
            )
        if h.get("model") != model_name:
            raise KvevalError(
                f"scales file {self.path} was calibrated on '{h.get('model')}', this run uses '{model_name}'; "
                "calibrate for this model (kveval calibrate CONFIG)"
            )


def save_scales(path: str | Path, ranges: dict[tuple[str, str], list[Ranges]], header: dict,
                extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``ranges[(kind, granularity)]`` (one Ranges per layer), the ``extra`` tensors (the nuq bounds and
    codebooks, by name) and the header, atomically."""
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in (extra or {}).items()}
    for (kind, gran), per_layer in ranges.items():
        for stat in ("absmax", "lo", "hi"):
            tensors[f"{kind}.{gran}.{stat}"] = torch.stack([getattr(r, stat).float() for r in per_layer]).contiguous()
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps({"format": FORMAT_VERSION, **header})})
    return path


def load_scales(path: str | Path) -> ScalesFile:
    """Read a scales file; a missing or foreign file is one clear KvevalError. A model folder (``DIR`` or
    ``DIR#ENGINE``) gives its checkpoint's KV scales as that engine loads them (:mod:`kveval.scales.checkpoint`)."""
    from kveval.scales.checkpoint import is_checkpoint_target, load_checkpoint_scales

    if is_checkpoint_target(path):
        return load_checkpoint_scales(path)  # type: ignore[return-value]  (the same interface: qparams, ...)
    p = Path(path)
    if not p.is_file():
        what = "is not a file" if p.exists() else "does not exist"
        raise KvevalError(f"scales file '{path}' {what}; write one with kveval calibrate CONFIG")
    stat = p.stat()
    return _load(str(p.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _load(path: str, _mtime: int, _size: int) -> ScalesFile:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise KvevalError(f"scales file '{path}' cannot be read ({first}); {RECALIBRATE}") from None
    if _META_KEY not in meta:
        raise KvevalError(f"'{path}' is not a kveval scales file (no '{_META_KEY}' header); write one with kveval calibrate")
    try:
        header = json.loads(meta[_META_KEY])
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise KvevalError(f"scales file '{path}' has an unreadable header; {RECALIBRATE}")
    if header.get("format") != FORMAT_VERSION:
        raise KvevalError(f"scales file '{path}' has format {header.get('format')}, this kveval reads {FORMAT_VERSION}")
    missing = [f"{k}.{g}.{s}" for k in ("key", "value") for g in STATIC_GRANULARITIES for s in ("absmax", "lo", "hi")
               if f"{k}.{g}.{s}" not in tensors]
    if missing:
        raise KvevalError(f"scales file '{path}' lacks {missing[0]}; {RECALIBRATE}")
    _check_tensors(path, header, tensors)
    return ScalesFile(header=header, tensors=tensors, path=path)


def _check_codebook(path: str, name: str, stat: str, t: torch.Tensor, layers: int) -> None:
    """A nuq codebook: ``[layers, 2^b]`` (b from its name), finite, ascending in every layer."""
    bits = stat.removeprefix("nuq")
    want = (layers, 2 ** int(bits)) if bits.isdigit() and 1 <= int(bits) <= 8 else None
    if want is None or tuple(t.shape) != want:
        raise KvevalError(f"scales file '{path}': {name} has shape {list(t.shape)}, a {stat} codebook is "
                          f"{list(want) if want else '[layers, 2^bits]'} for {layers} layers; {RECALIBRATE}")
    if not bool(torch.isfinite(t).all()) or bool((t[:, 1:] < t[:, :-1]).any()):
        raise KvevalError(f"scales file '{path}': {name} is not a finite ascending codebook; {RECALIBRATE}")


RECALIBRATE = "delete it and recalibrate (kveval calibrate CONFIG; a scales: auto run calibrates again by itself)"


def _check_tensors(path: str, header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor has the shape the header's sizes give, holds finite values, absmax >= 0 and lo <= hi."""
    sizes = [header.get(k) for k in ("layers", "kv_heads", "head_dim")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        raise KvevalError(f"scales file '{path}': its header's layers / kv_heads / head_dim {tuple(sizes)} are not "
                          f"positive integers; {RECALIBRATE}")
    layers, heads, dim = sizes
    shapes = {"tensor": (layers,), "head": (layers, heads), "channel": (layers, heads, dim)}
    for name, t in tensors.items():
        parts = name.split(".")
        gran = parts[-2] if len(parts) >= 3 else None
        if name.startswith("kvquant.") and parts[-1].startswith("nuq"):
            _check_codebook(path, name, parts[-1], t, layers)
            continue
        if gran not in shapes:
            continue
        if tuple(t.shape) != shapes[gran]:
            raise KvevalError(f"scales file '{path}': {name} has shape {list(t.shape)}, its header says "
                              f"{list(shapes[gran])} ({layers} layers x {heads} kv heads x head_dim {dim}); {RECALIBRATE}")
        if not bool(torch.isfinite(t).all()):
            raise KvevalError(f"scales file '{path}': {name} holds NaN or infinity; {RECALIBRATE}")
        if parts[-1] == "absmax" and bool((t < 0).any()):
            raise KvevalError(f"scales file '{path}': {name} holds a negative range; {RECALIBRATE}")
    for name in tensors:
        if name.endswith(".lo"):
            hi = tensors.get(name[:-3] + ".hi")
            if hi is not None and hi.shape == tensors[name].shape and bool((tensors[name] > hi).any()):
                raise KvevalError(f"scales file '{path}': {name} exceeds its .hi somewhere; {RECALIBRATE}")
