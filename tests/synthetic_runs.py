"""A plausible results folder built by hand (no model), a fixture of the report's tests and the notebook test.
Imported by name (``from synthetic_runs import write_synthetic_run``; tests/ is on sys.path through conftest.py).

    write_synthetic_run(tmp_path / "run", needle=True, sensitivity=True, noise_floor=True)

The numbers are invented but shaped like real ones (damage falls as bits rise, keys hurt more than values, error
grows along the window); every file follows docs/design.md section 4, so the folder loads like a real run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import yaml

from kveval.results import BASELINE, CONFIG_FILE, ENV_FILE, METRICS_FILE, RECORDS_FILE

LAYERS, KV_HEADS, HEAD_DIM, CONTEXT = 4, 2, 64, 512
DEFAULT_POLICIES = ("int8", "int4_g64", "k4v8", "k8v4", "kivi2", "mixed")
_MIXED = {"key": "int4_g64", "value": "int4_g64", "layers": {"0-1": {"spec": "int8"}}}


def write_synthetic_run(path: str | Path, policies: tuple[str, ...] = DEFAULT_POLICIES, *, name: str | None = None,
                        needle: bool = False, sensitivity: bool = False, noise_floor: bool = False,
                        records: bool = True, seed: int = 0) -> Path:
    """Write ``config.resolved.yaml``, ``env.json``, ``records.jsonl`` and ``metrics.json`` into ``path``.

    ``policies``: preset names, or ``"mixed"`` (INT4 g64 with layers 0-1 in INT8). The optional parts (needle
    cells, a sensitivity scan, noise floors) appear only when asked for, as they would after those tasks ran.
    """
    from kveval.memory import Arch
    from kveval.memory.rows import policy_memory_fields
    from kveval.policy import KVPolicy

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    name = name or path.name
    arch = Arch(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, name="builtin:tiny-llama", params=1_000_000)
    pols = {p: KVPolicy.from_config(_MIXED if p == "mixed" else p, name=p) for p in policies}
    bins = 8
    edges = [int(i * CONTEXT / bins) for i in range(bins + 1)]
    base_loss = [4.2] + [float(2.6 + 0.1 * rng.standard_normal()) for _ in range(bins - 1)]
    base_ppl = 15.0
    baseline = {"ppl": base_ppl, "nll_mean": math.log(base_ppl), "tokens": 4095, "windows": 8,
                "loss_by_position": base_loss, "position_bin_edges": edges,
                **policy_memory_fields(arch, "fp16", CONTEXT)}
    contexts, depths = [256, 512, 1024], [0.0, 0.5, 1.0]
    if needle:
        baseline["needle_accuracy"] = 1.0
        baseline["needle_cells"] = [{"variant": "passkey", "context": c, "depth": d, "accuracy": 1.0,
                                     "logprob": -0.1, "token_acc": 1.0} for c in contexts for d in depths]
    metrics_pols = {}
    for pname, pol in pols.items():
        kb = np.mean([float(pol.specs_for_layer(i, LAYERS)[0].code_bits) for i in range(LAYERS)])
        vb = np.mean([float(pol.specs_for_layer(i, LAYERS)[1].code_bits) for i in range(LAYERS)])
        damage = 2.0 * 4.0 ** (4 - kb) + 0.7 * 4.0 ** (4 - vb)  # keys hurt more than values
        if pol.residual:
            damage *= 0.5
        dpct = float(damage * (1 + 0.05 * rng.standard_normal()))
        kld = dpct / 120
        growth = np.linspace(0.8, 1.2, bins)
        ppl = base_ppl * (1 + dpct / 100)
        m = {
            "ppl": ppl, "nll_mean": math.log(ppl), "tokens": 4095, "windows": 8,
            "kld_mean": kld, "kld_ci95": [kld * 0.9, kld * 1.1], "top1_agree": float(max(0.5, 1 - 2 * kld)),
            "loss_by_position": [b + math.log1p(dpct / 100) * g for b, g in zip(base_loss, growth)],
            "kld_by_position": [float(kld * g) for g in growth], "position_bin_edges": edges,
            "layers_quantized": LAYERS,
            "layer_errors": [
                {"layer": i,
                 **{f"{t}_{k}": v for t, bits in (("key", float(pol.specs_for_layer(i, LAYERS)[0].code_bits)),
                                                  ("value", float(pol.specs_for_layer(i, LAYERS)[1].code_bits)))
                    for k, v in (("rel_mse", 4.0 ** -bits * (3 if t == "key" else 1) * (1 + 0.3 * i)),
                                 ("sqnr_db", 6.02 * bits), ("max_abs_err", 2.0 ** -bits),
                                 ("outlier_channels", [3, 17]), ("outlier_ratio", [4.2, 2.1]))}}
                for i in range(LAYERS)],
            "delta_ppl": ppl - base_ppl, "delta_ppl_pct": dpct,
            "verdict": "pass" if dpct <= 1.0 else "fail",
            **policy_memory_fields(arch, pol, CONTEXT),
        }
        m["key_rel_mse_mean"] = float(np.mean([e["key_rel_mse"] for e in m["layer_errors"]]))
        m["value_rel_mse_mean"] = float(np.mean([e["value_rel_mse"] for e in m["layer_errors"]]))
        if noise_floor:
            m["noise_floor_ppl_pct"], m["noise_floor_kld"] = 0.4, 0.002
            if abs(dpct) <= 0.4:
                m["verdict"] = "within_noise"
        if needle:
            cells = [{"variant": "passkey", "context": c, "depth": d,
                      "accuracy": float(np.clip(1 - dpct / 100 * (c / 512) * (1.5 - d), 0, 1)),
                      "logprob": -0.1 - dpct / 50, "token_acc": float(np.clip(1 - dpct / 200, 0, 1))}
                     for c in contexts for d in depths]
            m["needle_cells"] = cells
            m["needle_accuracy"] = float(np.mean([c["accuracy"] for c in cells]))
            m["needle_answer_logprob"] = float(np.mean([c["logprob"] for c in cells]))
            m["needle_token_acc"] = float(np.mean([c["token_acc"] for c in cells]))
        metrics_pols[pname] = m
    tokens = _per_token(metrics_pols, seed)
    metrics = {"run": name, "model": "builtin:tiny-llama", BASELINE: baseline, "policies": metrics_pols,
               "memory": {"arch": arch.to_dict(), "context": CONTEXT, "gpu_memory": None}}
    if sensitivity:
        metrics["sensitivity"] = {"cells": [
            {"layer": i, "tensor": t, "spec": "int2_g32", "kld": float((0.3 if t == "key" else 0.1) * (1 + i)
                                                                       * (3 if i == 0 else 1)),
             "delta_ppl_pct": float((30 if t == "key" else 10) * (1 + i))}
            for i in range(LAYERS) for t in ("key", "value")], "specs": ["int2_g32"]}
    config = {
        "name": name,
        "model": {"name": "builtin:tiny-llama", "device": "cpu", "dtype": "float32", "trust_remote_code": False},
        "data": {"source": "builtin", "text_field": "text", "split": None},
        "kv": {"policies": {p: pol.to_config() for p, pol in pols.items()}},
        "tasks": [{"perplexity": {"seq_len": CONTEXT, "max_tokens": 4096, "position_bins": bins}}],
        "threshold": {"delta_ppl_pct": 1.0, "kld": None},
        "output": None, "seed": seed,
    }
    env = {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.24.0", "kveval": "0.1.0",
           "git_commit": None, "device": "cpu", "threads": 2, "command": f"kveval run configs/{name}.yaml",
           "argv": ["kveval", "run", f"configs/{name}.yaml"],
           "started": "2026-01-01T10:00:00+00:00", "finished": "2026-01-01T10:03:00+00:00"}
    (path / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    (path / ENV_FILE).write_text(json.dumps(env, indent=2))
    (path / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    if records:
        with open(path / RECORDS_FILE, "w") as fh:
            for w in range(8):
                for p in [BASELINE, *pols]:
                    rec = {"key": f"perplexity/w{w}/{p}", "task": "perplexity", "window": w, "policy": p,
                           "n_tokens": 511, "nll_sum": 511 * 2.7}
                    if p in tokens:
                        rec["kld_values"] = tokens[p][0][w].tolist()
                        rec["p_diff_values"] = tokens[p][1][w].tolist()
                    fh.write(json.dumps(rec) + "\n")
    return path


def _per_token(policies: dict, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per policy, invented per-token KLD (log-normal around the policy's mean, heavy-tailed as real ones) and
    Δp for 8 windows of 511 tokens (``[8, 511]`` float32 each), and, in place, each policy's ``llama_perplexity``
    statistics of them (:func:`kveval.stats.llama_perplexity_stats`; the NLLs from the policy's perplexity)."""
    from kveval.stats import llama_perplexity_stats, llama_sums

    rng = np.random.default_rng(seed + 1)  # its own stream: the other invented numbers stay as they were
    out = {}
    for pname, m in policies.items():
        kld = (m["kld_mean"] * rng.lognormal(-0.5, 1.0, size=(8, 511))).astype(np.float32)
        p_diff = (rng.standard_normal((8, 511)) * math.sqrt(m["kld_mean"]) / 2).astype(np.float32)
        nll_base = rng.exponential(2.7, size=8 * 511)
        nll = nll_base + kld.ravel() * 2
        sums = llama_sums(nll, nll_base, kld.ravel(), p_diff.ravel(), (kld.ravel() < 2 * m["kld_mean"]) * 1.0)
        m["llama_perplexity"] = llama_perplexity_stats(sums, kld.ravel(), p_diff.ravel())
        out[pname] = (kld, p_diff)
    return out


__all__ = ["write_synthetic_run"]
