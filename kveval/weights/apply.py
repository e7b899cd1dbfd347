"""Weight variants on a loaded model: which matrices a variant covers, and swapping them in and out (plumbing).

    prepared = prepare(model, variant)         # finds the matrices, checks every shape; KvevalError otherwise
    prepared.info()                            # what env.json and metrics.json say: spec, modules, counts, bytes
    with prepared.applied(model):              # the model computes with Ŵ; its own weights are back on exit
        logits = model(ids).logits

Which matrices (``targets``): every ``torch.nn.Linear`` inside the decoder whose module path has an attention
part (``self_attn``, ``attn``, ``attention``, ...) is ``attention``, an MLP part (``mlp``, ``feed_forward``,
``ffn``...) ``mlp``; ``lm_head`` is ``model.get_output_embeddings()`` and ``embeddings``
``model.get_input_embeddings()`` (its table ``[vocab, hidden]`` is quantized per token row, as llama.cpp stores
``token_embd``). Tied input and output embeddings are one tensor: asking for either quantizes both, and ``info``
says so (``modules_quantized``, ``notes``). Norms and biases are never touched. A model whose projections are not
``nn.Linear`` (GPT-2's ``Conv1D``) is refused with one line.

Applying swaps each covered parameter's ``.data`` for ``fake_quantize_weight`` of it (``quantize``: the matrix
``[out, in]`` as ``[1, 1, out, in]``), computed afresh on entry (a fraction of a second for a 135M model), and
puts the original tensors back on exit, also after an exception: the model's own weights are restored bit for bit
and never copied.

A GGUF variant (``{gguf: FILE}``, :class:`kveval.weights.spec.GgufVariant`; ``prepare`` dispatches on the kind)
takes its tensors from the file instead: ``prepare`` checks the file (:func:`kveval.weights.spec.check_gguf_file`), loads it
with ``kveval.models.load_model`` (transformers' GGUF loader through the conversion cache: llama.cpp's names
mapped, its Q/K row order undone, dequantized to float32), requires the file's parameters to be the source's (same
names, same shapes, same attention head counts; the first one that differs is named), and keeps, cast to the
source's dtype and device, the covered tensors whose values differ from the source's (one more copy of those
weights in memory; the file's F32 norms, equal to the source's, are not held). ``applied`` swaps them in and
restores the originals on exit, as above. ``info`` names the file (name, path, size, xxh3-128 of its content), its
architecture and file type, its tensor types per group (``Q4_K``, ``Q6_K``, ``F32``...), the tensors replaced
and those equal to the source's per group, the relative error ``||W_file - W||_F / ||W||_F`` per group, and the
file's bytes for the quantized tensors covered (what the memory bill counts).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kveval.errors import KvevalError
from kveval.gguf import TENSOR_GROUPS, GgufHeader, read_header

from .quantize import check_matrix, fake_quantize_weight, matrix_nbytes
from .spec import MODULE_GROUPS, AnyVariant, GgufVariant, WeightVariant, check_gguf_file

#: Module-path parts that mark an attention block / an MLP block (transformers' names across model families).
ATTENTION_PARTS = ("self_attn", "attn", "attention", "self_attention", "cross_attn")
MLP_PARTS = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "experts", "shared_expert")


@dataclass(frozen=True)
class Target:
    """One weight matrix a variant quantizes: ``name`` (the module path; ``+``-joined for tied tensors),
    ``groups`` (the module groups it belongs to), ``shape`` ``(out, in)``."""

    name: str
    groups: tuple[str, ...]
    shape: tuple[int, int]
    param: torch.nn.Parameter = field(repr=False, compare=False)


def _group_of(path: str) -> str | None:
    parts = path.split(".")
    if any(p in ATTENTION_PARTS for p in parts):
        return "attention"
    if any(p in MLP_PARTS for p in parts):
        return "mlp"
    return None


def _embeddings(model: torch.nn.Module, getter: str) -> Any:
    """``model.get_output_embeddings()`` / ``get_input_embeddings()`` (transformers' models), else None."""
    fn = getattr(model, getter, None)
    return fn() if callable(fn) else None


def find_targets(model: torch.nn.Module, modules: tuple[str, ...]) -> tuple[list[Target], bool]:
    """The matrices of ``modules`` (module groups) in ``model``, in module order, each tensor once; and whether
    the model ties its input and output embeddings. KvevalError when a requested group has no ``nn.Linear`` (or
    embedding)."""
    out_emb = _embeddings(model, "get_output_embeddings")
    in_emb = _embeddings(model, "get_input_embeddings")
    found: dict[int, Target] = {}
    counts = dict.fromkeys(modules, 0)
    other_kinds: set[str] = set()

    def add(name: str, group: str, param: Any) -> None:
        counts[group] = counts.get(group, 0) + 1
        key = id(param)
        if key in found:
            t = found[key]
            found[key] = Target(f"{t.name}+{name}", (*t.groups, group), t.shape, param)
            return
        found[key] = Target(name, (group,), (int(param.shape[0]), int(param.shape[1])), param)

    paths = {"lm_head": "lm_head", "embeddings": "embed_tokens"}
    for path, module in model.named_modules():
        if module is out_emb or module is in_emb:
            paths["lm_head" if module is out_emb else "embeddings"] = path
            continue
        group = _group_of(path)
        if group is None:
            continue
        if isinstance(module, torch.nn.Linear):
            if group in modules:
                add(f"{path}.weight", group, module.weight)
        else:
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not list(module.children()):
                other_kinds.add(type(module).__name__)
    tied = (out_emb is not None and in_emb is not None and getattr(out_emb, "weight", None) is not None
            and out_emb.weight is getattr(in_emb, "weight", None))
    for group, module in (("lm_head", out_emb), ("embeddings", in_emb)):
        if group in modules and module is not None and getattr(module, "weight", None) is not None:
            add(f"{paths[group]}.weight", group, module.weight)
    missing = [g for g in modules if counts.get(g, 0) == 0]
    if missing:
        kind = (f" (its projections are {', '.join(sorted(other_kinds))}, not torch.nn.Linear)" if other_kinds
                else "")
        raise KvevalError(f"{type(model).__name__} has no {' or '.join(missing)} weight matrices to quantize{kind}; "
                          "model.weights quantizes torch.nn.Linear projections (and the embeddings)")
    return list(found.values()), bool(tied)


def _suggest_groups(widths: list[int]) -> str:
    g = math.gcd(*widths)
    fits = [s for s in (256, 128, 64, 32, 16) if g % s == 0]
    return f"; group sizes that divide every matrix here: {', '.join(map(str, fits))}" if fits else ""


def size_fields(params_quantized: int, params_total: int, quantized_bytes: dict[str, int]) -> dict:
    """The size part of a variant's ``info``: parameters quantized and in all, their share, the quantized tensors'
    bytes as stored (``quantized_bytes``, with a ``total``) and bits per quantized weight."""
    pq = params_quantized
    return {
        "params_quantized": pq,
        "params_total": params_total,
        "quantized_share": pq / params_total if params_total else None,
        "quantized_bytes": quantized_bytes,
        "bits_per_weight": 8 * quantized_bytes["total"] / pq if pq else None,
    }


@dataclass
class PreparedVariant:
    """A weight variant checked against one model: its matrices (``targets``) and what it stores."""

    variant: WeightVariant
    targets: list[Target]
    tied_embeddings: bool
    params_total: int

    @property
    def params_quantized(self) -> int:
        return sum(t.shape[0] * t.shape[1] for t in self.targets)

    def quantized_bytes(self) -> dict[str, int]:
        """Bytes of the quantized matrices as stored (FP16 serving dtype): ``codes``, ``scales`` (+ zero points),
        ``total`` (:func:`kveval.weights.quantize.matrix_nbytes`, summed)."""
        out = {"codes": 0, "scales": 0, "total": 0}
        for t in self.targets:
            nb = matrix_nbytes(self.variant.spec, t.shape[0], t.shape[1])
            for k in out:
                out[k] += nb[k]
        return out

    def info(self) -> dict:
        """What env.json and metrics.json say of the variant: ``spec`` (QuantSpec fields), ``describe``,
        ``modules`` (the groups asked), ``modules_quantized`` (the groups covered, tied ones included),
        ``matrices``, ``params_quantized``, ``params_total``, ``quantized_share``, ``quantized_bytes``
        ({codes, scales, total}), ``bits_per_weight`` (stored bits per quantized parameter, scales included),
        ``notes``."""
        nb = self.quantized_bytes()
        pq = self.params_quantized
        covered = {g for t in self.targets for g in t.groups}
        notes = []
        if self.tied_embeddings and len(covered & {"lm_head", "embeddings"}) == 1:
            asked = next(iter(covered & {"lm_head", "embeddings"}))
            other = "embeddings" if asked == "lm_head" else "lm_head"
            notes.append(f"{asked} is tied to {other}: the one shared tensor is quantized, so {other} is too")
            covered.add(other)
        return {
            "spec": self.variant.spec.to_dict(),
            "preset": self.variant.label,
            "describe": self.variant.spec.describe(),
            "modules": list(self.variant.modules),
            "modules_quantized": [g for g in ("attention", "mlp", "lm_head", "embeddings") if g in covered],
            "matrices": len(self.targets),
            **size_fields(pq, self.params_total, nb),
            "notes": notes,
        }

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[PreparedVariant]:
        """Within the block the covered matrices hold Ŵ = ``fake_quantize_weight(W, spec)``; on exit (also after
        an exception) every parameter holds its original tensor again."""
        saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for t in self.targets:
                    original = t.param.data
                    quantized = fake_quantize_weight(original, self.variant.spec)
                    saved.append((t.param, original))
                    t.param.data = quantized
            yield self
        finally:
            for param, original in reversed(saved):
                param.data = original


def prepare(model: torch.nn.Module, variant: AnyVariant) -> PreparedVariant | PreparedGgufVariant:
    """Check ``variant`` against ``model`` before any work: the matrices exist, are floating point, and the spec
    tiles every row (group size and block size divide in_features). KvevalError (one line) otherwise, naming the
    variant, the matrix and the fix. A GGUF variant: :func:`prepare_gguf`."""
    if isinstance(variant, GgufVariant):
        return prepare_gguf(model, variant)
    where = f"model.weights.{variant.name}"
    try:
        targets, tied = find_targets(model, variant.modules)
    except KvevalError as exc:
        raise KvevalError(f"{where}: {exc}") from None
    for t in targets:
        if not t.param.is_floating_point():
            raise KvevalError(f"{where}: {t.name} holds {t.param.dtype} values (already quantized by its loader); "
                              "kveval fake-quantizes floating-point weights only")
        try:
            check_matrix(variant.spec, t.shape[1])
        except ValueError as exc:
            hint = _suggest_groups([x.shape[1] for x in targets]) if variant.spec.granularity == "group" else ""
            raise KvevalError(f"{where}: {exc} of {t.name} [{t.shape[0]} x {t.shape[1]}]{hint}") from None
    params_total = sum(p.numel() for p in model.parameters())
    return PreparedVariant(variant, targets, tied, params_total)


def prepare_all(model: torch.nn.Module,
                variants: dict[str, AnyVariant]) -> dict[str, PreparedVariant | PreparedGgufVariant]:
    """:func:`prepare` for every variant, in order."""
    return {name: prepare(model, v) for name, v in variants.items()}


# --------------------------------------------------------------------------------------------- GGUF variants

#: Config fields that must agree between the source and a GGUF file: transformers undoes llama.cpp's Q/K row order
#: with the file's head counts, which must be the source's for the rows to land where the source has them.
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def param_groups(model: torch.nn.Module) -> tuple[dict[str, str], bool]:
    """``{parameter name: group}`` for every parameter of ``model`` (each tensor once, as ``named_parameters``
    gives them), in the groups of :func:`kveval.gguf.tensor_group`: the input embeddings
    (``embeddings``; the tensor tied to the output projection too), the output projection (``lm_head``), the other
    matrices by module path (``attention``, ``mlp``), every other tensor (norms, biases) ``other``; and whether
    the input and output embeddings are one tensor."""
    out_w = getattr(_embeddings(model, "get_output_embeddings"), "weight", None)
    in_w = getattr(_embeddings(model, "get_input_embeddings"), "weight", None)
    groups = {}
    for name, p in model.named_parameters():
        if p is in_w:
            groups[name] = "embeddings"
        elif p is out_w:
            groups[name] = "lm_head"
        elif p.dim() == 2:
            groups[name] = _group_of(name.rpartition(".")[0]) or "other"
        else:
            groups[name] = "other"
    return groups, in_w is not None and in_w is out_w


def _shape(t: torch.Tensor) -> str:
    return "[" + " x ".join(str(int(x)) for x in t.shape) + "]"


def _model_type(model: torch.nn.Module) -> str | None:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None)


def _text_config(model: torch.nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _check_fits(model: torch.nn.Module, file_model: torch.nn.Module, where: str) -> None:
    """KvevalError (one line) unless the file's model has the source's parameters (names and shapes, both ways)
    and attention head counts; names the first parameter that differs."""
    src, mine = dict(model.named_parameters()), dict(file_model.named_parameters())
    kinds = (_model_type(file_model), _model_type(model))
    arch = f" (the file is a {kinds[0]} model, the source {kinds[1]})" if kinds[0] != kinds[1] else ""
    problem = None
    for name, t in mine.items():
        if name not in src:
            problem = f"the file's tensor {name} {_shape(t)} is not in the source"
        elif t.shape != src[name].shape:
            problem = f"the file's {name} is {_shape(t)}, the source's {_shape(src[name])}"
        if problem:
            break
    if problem is None:
        missing = [n for n in src if n not in mine]
        if missing:
            problem = f"the source's {missing[0]} {_shape(src[missing[0]])} is not in the file"
    if problem is None:
        a, b = _text_config(file_model), _text_config(model)
        for key in HEAD_FIELDS:
            if getattr(a, key, None) != getattr(b, key, None):
                problem = f"the file has {key} {getattr(a, key, None)}, the source {getattr(b, key, None)}"
                break
    if problem is not None:
        raise KvevalError(f"{where}: the GGUF file does not fit the source model: {problem}{arch}; give a GGUF "
                          "file of the source model")


def _covers(modules: tuple[str, ...] | None, group: str, tied: bool) -> bool:
    if modules is None:
        return True
    return group in modules or (tied and group == "embeddings" and "lm_head" in modules)


@dataclass
class PreparedGgufVariant:
    """A GGUF variant checked against one model: the file's tensors that differ from the model's (``swaps``:
    ``(name, group, parameter, the file's tensor)``, cast to the parameter's dtype and device) and what the file
    says (``header``, ``file``)."""

    variant: GgufVariant
    swaps: list[tuple[str, str, torch.nn.Parameter, torch.Tensor]]
    header: GgufHeader
    file: dict
    groups_covered: tuple[str, ...]
    identical: dict[str, int]
    relative_error: dict[str, float]
    tied_embeddings: bool
    params_total: int

    def _quantized_tensors(self) -> list:
        return [t for t in self.header.tensors if t.quantized and t.group in self.groups_covered]

    @property
    def params_quantized(self) -> int:
        """The parameters covered that the file stores in a quantized type (not F32/F16/BF16/F64)."""
        return sum(t.n_elements for t in self._quantized_tensors())

    def quantized_bytes(self) -> dict[str, int]:
        """The file's bytes of the quantized tensors covered: ``{"total"}`` (llama.cpp's blocks hold codes and
        scales together)."""
        return {"total": sum(t.n_bytes for t in self._quantized_tensors())}

    def info(self) -> dict:
        """What env.json and metrics.json say of the variant: ``source`` ``gguf``, ``gguf`` (``file``, ``path``,
        ``size``, ``xxh3_128``, ``architecture``, ``file_type``), ``describe``, ``modules`` (the groups asked,
        ``all`` by default), ``modules_quantized`` (the groups covered whose tensors the file quantizes),
        ``tensor_types`` (``{group: {type: tensors}}``, the whole file), ``tensors_replaced`` and
        ``tensors_identical`` (per group: covered tensors that differ from the source's / equal it bit for bit),
        ``relative_error`` (per group), ``matrices``, ``params_replaced``, ``params_quantized``, ``params_total``,
        ``quantized_share``, ``quantized_bytes`` ({total}), ``bits_per_weight``, ``notes``."""
        pq = self.params_quantized
        nb = self.quantized_bytes()
        replaced: dict[str, int] = {}
        for _, group, _, _ in self.swaps:
            replaced[group] = replaced.get(group, 0) + 1
        qgroups = {t.group for t in self._quantized_tensors()}
        types = self.header.tensor_types()
        used = sorted({t.type for t in self._quantized_tensors()})
        notes = []
        if self.tied_embeddings and qgroups & {"embeddings", "lm_head"}:
            qgroups |= {"embeddings", "lm_head"}
            notes.append("the source ties lm_head to the embeddings: the file's token_embd is both")
        for group, err in self.relative_error.items():
            if err > 0.5:
                notes.append(f"the file's {group} tensors are far from the source's (relative error {err:.2g}): is "
                             "the file a quantization of the source model?")
        return {
            "source": "gguf",
            "gguf": self.file,
            "spec": None,
            "preset": None,
            "describe": f"GGUF {self.file['file']} ({', '.join(used) if used else 'no quantized tensors'})",
            "modules": list(self.variant.modules) if self.variant.modules is not None else "all",
            "modules_quantized": [g for g in MODULE_GROUPS if g in qgroups],
            "tensor_types": types,
            "tensors_replaced": {g: replaced[g] for g in TENSOR_GROUPS if g in replaced},
            "tensors_identical": {g: self.identical[g] for g in TENSOR_GROUPS if self.identical.get(g)},
            "relative_error": {g: self.relative_error[g] for g in TENSOR_GROUPS if g in self.relative_error},
            "matrices": sum(1 for _, _, p, _ in self.swaps if p.dim() == 2),
            "params_replaced": sum(p.numel() for _, _, p, _ in self.swaps),
            **size_fields(pq, self.params_total, nb),
            "notes": notes,
        }

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[PreparedGgufVariant]:
        """Within the block the covered parameters hold the file's tensors; on exit (also after an exception) every
        parameter holds its original tensor again."""
        saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        try:
            for _, _, param, tensor in self.swaps:
                saved.append((param, param.data))
                param.data = tensor
            yield self
        finally:
            for param, original in reversed(saved):
                param.data = original


def prepare_gguf(model: torch.nn.Module, variant: GgufVariant) -> PreparedGgufVariant:
    """Check a GGUF variant against ``model`` and load its tensors (module docstring). KvevalError (one line,
    starting with ``model.weights.NAME``) for a file that is missing or not GGUF, that transformers cannot load,
    whose parameters are not the source's, or that holds no tensor of a module group asked for."""
    from kveval.models import file_digest, load_model

    where = f"model.weights.{variant.name}"
    path = check_gguf_file(variant.gguf, f"{where}.gguf")
    header = read_header(path, where)
    try:
        file_model, _ = load_model(str(path), dtype="float32")
    except KvevalError as exc:
        raise KvevalError(f"{where}: {exc}") from None
    _check_fits(model, file_model, where)
    groups, tied = param_groups(model)
    mine = dict(file_model.named_parameters())
    covered = {n: g for n, g in groups.items() if _covers(variant.modules, g, tied)}
    for group in variant.modules or ():
        if not any(_covers((group,), g, tied) for g in covered.values()):
            raise KvevalError(f"{where}: the file has no {group} tensors to use (groups it has: "
                              f"{', '.join(sorted(set(groups.values())))})")
    swaps: list[tuple[str, str, torch.nn.Parameter, torch.Tensor]] = []
    identical: dict[str, int] = {}
    err: dict[str, list[float]] = {}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, group in covered.items():
            param = params[name]
            tensor = mine[name].detach().to(dtype=param.dtype, device=param.device)
            if not bool(torch.isfinite(tensor.sum(dtype=torch.float64))):
                raise KvevalError(f"{where}: the file's {name} holds NaN or infinity in "
                                  f"{str(param.dtype).removeprefix('torch.')}; use a wider dtype")
            diff = float((tensor.double() - param.double()).pow(2).sum())
            num_den = err.setdefault(group, [0.0, 0.0])
            num_den[0] += diff
            num_den[1] += float(param.double().pow(2).sum())
            if diff == 0.0 and torch.equal(tensor, param):
                identical[group] = identical.get(group, 0) + 1
            else:
                swaps.append((name, group, param, tensor))
    del file_model, mine
    try:
        size = path.stat().st_size
        digest = file_digest(path)
    except OSError as e:
        raise KvevalError(f"{where}: gguf file '{variant.gguf}' cannot be read "
                          f"({e.strerror or type(e).__name__})") from None
    file = {"file": path.name, "path": str(path.resolve()), "size": size, "xxh3_128": digest,
            "architecture": header.architecture, "file_type": header.file_type}
    relative = {g: (math.sqrt(n / d) if d > 0 else (0.0 if n == 0 else math.inf)) for g, (n, d) in err.items()}
    groups_covered = tuple(g for g in TENSOR_GROUPS if g in set(covered.values()))
    return PreparedGgufVariant(variant, swaps, header, file, groups_covered, identical, relative, tied,
                               sum(p.numel() for p in model.parameters()))


__all__ = ["ATTENTION_PARTS", "HEAD_FIELDS", "MLP_PARTS", "PreparedGgufVariant", "PreparedVariant", "Target",
           "find_targets", "param_groups", "prepare", "prepare_all", "prepare_gguf"]
