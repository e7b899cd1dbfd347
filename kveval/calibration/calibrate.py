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
from contextlib import nullcontext
from pathlib import Path

import torch

from kveval.calibration.ranges import STATIC_GRANULARITIES, calibrate_ranges
from kveval.errors import KvevalError
from kveval.quant import preset


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


def dense_kind(kind: str, outliers: float) -> str:
    """The name of the ranges of ``kind`` taken without the outliers a spec with ``outliers`` removes."""
    return f"{kind}@{outliers:g}" if outliers else kind


@torch.no_grad()
def collect_ranges(model, tokens: torch.Tensor, cal, progress=None, outliers=()) -> dict:
    """``{(kind, granularity): [Ranges per layer]}`` from running ``model`` over ``tokens`` (the slice); for each
    fraction in ``outliers`` also the ranges of the dense part (kind ``key@0.01`` etc.). A kind missing in some
    layers (pre-RoPE keys of a layer without RoPE) is left out."""
    from kveval.calibration.collect import collect_kv
    from kveval.quant import split_outliers

    windows = [tokens[i:i + cal.seq_len] for i in range(0, len(tokens), cal.seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    target = preset(cal.target) if cal.target else None
    task = progress.task("calibrate: forward", total=len(windows), unit="tok") if progress else nullcontext(None)
    with collect_kv(model) as collected, task as advance:
        for w in windows:
            model(w[None].to(model.device))
            if advance is not None:
                advance(len(w))
        n_layers = len(collected.layers)
        out: dict = {}
        for layer in range(n_layers):
            for kind, x in collected.samples(layer).items():
                variants = [(kind, x)]
                for p in outliers:
                    k = math.ceil(p * x.shape[-1] - 1e-9)
                    variants.append((dense_kind(kind, p), split_outliers(x, k)[0]))
                for name, samples in variants:
                    for gran in STATIC_GRANULARITIES:
                        r = calibrate_ranges(samples, gran, cal.method, percentile=cal.percentile, target=target)
                        out.setdefault((name, gran), []).append(r)
    return {key: ranges for key, ranges in out.items() if len(ranges) == n_layers}


def calibrate(model, tokenizer, corpus_tokens: torch.Tensor, cfg, path: str | Path, progress=None,
              outliers=()) -> Path:
    """Calibrate on the slice ``cfg.calibration`` names and write the scales file at ``path`` (dense-part ranges
    for the fractions in ``calibration.outliers`` and ``outliers``)."""
    from kveval import __version__
    from kveval.calibration.scales_file import save_scales
    from kveval.data import tokenizer_fingerprint
    from kveval.models import model_info

    cal = cfg.calibration
    start, end = calibration_slice(len(corpus_tokens), cal.tokens)
    fractions = sorted(set(cal.outliers) | {float(p) for p in outliers if p})
    ranges = collect_ranges(model, corpus_tokens[start:end], cal, progress, fractions)
    info = model_info(model)
    header = {
        "model": info["name"], "layers": info["num_layers"], "kv_heads": info["num_kv_heads"],
        "head_dim": info["head_dim"], "corpus": cfg.data.source, "tokenizer": tokenizer_fingerprint(tokenizer),
        "token_start": start, "token_end": end, "tokens": end - start, "seq_len": cal.seq_len,
        "method": cal.method, "percentile": cal.percentile if cal.method == "percentile" else None,
        "target": preset(cal.target).to_dict() if cal.method == "mse" else None, "outliers": fractions,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "kveval": __version__,
    }
    return save_scales(path, ranges, header)


def default_output(cfg) -> Path:
    return Path(cfg.calibration.output) if cfg.calibration.output else Path("results") / "scales" / f"{cfg.name}.safetensors"


