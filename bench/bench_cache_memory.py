"""What the real cache holds during decoding, against DynamicCache and against its memory bill.

    .venv/bin/python bench/bench_cache_memory.py [--model builtin:tiny-llama] [--lengths 1024,4096,16384,32768]
                                                 [--policy int4_g32] [--new-tokens 32] [--chunk 1024]
                                                 [--dtype float32] [--caches dynamic,lean,buffered] [--rss]

Per length L: the prompt (L token ids, random for a tiny model, the builtin corpus for a real one) goes through the
cache in calls of ``--chunk`` tokens (a chunked prefill: one L x L attention mask at 32k tokens would need GBs of
its own), then ``--new-tokens`` greedy steps of one token, each a forward call with the cache (what
``model.generate`` runs). Three caches: transformers' ``DynamicCache`` (``dynamic``) and kveval's
``QuantizedKVCache`` on its two read paths (``lean``, the default, and ``buffered``).

Measured, from the tensors the cache holds (``kveval.patch.resident_nbytes``: every storage reachable from the
cache object counted once, a view by its whole storage):

* ``resident``: after the last step;
* ``peak``: the largest, over every layer call, of what the cache holds plus the tensors that call returned to
  attention (a transient read buffer lives until attention has read it);
* ``bill``: ``kveval.memory.kv_bytes`` of ``Arch.from_model`` at L + new tokens in the model's dtype (plus the fixed
  state of linear-attention / Mamba layers); ``nbytes``: the cache's own count (equal to the bill, tested);
* ``layer_fp``: one layer's full-precision K+V history at that length (the peak's allowance).

``--rss`` also runs each (length, cache) in a fresh subprocess and reports the process's peak RSS growth over the
steps (``resource.getrusage`` maxrss after a warm-up call: the allocator's view, activations included, the same
for every cache); on CUDA ``torch.cuda.max_memory_allocated`` growth instead.

Printed: one row per length and cache with those figures in MiB and the ratios resident / bill and
(peak - bill) / layer_fp, and the decode tokens/s relative to DynamicCache's at the same length.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

MIB = 2**20


def _setup(args):
    from kveval.models import load_model
    from kveval.models.builtin import TINY_FAMILIES, build_tiny_model

    name = args.model.removeprefix("builtin:")
    if name in TINY_FAMILIES:
        model = build_tiny_model(name, dtype=args.dtype)
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, args.length + args.new_tokens)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, model.config.vocab_size, (1, args.length), generator=g)
    else:
        from kveval.data import load_tokens

        model, tok = load_model(args.model, dtype=args.dtype)
        ids = load_tokens("builtin", tok)[: args.length][None]
        if ids.shape[1] < args.length:
            raise SystemExit(f"the builtin corpus has only {ids.shape[1]} tokens; use --lengths up to that")
    return model, ids.to(model.device)


def _new_cache(model, kind: str, policy):
    from transformers import DynamicCache

    from kveval.patch import QuantizedKVCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return QuantizedKVCache(model, policy, read=kind)


@torch.no_grad()
def _decode(model, ids, cache, args) -> tuple[float, float]:
    """Chunked prefill then greedy steps through ``cache``; (prefill seconds, decode seconds)."""
    from kveval.patch import cache_kwargs

    kw = cache_kwargs(model, cache) if hasattr(cache, "policy") else {"past_key_values": cache}
    t0 = time.perf_counter()
    logits = None
    for s in range(0, ids.shape[1], args.chunk):
        logits = model(ids[:, s:s + args.chunk], use_cache=True, logits_to_keep=1, **kw).logits
    t1 = time.perf_counter()
    assert logits is not None
    for _ in range(args.new_tokens):
        nxt = logits[:, -1:].argmax(-1)
        logits = model(nxt, use_cache=True, logits_to_keep=1, **kw).logits
    return t1 - t0, time.perf_counter() - t1


def _bill(model, policy, tokens: int, prompt: int) -> tuple[int, int]:
    """(K/V bytes of the bill, fixed state bytes) at ``tokens`` positions in the model's dtype."""
    from kveval.memory import Arch, kv_bytes

    arch = Arch.from_model(model)
    size = next(model.parameters()).element_size()
    bill = kv_bytes(arch, policy, tokens, fp_bytes=size, prompt=min(prompt, tokens))
    return bill.total, bill.state


def measure(args) -> dict:
    from kveval.patch import resident_nbytes, watch_peak
    from kveval.policy import KVPolicy

    model, ids = _setup(args)
    policy = KVPolicy.preset(args.policy)
    tokens = args.length + args.new_tokens
    row: dict = {"length": args.length, "cache": args.cache, "policy": args.policy}
    if args.rss:
        _decode(model, ids[:, :16], _new_cache(model, args.cache, policy), args)  # warm the allocator
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.max_memory_allocated()
        before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cache = _new_cache(model, args.cache, policy)
    peak = watch_peak(cache)
    prefill_s, decode_s = _decode(model, ids, cache, args)
    row.update(resident=resident_nbytes(cache), peak=peak[0], prefill_s=prefill_s, decode_s=decode_s)
    row["nbytes"] = cache.nbytes()["total"] + cache.nbytes().get("state", 0) if hasattr(cache, "nbytes") else None
    bill, state = _bill(model, policy if args.cache != "dynamic" else KVPolicy.preset("fp16"), tokens,
                        min(args.chunk, args.length))
    row.update(bill=bill + state, state=state)
    cfg = model.config
    kv_layers = len(cache.layers)
    row["layer_fp"] = (2 * getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
                       * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
                       * tokens * next(model.parameters()).element_size())
    row["layers"] = kv_layers
    if args.rss:
        row["rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before_rss
        if torch.cuda.is_available():
            row["cuda_growth"] = torch.cuda.max_memory_allocated() - before
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny-llama")
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    ap.add_argument("--policy", default="int4_g32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--caches", default="dynamic,lean,buffered")
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args)))
        return
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for cache in args.caches.split(","):
            argv = [sys.executable, __file__, "--child", "--length", str(length), "--cache", cache,
                    "--model", args.model, "--policy", args.policy, "--new-tokens", str(args.new_tokens),
                    "--chunk", str(args.chunk), "--dtype", args.dtype, "--threads", str(args.threads)]
            if args.rss:
                argv.append("--rss")
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "child failed")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.model} policy {args.policy}, {args.new_tokens} new tokens, prefill in calls of {args.chunk}")
    head = (f"{'tokens':>7} {'cache':>9} {'resident':>9} {'peak':>9} {'bill':>9} {'layer_fp':>9} "
            f"{'res/bill':>8} {'(peak-bill)/layer_fp':>21} {'decode tok/s':>12} {'vs dynamic':>10}")
    if args.rss:
        head += f" {'rss growth':>10}"
    print(head + "   (MiB)")
    dyn: dict[int, float] = {}
    for r in rows:
        tps = args.new_tokens / r["decode_s"]
        if r["cache"] == "dynamic":
            dyn[r["length"]] = tps
        bill = r["bill"] if r["cache"] != "dynamic" else r["bill"]
        line = (f"{r['length']:>7} {r['cache']:>9} {r['resident'] / MIB:9.3f} {r['peak'] / MIB:9.3f} "
                f"{bill / MIB:9.3f} {r['layer_fp'] / MIB:9.3f} {r['resident'] / bill:8.4f} "
                f"{(r['peak'] - bill) / r['layer_fp']:21.3f} {tps:12.1f} "
                f"{tps / dyn[r['length']] if r['length'] in dyn else float('nan'):10.2f}")
        if args.rss:
            line += f" {r['rss_growth'] / MIB:10.1f}"
        print(line)


if __name__ == "__main__":
    main()
