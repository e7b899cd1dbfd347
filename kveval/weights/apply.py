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
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kveval.errors import KvevalError

from .quantize import check_matrix, fake_quantize_weight, matrix_nbytes
from .spec import WeightVariant

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
            "params_quantized": pq,
            "params_total": self.params_total,
            "quantized_share": pq / self.params_total if self.params_total else None,
            "quantized_bytes": nb,
            "bits_per_weight": 8 * nb["total"] / pq if pq else None,
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


def prepare(model: torch.nn.Module, variant: WeightVariant) -> PreparedVariant:
    """Check ``variant`` against ``model`` before any work: the matrices exist, are floating point, and the spec
    tiles every row (group size and block size divide in_features). KvevalError (one line) otherwise, naming the
    variant, the matrix and the fix."""
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


def prepare_all(model: torch.nn.Module, variants: dict[str, WeightVariant]) -> dict[str, PreparedVariant]:
    """:func:`prepare` for every variant, in order."""
    return {name: prepare(model, v) for name, v in variants.items()}


__all__ = ["ATTENTION_PARTS", "MLP_PARTS", "PreparedVariant", "Target", "find_targets", "prepare", "prepare_all"]
