"""Cost of fake_quantize (the emulation hot path) relative to one attention call, measured in one process.

    python bench/bench_quant.py [--seq 4096] [--repeats 7]

Input: float32 K/V [1, 8, seq, 128]. Baseline: torch.nn.functional.scaled_dot_product_attention(q, k, v,
is_causal=True) on tensors of that shape. Each row: median time of fake_quantize / median time of SDPA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kveval.quant import QuantSpec, fake_quantize, preset


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    torch.manual_seed(0)
    shape = (1, 8, args.seq, 128)
    q, k, v = (torch.randn(shape) for _ in range(3))
    sdpa = median_seconds(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), args.repeats)

    cases = [
        ("token  int8", preset("int8"), None),
        ("group  int4_g64", preset("int4_g64"), None),
        ("channel int2 (block 128)", preset("int2_channel"), 128),
        ("tensor fp8_e4m3 (static)", preset("fp8_e4m3"), None),
        ("tensor int8 (dynamic)", preset("int8_tensor"), None),
        ("token  fp8_e4m3 (dynamic)", QuantSpec(format="fp8_e4m3", granularity="token"), None),
        ("group  q4_0 (ggml)", preset("q4_0"), None),
    ]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, x {list(shape)} float32")
    print(f"SDPA (causal): {sdpa * 1e3:.2f} ms (median of {args.repeats})")
    print(f"{'case':28s} {'ms':>8s} {'/ SDPA':>8s}")
    for name, spec, cb in cases:
        t = median_seconds(lambda spec=spec, cb=cb: fake_quantize(k, spec, channel_block=cb), args.repeats)
        print(f"{name:28s} {t * 1e3:8.2f} {t / sdpa:8.3f}")


if __name__ == "__main__":
    main()
