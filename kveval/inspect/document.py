"""The inspection's report section (``report.md``), built from ``inspect.json``'s document alone as report blocks
(``kveval.report.blocks``), rendered by the report's one Markdown writer."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kveval.report.blocks import Block
from kveval.report.document import to_html, to_markdown

TOP_CELLS = 10


def _num(x, fmt: str = ".3g") -> str:
    return "" if x is None else format(x, fmt)


def blocks(doc: dict, level: int = 2) -> list[Block]:
    """The section: what was read, the findings with their run lines, each candidate's error per layer, the
    distributions per layer, the predicted most sensitive cells and, with ``--against``, the rank correlation."""
    out = [Block("h", "Inspection: what the keys and values will do to each format", level),
           Block("p", f"{doc['model']} on {doc['data']}: {doc['tokens']} tokens in {doc['windows']} windows of "
                      f"{doc['seq_len']}, one full-precision pass each ({doc['seconds']:.0f} s). Every error below "
                      "is measured on the captured tensors through the emulation's attention call, without another "
                      "model pass.")]
    out.append(Block("h", "Findings", level + 1))
    if not doc["findings"]:
        out.append(Block("p", "No findings: nothing in these keys and values calls for a change of format."))
    for f in doc["findings"]:
        out.append(Block("p", f["text"]))
        runs = [s["run"] for s in f["suggestions"] if s.get("run")]
        if runs:
            out.append(Block("code", "\n".join(runs)))
    rows = []
    for name in doc["candidates"]:
        layers = doc["variants"][name]["layers"]
        for i, s in layers.items():
            rows.append({"policy": name, "layer": int(i), "output rel. error": _num(s.get("output_rel")),
                         "key rel. error": _num(s.get("key_rel")), "value rel. error": _num(s.get("value_rel")),
                         "logit RMSE": _num(s.get("logit_rmse"))})
    if rows:
        out += [Block("h", "Error per layer", level + 1),
                Block("table", pd.DataFrame(rows), caption="Relative errors (Σ(x̂-x)²/Σx²) of the attention output, "
                                                          "keys and values; RMS error of the scaled logits")]
    dist = []
    for i, d in doc["distributions"].items():
        heads = d["heads"]
        k = heads.get("key_pre_rope") or heads["key"]
        dist.append({"layer": int(i), "key channel ratio": _num(max(h["channel_ratio"] for h in k), ".1f"),
                     "key offset": _num(max(h["offset"] for h in k), ".2f"),
                     "value offset": _num(max(h["offset"] for h in heads["value"]), ".2f"),
                     "value kurtosis": _num(max(h["kurtosis"] for h in heads["value"]), ".1f"),
                     "token 0 mass": _num(d["mean_first_token_mass"], ".2f")})
    if dist:
        out += [Block("h", "Distributions per layer", level + 1),
                Block("table", pd.DataFrame(dist), caption="Largest over KV heads; keys before RoPE where the model "
                                                           "has it; definitions in docs/inspect.md")]
    sens = doc.get("sensitivity") or {}
    for spec, ranked in (sens.get("ranking") or {}).items():
        out.append(Block("table", pd.DataFrame([{"layer": c["layer"], "tensor": c["tensor"],
                                                 "predicted KLD": _num(c["kld"])} for c in ranked[:TOP_CELLS]]),
                         caption=f"Predicted most sensitive cells at {spec} (a prediction, not a scan)"))
    v = doc.get("against_scan")
    if v:
        out.append(Block("table", pd.DataFrame([{"spec": s, "cells": r["cells"], "Spearman": _num(r["spearman"], ".2f"),
                                                 "keys": _num(r["spearman_key"], ".2f"),
                                                 "values": _num(r["spearman_value"], ".2f"),
                                                 "top 5 shared": r["top5_shared"]} for s, r in v["specs"].items()]),
                         caption=f"Predicted against the scan in {v['scan']}"))
    return out


def report_markdown(doc: dict) -> str:
    """``report.md``: the section at the top level."""
    return to_markdown(blocks(doc, level=1))


def report_html(doc: dict, out: Path) -> str:
    """``report.html``: the same, one self-contained file (``out``: its folder)."""
    return to_html(blocks(doc, level=1), f"kveval inspect: {doc['model']}", out)
