"""Cold vs warm load of builtin:smollm2-135m, in one process.

    python bench/bench_load.py

Cold: a fresh, empty KVEVAL_CACHE (GGUF dequantization + writing the safetensors cache entry + loading it).
Warm: the same call again (verify the entry's marker + load safetensors). Prints both and their ratio.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch


def main() -> None:
    root = tempfile.mkdtemp(prefix="kveval-bench-")
    os.environ["KVEVAL_CACHE"] = root
    try:
        from kveval.models import load_model

        load_model("builtin:tiny-llama")  # import transformers & friends outside the timings
        t = time.perf_counter()
        cold_model, tok = load_model("builtin:smollm2-135m")
        cold = time.perf_counter() - t
        warm_times = []
        for _ in range(3):
            t = time.perf_counter()
            warm_model, _ = load_model("builtin:smollm2-135m")
            warm_times.append(time.perf_counter() - t)
        warm = min(warm_times)
        ids = torch.tensor([tok("The KV cache stores keys and values.", add_special_tokens=False).input_ids])
        with torch.no_grad():
            same = torch.equal(cold_model(ids).logits, warm_model(ids).logits)
        print(f"torch threads {torch.get_num_threads()}")
        print(f"cold load (convert GGUF + cache): {cold:7.2f} s")
        print(f"warm load (from cache), best of 3: {warm:7.2f} s   (all: {', '.join(f'{x:.2f}' for x in warm_times)})")
        print(f"ratio cold/warm: {cold / warm:7.1f}x   identical logits: {same}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
