"""The GPU check: what kveval does on an accelerator, measured in one go (scripts/gpu_check.sh runs it there).

    python bench/gpu_check.py --out DIR            # on a GPU: tiny families, then an 8B-shaped model in bfloat16
    python bench/gpu_check.py --small --out DIR    # on the CPU, tiny shapes and short contexts (a CI test)

Random-weight models built from configs (nothing is downloaded). Sections, each timed and kept on its own (an error
in one is recorded and the next runs):

* ``equivalence``: per tiny attention family (GQA, sliding, MLA latent, linear-attention and Mamba hybrids) and
  dtype (float32, bfloat16), the KLD along the policy's own greedy path from ONE teacher-forced emulated pass
  (``kveval.tasks.common.teacher.path_kld``) against the KLD the real ``QuantizedKVCache`` gives while decoding
  that path token by token beside the FP model's cache (``lockstep_generate``). On the CPU in float64 they agree to
  1e-9 (tests/test_generation_decode.py); in float32 and bfloat16 rounding moves quantization codes, so the check
  passes when the mean KLDs agree within ``TOLERANCE[dtype]`` (relative) and the policy differs from FP at all.
* ``memory``: ``torch.cuda.max_memory_allocated`` growth (else the cache's own resident bytes) during a chunked
  prefill and greedy steps through DynamicCache and through the real cache (lean read), against the memory bill
  (``kveval.memory.kv_bytes``) at each context.
* ``speed``: one forward pass over the whole context, emulated under each main preset against the bare model
  (time ratio), and whether the longest context's emulated pass fits.
* ``decode``: greedy decode tokens/s through the real cache (lean and buffered reads) against DynamicCache at one
  context, per batch size.
* ``generation``: the generation task's own loop (``lockstep_generate``: the policy's real cache drives, the FP
  model's cache follows for the KLD of every step), tokens/s per batch size (1 and 32), against the same loop with
  both caches ``DynamicCache`` (``policy=None``).

Writes ``gpu_check.json`` (machine, versions, every number) and ``gpu_check.md`` (the tables) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script from the repository: kveval beside it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20
FAMILIES = ["tiny-llama", "tiny-gemma3", "tiny-deepseek-v3", "tiny-qwen3-next", "tiny-granite-hybrid"]
#: relative agreement of the mean KLD, emulation against the real cache, per dtype
TOLERANCE = {"float32": 0.25, "bfloat16": 0.5, "float64": 1e-6}
SECTIONS = ("equivalence", "memory", "speed", "decode", "generation")
MAIN_PRESETS = ["int4_g64", "kivi2", "hf_quanto_int4", "vllm_fp8", "vllm_fp8_fa3", "llamacpp_q4_0", "vllm_nvfp4"]
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                max_position_embeddings=131072, rms_norm_eps=1e-5)


def settings(small: bool, device: str) -> dict:
    """What each section runs: the GPU sizes, or tiny ones for ``--small`` (the CPU dry run in CI)."""
    if small:
        return {"device": device, "families": FAMILIES, "dtypes": ["float32"], "prompt": 24, "new_tokens": 12,
                "big": None, "contexts": [256, 512], "longest": 1024, "batches": [1, 4], "decode_context": 256,
                "decode_steps": 8, "chunk": 128, "presets": ["int4_g32", "kivi2", "vllm_fp8", "llamacpp_q4_0"],
                "generation_batches": [1, 4], "generation_prompt": 32, "generation_tokens": 8}
    return {"device": device, "families": FAMILIES, "dtypes": ["float32", "bfloat16"], "prompt": 256,
            "new_tokens": 64, "big": LLAMA_8B, "contexts": [8192, 32768], "longest": 131072, "batches": [1, 16],
            "decode_context": 8192, "decode_steps": 32, "chunk": 2048, "presets": MAIN_PRESETS,
            "generation_batches": [1, 32], "generation_prompt": 1024, "generation_tokens": 128}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def big_model(cfg: dict | None, device: str, dtype: torch.dtype):
    """The model of the memory, speed and decode sections: a random Llama of ``cfg``'s shape (bfloat16 on the
    GPU), else (``--small``) the tiny Llama."""
    from kveval.models.builtin import build_tiny_model

    if cfg is None:
        model = build_tiny_model("tiny-llama", dtype="float32")
        model.config.max_position_embeddings = 1 << 20
        return model.to(device)
    from transformers import LlamaConfig, LlamaForCausalLM

    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(saved)
    model.eval().requires_grad_(False)
    model.kveval_name = "llama-3.1-8b-shaped (random weights)"
    return model


def check_equivalence(s: dict) -> list[dict]:
    from kveval.models.builtin import build_tiny_model
    from kveval.policy import KVPolicy
    from kveval.tasks.common.lockstep import lockstep_generate
    from kveval.tasks.common.teacher import path_kld

    rows = []
    policy = KVPolicy.preset("int4_g32")  # divides every tiny family's widths (head_dim 32; MLA's 512 + 64)
    for family in s["families"]:
        for dtype in s["dtypes"]:
            row = {"family": family, "dtype": dtype, "policy": policy.name}
            try:
                model = build_tiny_model(family, dtype=dtype).to(s["device"])
                g = torch.Generator().manual_seed(0)
                prompt = torch.randint(4, model.config.vocab_size, (s["prompt"],), generator=g).tolist()
                t0 = time.perf_counter()
                real = lockstep_generate(model, [prompt], policy, driver="policy", max_new_tokens=s["new_tokens"],
                                         eos_ids=set(), pad_id=0)[0]
                emulated = path_kld(model, prompt, real.tokens, {"p": policy})["p"]
                _sync(s["device"])
                mean_real, mean_emu = sum(real.kld) / len(real.kld), sum(emulated) / len(emulated)
                rel = abs(mean_emu - mean_real) / max(mean_real, 1e-12)
                row.update(steps=len(real.tokens), kld_real=mean_real, kld_emulated=mean_emu, rel_diff=rel,
                           ok=bool(mean_real > 1e-8 and rel <= TOLERANCE[dtype]), seconds=time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - recorded, and the next family runs
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            rows.append(row)
    return rows


@torch.no_grad()
def _prefill_and_decode(model, ids, cache, chunk: int, steps: int) -> tuple[float, float]:
    from kveval.patch import cache_kwargs

    kw = cache_kwargs(model, cache) if hasattr(cache, "policy") else {"past_key_values": cache}
    device = str(ids.device)
    _sync(device)
    t0 = time.perf_counter()
    logits = None
    for start in range(0, ids.shape[1], chunk):
        logits = model(ids[:, start:start + chunk], use_cache=True, logits_to_keep=1, **kw).logits
    _sync(device)
    t1 = time.perf_counter()
    for _ in range(steps):
        logits = model(logits[:, -1:].argmax(-1), use_cache=True, logits_to_keep=1, **kw).logits
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def _cache(model, kind: str, policy):
    from transformers import DynamicCache

    from kveval.patch import QuantizedKVCache

    return DynamicCache(config=model.config) if kind == "dynamic" else QuantizedKVCache(model, policy, read=kind)


def check_memory(model, s: dict) -> list[dict]:
    from kveval.memory import Arch, kv_bytes
    from kveval.patch import resident_nbytes
    from kveval.policy import KVPolicy

    policy = KVPolicy.preset("int4_g64" if s["big"] else "int4_g32")
    arch = Arch.from_model(model)
    size = next(model.parameters()).element_size()
    cuda = s["device"].startswith("cuda")
    rows = []
    for ctx in s["contexts"]:
        ids = torch.randint(4, model.config.vocab_size, (1, ctx), device=s["device"])
        for kind in ("dynamic", "lean"):
            row = {"context": ctx, "cache": kind, "policy": "fp16" if kind == "dynamic" else policy.name}
            try:
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                cache = _cache(model, kind, policy)
                _prefill_and_decode(model, ids, cache, s["chunk"], s["decode_steps"])
                tokens = ctx + s["decode_steps"]
                bill = kv_bytes(arch, "fp16" if kind == "dynamic" else policy, tokens, fp_bytes=size,
                                prompt=min(s["chunk"], ctx)).total
                row.update(bill_mib=bill / MIB, resident_mib=resident_nbytes(cache) / MIB)
                if cuda:
                    row["peak_growth_mib"] = (torch.cuda.max_memory_allocated() - before) / MIB
                del cache
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
    return rows


@torch.no_grad()
def check_speed(model, s: dict) -> list[dict]:
    from kveval.patch import emulate
    from kveval.policy import KVPolicy

    rows = []
    cuda = s["device"].startswith("cuda")

    def timed(fn) -> float:
        fn()  # warm-up (kernels, autotuning)
        _sync(s["device"])
        t0 = time.perf_counter()
        fn()
        _sync(s["device"])
        return time.perf_counter() - t0

    for ctx in s["contexts"]:
        ids = torch.randint(4, model.config.vocab_size, (1, ctx), device=s["device"])
        bare = timed(lambda ids=ids: model(ids, logits_to_keep=1))
        for name in s["presets"]:
            row = {"context": ctx, "policy": name, "bare_s": bare}
            try:
                policy = KVPolicy.preset(name)

                def run(policy=policy, ids=ids):
                    with emulate(model, policy):
                        model(ids, logits_to_keep=1)

                row["emulated_s"] = timed(run)
                row["ratio"] = row["emulated_s"] / bare
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
    longest = {"context": s["longest"], "policy": s["presets"][0]}
    try:
        ids = torch.randint(4, model.config.vocab_size, (1, s["longest"]), device=s["device"])
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with emulate(model, KVPolicy.preset(s["presets"][0])):
            model(ids, logits_to_keep=1)
        _sync(s["device"])
        longest.update(fits=True, seconds=time.perf_counter() - t0)
        if cuda:
            longest["peak_mib"] = torch.cuda.max_memory_allocated() / MIB
    except torch.OutOfMemoryError as exc:
        longest.update(fits=False, error=f"OutOfMemoryError: {str(exc)[:200]}")
    except Exception as exc:  # noqa: BLE001
        longest.update(fits=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    rows.append(longest)
    return rows


def check_decode(model, s: dict) -> list[dict]:
    from kveval.policy import KVPolicy

    policy = KVPolicy.preset("int4_g64" if s["big"] else "int4_g32")
    rows = []
    for batch in s["batches"]:
        ids = torch.randint(4, model.config.vocab_size, (batch, s["decode_context"]), device=s["device"])
        base = None
        for kind in ("dynamic", "lean", "buffered"):
            row = {"batch": batch, "context": s["decode_context"], "cache": kind}
            try:
                _, seconds = _prefill_and_decode(model, ids, _cache(model, kind, policy), s["chunk"],
                                                 s["decode_steps"])
                base = _rated(row, batch * s["decode_steps"] / seconds, kind == "dynamic", base, "vs_dynamic")
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
    return rows


def _rated(row: dict, tokens_per_s: float, is_base: bool, base: float | None, ratio: str) -> float | None:
    """``row``'s ``tokens_per_s``, and its ratio to ``base`` under ``ratio`` unless it is the base itself;
    returns the base of the next rows."""
    row["tokens_per_s"] = tokens_per_s
    if is_base:
        return tokens_per_s
    if base:
        row[ratio] = tokens_per_s / base
    return base


@torch.no_grad()
def check_generation(model, s: dict) -> list[dict]:
    from kveval.policy import KVPolicy
    from kveval.tasks.common.lockstep import lockstep_generate

    policy = KVPolicy.preset("int4_g64" if s["big"] else "int4_g32")
    rows = []
    for batch in s["generation_batches"]:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(4, model.config.vocab_size, (batch, s["generation_prompt"]), generator=g).tolist()
        base = None
        for name, p in (("fp16 (both DynamicCache)", None), (policy.name, policy)):
            row = {"batch": batch, "prompt": s["generation_prompt"], "new_tokens": s["generation_tokens"],
                   "policy": name}
            try:
                _sync(s["device"])
                t0 = time.perf_counter()
                out = lockstep_generate(model, prompts, p, driver="policy", max_new_tokens=s["generation_tokens"],
                                        eos_ids=set(), pad_id=0)
                _sync(s["device"])
                seconds = time.perf_counter() - t0
                tokens = sum(len(t.tokens) for t in out)
                row.update(seconds=seconds, tokens=tokens)
                base = _rated(row, tokens / seconds, p is None, base, "vs_fp16")
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
    return rows


def environment(device: str) -> dict:
    import transformers

    import kveval

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "kveval": getattr(kveval, "__version__", "?"), "device": device,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    return env


def markdown(doc: dict) -> str:
    """The tables of ``doc`` (gpu_check.json) as Markdown."""
    def table(rows: list[dict]) -> list[str]:
        cols = list(dict.fromkeys(k for r in rows for k in r))
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            out.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
        return out

    lines = [f"# kveval GPU check ({'small, ' if doc['small'] else ''}{doc['env'].get('gpu', doc['env']['device'])})",
             "", "Environment: " + ", ".join(f"{k} {v}" for k, v in doc["env"].items()), ""]
    for name in SECTIONS:
        section = doc["sections"].get(name, {})
        lines += [f"## {name} ({section.get('seconds', 0):.1f} s)", ""]
        lines += table(section["rows"]) if section.get("rows") else [f"error: {section.get('error', 'not run')}"]
        lines.append("")
    return "\n".join(lines)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v).replace("|", "/")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes and short contexts (the CPU dry run)")
    ap.add_argument("--out", default="results/gpu_check", help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--only", default=None, help="comma-separated sections (default: all)")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    s = settings(args.small, device)
    torch.manual_seed(0)
    doc: dict = {"small": args.small, "env": environment(device), "settings": {k: v for k, v in s.items()
                                                                               if k != "big"}, "sections": {}}
    wanted = set((args.only or ",".join(SECTIONS)).split(","))
    model = None
    checks = {"equivalence": check_equivalence, "memory": check_memory, "speed": check_speed,
              "decode": check_decode, "generation": check_generation}
    for name, fn in checks.items():
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            if fn is check_equivalence:
                rows = fn(s)
            else:
                if model is None:
                    model = big_model(s["big"], device, torch.bfloat16)
                rows = fn(model, s)
            doc["sections"][name] = {"rows": rows, "seconds": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001 - a section that breaks is recorded; the others still run
            doc["sections"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                                     "seconds": time.perf_counter() - t0}
        print(f"gpu_check: {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str))
    (out / "gpu_check.md").write_text(markdown(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
