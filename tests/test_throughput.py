"""Throughput settings of the perplexity task (issue #21): batched windows give the records of one window at a
time (float64, to float rounding), resume inside a batch recomputes only what is missing, a bfloat16 model's
metrics are float32 metrics of its logits, and the CUDA memory bookkeeping (peak per pass, cache emptied after
each) with the CUDA functions replaced by fakes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.data import load_tokens, token_windows
from kveval.models import load_model
from kveval.patch import emulate
from kveval.policy import KVPolicy
from kveval.stats import compare_logits
from kveval.tasks.perplexity import scorer as perplexity

POLICIES = [
    "int2_g32",
    "kivi2",  # keys per channel in 128-token blocks, values sliding with a lag: the 4-part attention
    "llamacpp_q4_0",  # transforms: GGUF order, Hadamard, query rounded to q8_0
    {"sinks": {"spec": "int4_g32", "residual": 16, "sink_tokens": 4, "prefill": "fp"}},
]


def config(out: Path, *, dtype: str = "float64", weights=None, kv=None, **ppl) -> dict:
    model: dict = {"name": "builtin:tiny-llama", "dtype": dtype}
    if weights:
        model["weights"] = weights
    params = {"seq_len": 160, "max_tokens": 1 + 7 * 159, "bootstrap": 50, **ppl}  # 7 windows of 160 tokens
    return {"name": "tp", "model": model, "data": "builtin", "kv": POLICIES if kv is None else kv,
            "tasks": [{"perplexity": params}], "output": str(out)}


def records(out: Path) -> dict[str, dict]:
    lines = (out / "records.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert len({r["key"] for r in recs}) == len(recs), "a key recorded twice"
    return {r["key"]: r for r in recs}


def assert_close(a, b, path: str = "", rel: float = 1e-10) -> None:
    """``a`` and ``b`` (records, lists, numbers) have the same structure and keys; numbers agree to ``rel``."""
    assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, (path, a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (path, sorted(a.keys() ^ b.keys()))
        for k in a:
            assert_close(a[k], b[k], f"{path}.{k}", rel)
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]", rel)
    elif isinstance(a, float) or isinstance(b, float):
        if math.isinf(a) or math.isinf(b):
            assert a == b, (path, a, b)
        else:
            assert abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-13, (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("ppl", [{}, {"stride": 40, "max_tokens": 160 + 6 * 40}, {"prefill_tokens": 24}],
                         ids=["rolling", "stride", "prefill"])
def test_batched_windows_give_the_records_of_single_windows(tmp_path, ppl):
    """batch_size 3 over 7 windows (batches of 3, 3 and a partial 1) == batch_size 1, record by record, in
    float64, for policies that cover the emulation's paths (two-part and four-part attention, transforms, sinks with
    an FP prefill), per-window diagnostics included; the metrics too."""
    one = run_experiment(validate(config(tmp_path / "b1", batch_size=1, **ppl)), quiet=True)
    three = run_experiment(validate(config(tmp_path / "b3", batch_size=3, **ppl)), quiet=True)
    a, b = records(tmp_path / "b1"), records(tmp_path / "b3")
    assert len(a) == 7 * 5 and a.keys() == b.keys()
    assert_close(a, b)
    assert any(r["kld_sum"] > 1e-3 for r in a.values())  # the policies do quantize (not a trivial equality)
    assert a["perplexity/w0/kivi2"]["start"] == 0 and a["perplexity/w6/kivi2"]["n_tokens"] == (
        40 if ppl.get("stride") else 159)
    for m in (one, three):
        m.pop("memory", None)
    assert_close(json.loads(json.dumps(one["policies"])), json.loads(json.dumps(three["policies"])), rel=1e-9)


def test_batched_weight_variants_and_resume_inside_a_batch(tmp_path, monkeypatch):
    """Weight variants run batched too (records == batch_size 1); a run resumed from a records file with holes
    inside batches recomputes exactly the missing (window, policy) rows and ends with the same records."""
    kv = ["int2_g32", "kivi2"]
    ref_out, out = tmp_path / "b1", tmp_path / "b3"
    run_experiment(validate(config(ref_out, weights=["int8_channel"], kv=kv, batch_size=1)), quiet=True)
    run_experiment(validate(config(out, weights=["int8_channel"], kv=kv, batch_size=3)), quiet=True)
    ref = records(ref_out)
    assert len(ref) == 7 * 3 * 2 and "perplexity/w6/weights/int8_channel/kivi2" in ref
    assert_close(ref, records(out))

    # holes: window 1's kivi2 record, every record of window 4, window 5's variant int2 record, window 6's baseline
    dropped = {"perplexity/w1/kivi2", "perplexity/w5/weights/int8_channel/int2_g32", "perplexity/w6/baseline",
               *(k for k in ref if k.startswith("perplexity/w4/"))}
    lines = (out / "records.jsonl").read_text().splitlines()
    (out / "records.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["key"] not in dropped))
    (out / "metrics.json").unlink()
    rows: list[int] = []
    real = perplexity._logits

    def counting(model, ids):
        rows.append(ids.shape[0])
        return real(model, ids)

    monkeypatch.setattr(perplexity, "_logits", counting)
    run_experiment(validate(config(out, weights=["int8_channel"], kv=kv, batch_size=3)), quiet=True)
    # windows to redo: 1, 4, 5, 6 -> batches (1, 4, 5) and (6); rows per forward pass, in order:
    #   batch (1, 4, 5): baseline 3, int2_g32 1 (w4), kivi2 2 (w1, w4), variant 2 (w4, w5), its int2 2, its kivi2 1
    #   batch (6): baseline 1 (its record missing, and the other policies' logits need it), nothing else
    assert rows == [3, 1, 2, 2, 2, 1, 1]
    assert_close(ref, records(out))


@pytest.mark.parametrize("batch_size,rel", [(1, 1e-9), (2, 1e-3)])
def test_bfloat16_model_metrics_are_float32_metrics_of_its_logits(tmp_path, batch_size, rel):
    """A bfloat16 model: the run completes and its metrics are compare_logits on the float32 casts of the model's
    bfloat16 logits (computed here independently, one window at a time): the same numbers at batch_size 1; at
    batch_size 2 a bfloat16 matmul over a batch may round otherwise (here it does not, elsewhere it may)."""
    kv = ["int2_g32", "kivi2"]
    cfg = config(tmp_path / "bf16", dtype="bfloat16", kv=kv, max_tokens=1 + 4 * 159, batch_size=batch_size,
                 bootstrap=0)
    metrics = run_experiment(validate(cfg), quiet=True)
    model, tok = load_model("builtin:tiny-llama", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    tokens = load_tokens("builtin", tok)
    sums: dict[str, list[float]] = {n: [0.0, 0.0, 0.0] for n in ["baseline", *kv]}
    n = 0
    with torch.no_grad():
        for w in token_windows(tokens, 160, max_tokens=1 + 4 * 159):
            ids = w.input_ids[None]
            raw = model(ids).logits[0, :-1]
            assert raw.dtype == torch.bfloat16
            base = raw.float()[w.score_from - 1:]
            tgt = ids[0, 1:][w.score_from - 1:]
            n += len(tgt)
            for name in sums:
                if name == "baseline":
                    logits = base
                else:
                    with emulate(model, KVPolicy.preset(name)):
                        logits = model(ids).logits[0, :-1].float()[w.score_from - 1:]
                m = compare_logits(base, logits, tgt)
                for i, k in enumerate(("nll", "kld", "agree")):
                    sums[name][i] += float(m[k].sum())
    assert metrics["baseline"]["ppl"] == pytest.approx(math.exp(sums["baseline"][0] / n), rel=rel)
    for name in kv:
        got = metrics["policies"][name]
        assert got["ppl"] == pytest.approx(math.exp(sums[name][0] / n), rel=rel)
        assert got["kld_mean"] == pytest.approx(sums[name][1] / n, rel=10 * rel)
        assert got["top1_agree"] == pytest.approx(sums[name][2] / n, abs=rel if batch_size == 1 else 2.0 / n)
        assert got["kld_mean"] > 0  # the policies move the logits
    assert "cuda_peak_memory_bytes" not in metrics["baseline"]  # CPU: no CUDA bookkeeping


class FakeCuda:
    """torch.cuda's memory functions, faked: every reset of the peak starts a new pass whose peak is
    ``1000 * pass number``; the calls are counted."""

    def __init__(self):
        self.passes = 0
        self.empty = 0
        self.devices: set[str] = set()

    def reset_peak_memory_stats(self, device=None):
        self.passes += 1
        self.devices.add(str(device))

    def max_memory_allocated(self, device=None):
        return 1000 * self.passes

    def empty_cache(self):
        self.empty += 1


def test_cuda_memory_bookkeeping_per_pass(tmp_path, monkeypatch):
    """With the model seen as on CUDA (the memory functions faked): the peak statistics are reset before every
    pass (the baseline, then each policy), each record carries its pass's peak, the metrics the largest per policy,
    and the allocator's cache is emptied after every pass (plus once at the end)."""
    fake = FakeCuda()
    monkeypatch.setattr(perplexity, "_is_cuda", lambda device: True)
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    kv = ["int2_g32", "kivi2"]
    metrics = run_experiment(validate(config(tmp_path / "c", kv=kv, batch_size=3, bootstrap=0)), quiet=True)
    recs = records(tmp_path / "c")
    names = ["baseline", *kv]
    batches = [[0, 1, 2], [3, 4, 5], [6]]
    assert fake.passes == len(batches) * len(names)
    assert fake.empty == len(batches) * len(names) + 1
    for b, windows in enumerate(batches):
        for j, name in enumerate(names):
            for w in windows:
                assert recs[f"perplexity/w{w}/{name}"]["cuda_peak_bytes"] == 1000 * (b * len(names) + j + 1)
    last = (len(batches) - 1) * len(names)
    assert metrics["baseline"]["cuda_peak_memory_bytes"] == 1000 * (last + 1)
    for j, name in enumerate(kv):
        assert metrics["policies"][name]["cuda_peak_memory_bytes"] == 1000 * (last + j + 2)
