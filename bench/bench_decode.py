"""Greedy decoding through the real quantized cache against plain HF generation (DynamicCache), same process.

    .venv/bin/python bench/bench_decode.py [--model builtin:smollm2-135m] [--batch 4] [--prompt 1024]
                                           [--new-tokens 32] [--policies int4_g64,kivi2] [--repeats 2]
                                           [--threads N] [--skip-single] [--cache-from FILE]
                                           [--reads lean,buffered] [--stages]

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

``--stages``: where a quantized cache's decode steps go, in milliseconds per step (medians of the repeats, decode
steps only, batched way): ``assemble`` (the lean path's transient read buffer, all layers), of it ``dequantize`` (each piece's
codes unpacked and decoded into it), and ``quantize`` (the tokens that leave the residual window: quantize, pack,
read back).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import Counter

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kveval.data import load_tokens
from kveval.models import load_model
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.patch import cache as cache_module
from kveval.policy import KVPolicy
from kveval.tasks.common.decoding import left_padded


class StepClock(LogitsProcessor):
    """Records ``time.perf_counter()`` at every generation step (after each forward pass)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


class StageTimer:
    """Milliseconds spent in the cache's stages (``--stages``) during the decode steps of the running
    ``generate`` (after its first step stamp: the prefill is left out)."""

    STAGES = ((cache_module.read_paths, "assembled", "assemble"),
              (cache_module.StoredChunk, "read_storage_into", "dequantize"),
              (cache_module.QuantizedKVLayer, "_flush", "quantize"))

    def __init__(self):
        self.seconds: Counter = Counter()
        self.clock: StepClock | None = None
        for owner, name, stage in self.STAGES:
            setattr(owner, name, self._timed(getattr(owner, name), stage))

    def _timed(self, fn, stage: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.clock is not None and self.clock.stamps:
                    self.seconds[stage] += time.perf_counter() - t0
        return timed

    def start(self, clock: StepClock) -> None:
        self.seconds.clear()
        self.clock = clock


TIMER: StageTimer | None = None


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
    if TIMER is not None:
        TIMER.start(clock)
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
    ap.add_argument("--stages", action="store_true", help="time the cache's stages during the decode steps")
    args = ap.parse_args()
    global TIMER
    if args.stages:
        TIMER = StageTimer()
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
                    rec = times.setdefault((way, cache_name), {"prefill": [], "decode": [], "stages": []})
                    rec["prefill"].append(prefill)
                    rec["decode"].append(decode)
                    if TIMER is not None:
                        rec["stages"].append(dict(TIMER.seconds))
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
        if TIMER is not None:
            steps = N - 1
            for (way, cache_name), rec in times.items():
                if cache_name == "dynamic" or way != "batched":  # single: the timer restarts at every prompt
                    continue
                parts = {stage: statistics.median(r.get(stage, 0.0) for r in rec["stages"]) * 1e3 / steps
                         for _, _, stage in StageTimer.STAGES}
                step = statistics.median(rec["decode"]) * 1e3 / steps
                print(f"{way:8s} {cache_name:14s} ms per decode step {step:.1f}: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
        if "single" in ways:
            for cache_name, _, _ in caches:
                same = torch.equal(outputs[("batched", cache_name)], outputs[("single", cache_name)])
                print(f"batched tokens == per-prompt tokens under {cache_name}: {same}")


if __name__ == "__main__":
    main()
