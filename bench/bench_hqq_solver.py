"""HQQ's zero-point solver: kveval's (``kveval.quant.formats.hqq.hqq_fit``) against hqq's own
``Quantizer.quantize``, on the same keys and values, same process.

    .venv/bin/python bench/bench_hqq_solver.py [--tokens 2048] [--bits 4] [--group 64] [--repeats 5] [--layers 4]

The tensors: the keys and values the builtin model's attention layers see over ``--tokens`` corpus tokens
(``kveval.calibration.collect.collect_kv``), one tensor per layer and kind ``[kv_heads, tokens, head_dim]``, each
quantized in groups of ``--group`` along head_dim as transformers' ``HQQQuantizedCache`` asks hqq to (``axis=1``,
float32 on the CPU). Timed, median of ``--repeats`` over the first ``--layers`` layers:

- ``hqq``: ``hqq.core.quantize.Quantizer.quantize(t, nbits, group_size, axis=1, compute_dtype=float32,
  device="cpu", bitpack=False)``: its solver (``optimize_weights_proximal_legacy``, up to 20 steps, stopping at
  the first step whose mean error over the tensor does not fall), then the codes;
- ``kveval call_stop``: ``hqq_fit(..., call_stop=True)``, hqq's rule exactly (the same zeros, checked here);
- ``kveval per group``: ``hqq_fit``'s default, what the emulation and the cache run: every group steps until its
  zero no longer moves (up to 20 steps), on the moving groups only.

Printed: milliseconds per tensor and each kveval variant over hqq's time. A ratio near or below 1 says the solver's
cost is hqq's own arithmetic, not kveval's emulation of it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kveval.calibration.collect import collect_kv
from kveval.data import load_tokens
from kveval.models import load_model
from kveval.quant.formats.hqq import hqq_fit


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    from hqq.core.quantize import Quantizer

    model, tok = load_model("builtin:smollm2-135m")
    ids = load_tokens("builtin", tok)[: args.tokens]
    with torch.no_grad(), collect_kv(model) as kv:
        model(ids[None])
    tensors = []
    for layer in range(min(args.layers, len(kv.layers))):
        for kind, x in kv.samples(layer).items():
            if kind != "key_pre_rope":
                tensors.append((f"layer {layer} {kind}", x.permute(1, 0, 2).contiguous()))  # [kv_heads, T, D]

    def hqq_zero(t: torch.Tensor) -> torch.Tensor:
        _, meta = Quantizer.quantize(t, nbits=args.bits, group_size=args.group, axis=1, compute_dtype=torch.float32,
                                     device="cpu", bitpack=False)
        return meta["zero"].reshape(-1, 1)

    print(f"builtin:smollm2-135m, {args.tokens} tokens, {args.bits}-bit groups of {args.group}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'tensor':<18} {'hqq ms':>8} {'call_stop ms':>13} {'ratio':>6} {'per group ms':>13} {'ratio':>6}")
    ratios_stop, ratios_group = [], []
    for name, t in tensors:
        groups = t.reshape(-1, args.group)
        _, _, zero = hqq_fit(groups, args.bits, call_stop=True)
        if not torch.equal(zero, hqq_zero(t)):
            raise SystemExit(f"{name}: kveval's call_stop zeros differ from hqq's")
        ms_hqq = median_ms(lambda: hqq_zero(t), args.repeats)  # noqa: B023 (called inside the loop)
        ms_stop = median_ms(lambda: hqq_fit(groups, args.bits, call_stop=True), args.repeats)  # noqa: B023
        ms_group = median_ms(lambda: hqq_fit(groups, args.bits), args.repeats)  # noqa: B023
        ratios_stop.append(ms_stop / ms_hqq)
        ratios_group.append(ms_group / ms_hqq)
        print(f"{name:<18} {ms_hqq:8.1f} {ms_stop:13.1f} {ms_stop / ms_hqq:6.2f} {ms_group:13.1f} "
              f"{ms_group / ms_hqq:6.2f}", flush=True)
    print(f"median ratio to hqq: call_stop {statistics.median(ratios_stop):.2f}, "
          f"per group {statistics.median(ratios_group):.2f}")


if __name__ == "__main__":
    main()
