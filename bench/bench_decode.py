"""Greedy decoding through the real quantized cache against plain HF generation (DynamicCache), same process.

    .venv/bin/python bench/bench_decode.py [--model builtin:smollm2-135m] [--batch 4] [--prompt 1024]
                                           [--new-tokens 32] [--policies int4_g64,kivi2] [--repeats 2]
                                           [--threads N] [--skip-single] [--cache-from FILE]
                                           [--reads lean,buffered]

The same ``--batch`` prompts (builtin corpus, lengths ``prompt``, ``prompt - 37``, ``prompt - 2*37`` ...: left
padding in a batch) are generated greedily, ``--new-tokens`` tokens each (``min_new_tokens`` too: no early stop),
two ways per cache:

* ``batched``: one ``model.generate`` over the left-padded batch;
* ``single``: one ``model.generate`` per prompt (what the needle and ruler tasks did before batching).

Caches: HF's ``DynamicCache`` (``dynamic``), this ``QuantizedKVCache`` under each policy on each of ``--reads``
(``<policy>@lean``, ``<policy>@buffered``), and with ``--cache-from
FILE`` the ``QuantizedKVCache`` of another version of ``kveval/patch/cache.py`` (e.g. ``git show
b303ddb:kveval/patch/cache.py > /tmp/cache_old.py``; printed as ``<policy>@old``; that version reads no left
padding, so its batched rows count padding as tokens).

Timing: a logits processor stamps every generation step, so ``prefill`` is the first step (prompt forward) and
``decode`` the ``new_tokens - 1`` steps after it, each timed inside one ``generate`` call (no subtraction of two
runs, whose noise on a shared machine swamps the decode time). Printed per way and cache: prefill seconds, decode
tokens/s (tokens of all rows / decode seconds) and the ratio of decode tokens/s to DynamicCache's for the same way
(1.0 = no overhead). Medians of ``--repeats``, the caches interleaved so that a load change hits them alike. Last,
whether the batched tokens equal the per-prompt tokens (float32: a padded batch and a single row may round
differently, and a flip changes the continuation).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kveval.data import load_tokens
from kveval.models import load_model
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy
from kveval.tasks._generation import left_padded


class StepClock(LogitsProcessor):
    """Records ``time.perf_counter()`` at every generation step (after each forward pass)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


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
             cache_class=QuantizedKVCache) -> tuple[torch.Tensor, float, float]:
    """(generated tokens ``[rows, new_tokens]``, prefill seconds, decode seconds)."""
    clock = StepClock()
    kwargs: dict = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
    if policy is not None:
        kwargs.update(cache_kwargs(model, cache_class(model, policy)))
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)[:, ids.shape[1]:]
    return out, clock.stamps[0] - start, clock.stamps[-1] - clock.stamps[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--policies", default="int4_g64,kivi2")
    ap.add_argument("--reads", default="lean", help="QuantizedKVCache read paths to time: lean, buffered or both")
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

    def run(way: str, policy, cache_class) -> tuple[torch.Tensor, float, float]:
        if way == "batched":
            return generate(model, ids, mask, N, policy, pad, cache_class)
        outs, prefill, decode = [], 0.0, 0.0
        for p in prompts:
            out, a, b = generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), N, policy, pad,
                                 cache_class)
            outs.append(out)
            prefill, decode = prefill + a, decode + b
        return torch.cat(outs), prefill, decode

    ways = ["batched"] if args.skip_single else ["batched", "single"]
    for name in args.policies.split(","):
        policy = KVPolicy.preset(name)
        caches = [("dynamic", None, QuantizedKVCache)]
        for read in args.reads.split(","):
            caches.append((f"{name}@{read}", policy, functools.partial(QuantizedKVCache, read=read)))
        if old_cache is not None:
            caches.append((f"{name}@old", policy, old_cache))
        times: dict[tuple[str, str], dict[str, list[float]]] = {}
        outputs: dict[tuple[str, str], torch.Tensor] = {}
        for _ in range(args.repeats):
            for way in ways:
                for cache_name, pol, cache_class in caches:
                    out, prefill, decode = run(way, pol, cache_class)
                    rec = times.setdefault((way, cache_name), {"prefill": [], "decode": []})
                    rec["prefill"].append(prefill)
                    rec["decode"].append(decode)
                    outputs[(way, cache_name)] = out
        print(f"\npolicy {name}")
        print(f"{'way':8s} {'cache':14s} {'prefill s':>9s} {'decode s':>9s} {'decode tok/s':>12s} {'ratio':>7s}")
        rates = {}
        for (way, cache_name), rec in times.items():
            prefill, decode = statistics.median(rec["prefill"]), statistics.median(rec["decode"])
            rates[(way, cache_name)] = (prefill, decode, B * (N - 1) / max(decode, 1e-9))
        for (way, cache_name), (prefill, decode, rate) in rates.items():
            print(f"{way:8s} {cache_name:14s} {prefill:9.2f} {decode:9.2f} {rate:12.2f} "
                  f"{rate / rates[(way, 'dynamic')][2]:7.3f}")
        if "single" in ways:
            for cache_name, _, _ in caches:
                same = torch.equal(outputs[("batched", cache_name)], outputs[("single", cache_name)])
                print(f"batched tokens == per-prompt tokens under {cache_name}: {same}")


if __name__ == "__main__":
    main()
