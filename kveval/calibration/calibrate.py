"""Calibration of static K/V scales: run the model over a calibration slice of the corpus, collect each layer's
keys (post- and pre-RoPE) and values, reduce them to ranges per tensor / head / channel, write a scales file.

    kveval calibrate configs/static_vs_dynamic.yaml [--out FILE]

The slice is the last ``calibration.tokens`` tokens of the config's corpus (perplexity reads from the start), in
windows of ``calibration.seq_len``. ``check_overlap`` refuses a run whose perplexity tokens overlap the tokens a
scales file was calibrated on, unless ``calibration.allow_overlap``.
"""

from __future__ import annotations

import datetime as _dt
import math
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from kveval.errors import KvevalError
from kveval.models.checks import text_config
from kveval.quant import preset
from kveval.scales.ranges import STATIC_GRANULARITIES, Ranges, calibrate_ranges


def calibration_slice(n_tokens: int, tokens: int) -> tuple[int, int]:
    """Corpus positions ``[start, end)`` of the calibration slice: the last ``tokens`` tokens."""
    if tokens > n_tokens:
        raise KvevalError(
            f"calibration.tokens {tokens} is more than the corpus holds ({n_tokens} tokens); lower it"
        )
    return n_tokens - tokens, n_tokens


def evaluation_range(cfg, n_tokens: int) -> tuple[int, int] | None:
    """Corpus positions ``[start, end)`` that the config's perplexity tasks read (None when it has none)."""
    spans = []
    for entry in cfg.tasks:
        if entry.kind == "perplexity":
            p = entry.params
            end = n_tokens if p.max_tokens is None else min(p.start_token + p.max_tokens, n_tokens)
            spans.append((p.start_token, end))
    return (min(s for s, _ in spans), max(e for _, e in spans)) if spans else None


def check_overlap(header: dict, cfg, n_tokens: int, tokenizer_fp: str, what: str) -> None:
    """KvevalError when the calibrated tokens ``header`` names overlap the run's perplexity tokens."""
    if cfg.calibration.allow_overlap:
        return
    if header.get("corpus") != cfg.data.source or header.get("tokenizer") != tokenizer_fp:
        return  # another corpus (or tokenization): disjoint by construction
    ev = evaluation_range(cfg, n_tokens)
    lo, hi = header.get("token_start", 0), header.get("token_end", 0)
    if ev is not None and lo < ev[1] and ev[0] < hi:
        raise KvevalError(
            f"{what} was calibrated on tokens [{lo}, {hi}) of corpus '{cfg.data.source}', which overlap the "
            f"perplexity tokens [{ev[0]}, {ev[1]}); lower perplexity.max_tokens or calibration.tokens, move perplexity.start_token, or set "
            "calibration.allow_overlap: true"
        )


def nuq_requests(cfg) -> dict[tuple[str, str, float], list[int]]:
    """``{(kind, style, p): [bits]}`` of the 'nuq' specs of the config's policies (kind ``key``, ``key_pre_rope``
    (a ``pre_rope`` policy's keys) or ``value``; style ``channel`` or ``token``; p the outlier fraction): the
    codebooks (and per-channel bounds) a calibration for this config fits."""
    out: dict[tuple[str, str, float], set[int]] = {}
    for policy in cfg.policies().values():
        for role, spec in policy.kind_specs():
            if not spec.is_none and spec.fmt.name == "nuq":
                kind = "key_pre_rope" if role == "key" and policy.pre_rope else role
                style = "channel" if spec.granularity == "channel" else "token"
                out.setdefault((kind, style, float(spec.outliers)), set()).add(spec.bits)
    return {key: sorted(bits) for key, bits in sorted(out.items())}


def dense_kind(kind: str, outliers: float) -> str:
    """The name of the ranges of ``kind`` taken without the outliers a spec with ``outliers`` removes."""
    return f"{kind}@{outliers:g}" if outliers else kind


@torch.no_grad()
def collect_ranges(model, tokens: torch.Tensor, cal, progress=None, outliers=(), nuq=None, nuq_out=None,
                   fisher: bool = True) -> dict:
    """``{(kind, granularity): [Ranges per layer]}`` from running ``model`` over ``tokens`` (the slice); for each
    fraction in ``outliers`` also the ranges of the dense part (kind ``key@0.01`` etc.). A kind missing in some
    layers (pre-RoPE keys of a layer without RoPE) is left out. ``nuq`` (`nuq_requests`): KVQuant's bounds and
    codebooks to fit for every kind, put into ``nuq_out`` as ``{tensor name: [per-layer tensor]}``
    (``kveval.scales.codebooks``), their k-means weighted by the Fisher information when ``fisher`` (each window
    then also runs backward from its mean next-token cross-entropy, as KVQuant's ``run-fisher.py``)."""
    from kveval.calibration.collect import collect_kv
    from kveval.quant import split_outliers
    from kveval.scales.codebooks import bounds_names, codebook_name, fit_layer
    from kveval.scales.ema import ema_ranges

    windows = [tokens[i:i + cal.seq_len] for i in range(0, len(tokens), cal.seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    target = preset(cal.target) if cal.target else None
    task = progress.task("calibrate: forward", total=len(windows), unit="tok") if progress else nullcontext(None)
    grads = bool(nuq) and fisher
    # minmax_ema is llm-compressor's observer, and llm-compressor calibrates with eager attention
    # (calibration_forward_context): the same kernels give it the same keys and values to the bit
    attention = _eager_attention(model) if cal.method == "minmax_ema" else nullcontext()
    with attention, collect_kv(model, fisher=grads) as collected, task as advance:
        for w in windows:
            ids = w[None].to(model.device)
            if grads:
                with torch.enable_grad():
                    logits = model(ids, use_cache=False).logits[0, :-1].float()
                    torch.nn.functional.cross_entropy(logits, ids[0, 1:]).backward()
                collected.harvest()
            else:
                model(ids)
            if advance is not None:
                advance(len(w))
        n_layers = len(collected.layers)
        out: dict = {}
        fitted_nuq: dict[str, list[torch.Tensor]] = {}
        ema = cal.method == "minmax_ema"  # per window, in order (llm-compressor's observer: kveval.scales.ema)
        kv_dtype = next(model.parameters()).dtype
        for layer in range(n_layers):
            weights = collected.fisher(layer) if grads else {}
            per_window = collected.layers[layer].parts
            for kind, x in collected.samples(layer).items():
                variants = [(kind, x, per_window[kind] if ema else [])]
                for p in outliers:
                    k = math.ceil(p * x.shape[-1] - 1e-9)
                    variants.append((dense_kind(kind, p), split_outliers(x, k)[0],
                                     [split_outliers(w, k)[0] for w in per_window[kind]] if ema else []))
                for name, samples, windows_of in variants:
                    for gran in STATIC_GRANULARITIES:
                        if ema:
                            r = ema_ranges(windows_of, gran, cal.averaging_constant, dtype=kv_dtype)
                        else:
                            r = calibrate_ranges(samples, gran, cal.method, percentile=cal.percentile,
                                                 target=target)
                        out.setdefault((name, gran), []).append(r)
                for (nuq_kind, style, p), bits in (nuq or {}).items():
                    if kind != nuq_kind:
                        continue
                    fitted = fit_layer(x, p, style, bits, weights.get(kind))
                    if style == "channel":
                        for stat, tname in zip(("hi", "lo"), bounds_names(kind, p)):
                            fitted_nuq.setdefault(tname, []).append(fitted[stat])
                    for b in bits:
                        fitted_nuq.setdefault(codebook_name(kind, p, style, b), []).append(fitted[f"nuq{b}"])
    # one entry per model layer, by layer index: a hybrid's linear-attention / Mamba layers hold no K/V (and have
    # no attention module): zeros there, which no quantizer reads
    at = [c.layer_idx for c in collected.layers]
    layers = int(getattr(text_config(model.config), "num_hidden_layers", n_layers) or n_layers)
    if nuq_out is not None:
        nuq_out.update({name: _by_layer(per, at, layers) for name, per in fitted_nuq.items() if len(per) == n_layers})
    return {key: _by_layer(ranges, at, layers) for key, ranges in out.items() if len(ranges) == n_layers}


def _by_layer(per: list, at: list[int], layers: int) -> list:
    """``per[j]`` (the entry of the attention module at model layer ``at[j]``) spread over ``layers`` model layers,
    zeros (of the first entry's shapes) at the layers without K/V."""
    if at == list(range(layers)):
        return per
    first = per[0]
    zero = (Ranges(*(torch.zeros_like(t) for t in (first.absmax, first.lo, first.hi))) if isinstance(first, Ranges)
            else torch.zeros_like(first))
    full = [zero] * layers
    for j, i in enumerate(at):
        full[i] = per[j]
    return full


@contextmanager
def _eager_attention(model):
    """The model with transformers' eager attention inside the block (restored after), when it can switch."""
    before = getattr(getattr(model, "config", None), "_attn_implementation", None)
    switch = hasattr(model, "set_attn_implementation") and before not in (None, "eager")
    if switch:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(before)


def calibrate(model, tokenizer, corpus_tokens: torch.Tensor, cfg, path: str | Path, progress=None,
              outliers=(), fisher: bool = True) -> Path:
    """Calibrate on the slice ``cfg.calibration`` names and write the scales file at ``path`` (dense-part ranges
    for the fractions in ``calibration.outliers`` and ``outliers``; KVQuant's bounds and codebooks for the 'nuq'
    specs of the config's policies, Fisher-weighted unless ``fisher`` is False)."""
    from kveval import __version__
    from kveval.data import tokenizer_fingerprint
    from kveval.models import model_info
    from kveval.scales.codebooks import MAX_ITER, STARTS, TOL
    from kveval.scales.file import save_scales

    cal = cfg.calibration
    start, end = calibration_slice(len(corpus_tokens), cal.tokens)
    fractions = sorted(set(cal.outliers) | {float(p) for p in outliers if p})
    nuq = nuq_requests(cfg)
    nuq_tensors: dict[str, list[torch.Tensor]] = {}
    ranges = collect_ranges(model, corpus_tokens[start:end], cal, progress, fractions, nuq, nuq_tensors, fisher)
    info = model_info(model)
    header = {
        "model": info["name"], "layers": info["num_layers"], "kv_heads": info["num_kv_heads"],
        "head_dim": info["head_dim"], "corpus": cfg.data.source, "tokenizer": tokenizer_fingerprint(tokenizer),
        "token_start": start, "token_end": end, "tokens": end - start, "seq_len": cal.seq_len,
        "method": cal.method, "percentile": cal.percentile if cal.method == "percentile" else None,
        **({"averaging_constant": cal.averaging_constant} if cal.method == "minmax_ema" else {}),
        "target": preset(cal.target).to_dict() if cal.method == "mse" else None, "outliers": fractions,
        "nuq": {"fits": [{"kind": kind, "style": style, "outliers": p, "bits": bits}
                         for (kind, style, p), bits in nuq.items()],
                "kmeans": {"max_iter": MAX_ITER, "tol": TOL, "starts": STARTS}, "fisher": fisher}
        if nuq else None,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "kveval": __version__,
    }
    extra = {name: torch.stack(per).float().contiguous() for name, per in nuq_tensors.items()}
    return save_scales(path, ranges, header, extra)


def default_output(cfg) -> Path:
    return Path(cfg.calibration.output) if cfg.calibration.output else Path("results") / "scales" / f"{cfg.name}.safetensors"


