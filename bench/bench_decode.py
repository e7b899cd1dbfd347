"""Greedy decoding through the real quantized cache against plain HF generation (DynamicCache), same process.

    .venv/bin/python bench/bench_decode.py [--model builtin:smollm2-135m] [--batch 4] [--prompt 1024]
                                           [--new-tokens 32] [--policies int4_g64,kivi2] [--repeats 2]

The same ``--batch`` prompts (builtin corpus, lengths ``prompt``, ``prompt - 37``, ``prompt - 2*37`` ...: left
padding in a batch) are generated greedily, ``--new-tokens`` tokens each, four ways per policy:

* ``batched``: one ``model.generate`` over the left-padded batch; HF's DynamicCache, then ``QuantizedKVCache``;
* ``single``: one ``model.generate`` per prompt (what the needle and ruler tasks did before batching).

Timing is split: a run with ``max_new_tokens=1`` is the prefill; ``decode`` is the rest (``new_tokens - 1`` steps).
Printed per way: decode tokens/s (generated tokens of all rows / decode seconds), end-to-end tokens/s, and the
ratio quantized / DynamicCache of each (1.0 = no overhead). Medians of ``--repeats`` runs, interleaved so that a
load change on a shared machine hits both caches alike.

``--cache-from FILE`` adds the ``QuantizedKVCache`` of another version of ``kveval/patch/cache.py`` (e.g. ``git
show b303ddb:kveval/patch/cache.py > /tmp/cache_old.py``), timed in the same process as ``<policy>@old``: a before /
after comparison under the same load. (That version reads no left padding: its rows count padding as tokens.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kveval.data import load_tokens
from kveval.models import load_model
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both ``[batch, longest]``, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def load_cache_class(path: str):
    """``QuantizedKVCache`` of the cache module at ``path`` (imported under another name)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("kveval_bench_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.QuantizedKVCache


@torch.no_grad()
def generate(model, ids, mask, new_tokens: int, policy: KVPolicy | None, pad_id: int,
             cache_class=QuantizedKVCache) -> torch.Tensor:
    kwargs: dict = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        pad_token_id=pad_id)
    if policy is not None:
        kwargs.update(cache_kwargs(model, cache_class(model, policy)))
    return model.generate(ids, **kwargs)[:, ids.shape[1]:]


def timed(fn) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--policies", default="int4_g64,kivi2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-single", action="store_true", help="only the batched runs")
    ap.add_argument("--cache-from", default=None, help="another cache.py to time beside this one")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    old_cache = load_cache_class(args.cache_from) if args.cache_from else None
    model, tok = load_model(args.model)
    corpus = load_tokens("builtin", tok).tolist()
    lengths = [args.prompt - 37 * i for i in range(args.batch)]
    prompts = [corpus[1000 * i: 1000 * i + n] for i, n in enumerate(lengths)]
    pad = model.generation_config.pad_token_id or tok.pad_token_id or tok.eos_token_id
    ids, mask = left_padded(prompts, pad)
    N, B = args.new_tokens, args.batch
    print(f"{args.model}, {torch.get_num_threads()} threads, batch {B}, prompts {lengths}, {N} new tokens each")
    generate(model, ids[:, -64:], mask[:, -64:], 2, None, pad)  # warm-up

    def ways(policy, cache_class=QuantizedKVCache):
        out = {"batched": lambda n: generate(model, ids, mask, n, policy, pad, cache_class)}
        if not args.skip_single:
            out["single"] = lambda n: torch.cat([
                generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), n, policy, pad,
                         cache_class)
                for p in prompts])
        return out

    for name in args.policies.split(","):
        policy = KVPolicy.preset(name)
        times: dict[tuple[str, str], dict[str, list[float]]] = {}
        outputs: dict[tuple[str, str], torch.Tensor] = {}
        caches = [("dynamic", None, QuantizedKVCache), (name, policy, QuantizedKVCache)]
        if old_cache is not None:
            caches.append((f"{name}@old", policy, old_cache))
        for _ in range(args.repeats):
            for cache_name, pol, cache_class in caches:
                for way, fn in ways(pol, cache_class).items():
                    t1, _ = timed(lambda fn=fn: fn(1))
                    tN, out = timed(lambda fn=fn: fn(N))
                    rec = times.setdefault((way, cache_name), {"prefill": [], "total": []})
                    rec["prefill"].append(t1)
                    rec["total"].append(tN)
                    outputs[(way, cache_name)] = out
        print(f"\npolicy {name}")
        print(f"{'way':8s} {'cache':10s} {'prefill s':>9s} {'total s':>8s} {'decode tok/s':>12s} {'e2e tok/s':>10s} "
              f"{'decode ratio':>12s} {'e2e ratio':>9s}")
        rates = {}
        for (way, cache_name), rec in times.items():
            prefill, total = statistics.median(rec["prefill"]), statistics.median(rec["total"])
            decode = max(total - prefill, 1e-9)
            rates[(way, cache_name)] = (B * (N - 1) / decode, B * N / total, prefill, total)
        for (way, cache_name), (dec, e2e, prefill, total) in rates.items():
            ref = rates[(way, "dynamic")]
            print(f"{way:8s} {cache_name:10s} {prefill:9.2f} {total:8.2f} {dec:12.1f} {e2e:10.1f} "
                  f"{dec / ref[0]:12.3f} {e2e / ref[1]:9.3f}")
        if "single" in {w for w, _ in outputs}:
            for cache_name, _, _ in caches:
                same = torch.equal(outputs[("batched", cache_name)], outputs[("single", cache_name)])
                print(f"batched tokens == per-prompt tokens under {cache_name}: {same}")


if __name__ == "__main__":
    main()
