"""Parity: a preset named after a system, checked against that system on the same token ids.

For each cache type of a system, the system's own run gives reference logits (``ref``: its quantized cache,
``ref_fp``: its own full-precision/default cache) and kveval's preset gives ``kv`` (kveval's emulation of the
same cache) and ``kv_fp`` (kveval's baseline), all ``[T, vocab]`` for the same ids ``[T]``. ``compare`` turns them
into a ``ParityRow``: each side's ΔPPL % / KLD / top-1 against its own baseline, and ``kld_between`` =
KL(P_ref ‖ P_kveval), the figure a parity test bounds (at most a fraction of KL(P_ref_fp ‖ P_ref)).

One module per system (``llamacpp``, ``hf_quanto``, ``hf_hqq``, ``kivi``, ...) with ``run(...) -> list[ParityRow]``;
``SYSTEMS`` maps the names ``kveval parity`` accepts to those modules (imported on use).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from kveval.errors import KvevalError
from kveval.stats import compare_logits, llama_perplexity_stats, llama_sums, llama_token_values

SYSTEMS: dict[str, str] = {}
SYSTEMS["llamacpp"] = "kveval.parity.llamacpp"
SYSTEMS["hf_quanto"] = "kveval.parity.hf_quanto"
SYSTEMS["kivi"] = "kveval.parity.kivi"
SYSTEMS["hf_hqq"] = "kveval.parity.hf_hqq"
SYSTEMS["hf_fp8"] = "kveval.parity.hf_fp8"


@dataclass
class ParityRow:
    """One cache type of one system: kveval's preset against the system's own run on the same tokens."""

    system: str
    cache_type: str  # the system's name for it, e.g. "q4_0/q4_0" (keys/values) or "quanto int4, 128-token prompt"
    preset: str  # the kveval policy that claims to reproduce it
    tokens: int  # scored positions
    ref_delta_ppl_pct: float
    ref_kld: float
    ref_top1: float
    kv_delta_ppl_pct: float
    kv_kld: float
    kv_top1: float
    kld_between: float  # mean KL(P_ref || P_kveval)
    max_abs_logit_gap: float
    kld_between_by_position: list[float] = field(default_factory=list, repr=False)
    notes: str = ""
    #: llama-perplexity's statistics of each side against its own baseline (:func:`kveval.stats.llama_perplexity_stats`
    #: over the scored positions): the system's quantized run against its full-precision one, kveval's likewise
    ref_stats: dict = field(default_factory=dict, repr=False)
    kv_stats: dict = field(default_factory=dict, repr=False)

    @property
    def ratio(self) -> float:
        """kld_between / ref_kld: the parity figure (0: identical; tests ask for at most 0.1)."""
        return self.kld_between / self.ref_kld if self.ref_kld > 0 else math.inf

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def compare(system: str, cache_type: str, preset: str, ids: torch.Tensor, *, ref_fp: torch.Tensor,
            ref: torch.Tensor, kv_fp: torch.Tensor, kv: torch.Tensor, start: int = 0, notes: str = "") -> ParityRow:
    """Metrics of one cache type. ids ``[T]``; logits ``[T, vocab]`` (position t predicts ids[t + 1]); positions
    ``start .. T-2`` are scored (``start``: e.g. the prompt length, to score decoded tokens only)."""
    targets = ids[start + 1:]
    sl = slice(start, ids.shape[0] - 1)

    def side(base: torch.Tensor, x: torch.Tensor) -> tuple[float, float, float]:
        b = compare_logits(base[sl], base[sl], targets)
        m = compare_logits(base[sl], x[sl], targets)
        ppl_b, ppl = math.exp(float(b["nll"].mean())), math.exp(float(m["nll"].mean()))
        return 100.0 * (ppl / ppl_b - 1.0), float(m["kld"].mean()), float(m["agree"].mean())

    def stats(base: torch.Tensor, x: torch.Tensor) -> dict:
        v = llama_token_values(base[sl], x[sl], targets)
        return llama_perplexity_stats(llama_sums(v["nll"], v["nll_base"], v["kld"], v["p_diff"], v["same_top"]),
                                      v["kld"].float().numpy(), v["p_diff"].float().numpy())

    r = side(ref_fp, ref)
    k = side(kv_fp, kv)
    between = compare_logits(ref[sl], kv[sl], targets)["kld"]
    gap = float((ref[sl].double() - kv[sl].double()).abs().max())
    return ParityRow(system, cache_type, preset, int(targets.numel()), *r, *k, float(between.mean()), gap,
                     between.tolist(), notes, stats(ref_fp, ref), stats(kv_fp, kv))


def parse_cache_type(text: str, system: str, prefix: str, sizes) -> tuple[int, int]:
    """``"{prefix}{bits}/p{prompt}"`` -> (bits, prompt), e.g. ``parse_cache_type("int4/p128", "hf_quanto", "int",
    (4, 2)) == (4, 128)``; KvevalError naming the system when ``bits`` is not in ``sizes`` or the prompt is < 1."""
    head, _, tail = text.strip().partition("/")
    try:
        bits = int(head.removeprefix(prefix))
        prompt = int(tail.removeprefix("p"))
    except ValueError:
        bits = prompt = -1
    if not head.startswith(prefix) or not tail.startswith("p") or bits not in sizes or prompt < 1:
        choices = " or ".join(f"{prefix}{b}/pN" for b in sorted(sizes, reverse=prefix == "int"))
        example = f"{prefix}{sorted(sizes, reverse=prefix == 'int')[0]}/p128"
        raise KvevalError(f"{system} cache type '{text}': expected {choices} with N >= 1 (e.g. {example})")
    return bits, prompt


def model_and_ids(system: str, model_name: str, model, ids, start: int, tokens: int):
    """The model and the ids ``[T]`` a parity run compares on: ``model``/``ids`` as given, else ``model_name``
    loaded in float32 and, when ``ids`` is None, ``tokens`` ids of the builtin corpus from ``start``. KvevalError
    (one line, naming ``system``) unless the ids are one-dimensional with T >= 2."""
    if model is None:
        from kveval.models import load_model

        model, tok = load_model(model_name, dtype="float32")
        if ids is None:
            from kveval.data import load_tokens

            ids = load_tokens("builtin", tok, max_tokens=start + tokens)[start:start + tokens]
    if ids is None or ids.dim() != 1 or ids.numel() < 2:
        raise KvevalError(f"{system} parity needs ids [T] with T >= 2")
    return model, ids
