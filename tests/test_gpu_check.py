"""The GPU check cannot rot: its CPU dry run (`scripts/gpu_check.sh --small`, as CI runs it) completes every section
with no error, the real cache agrees with the emulation in every attention family, and the cache holds its bill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "GPU_WHEELS": "none"}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--small", "--device", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.md").read_text().startswith("# kveval GPU check (small")
    assert set(doc["sections"]) == {"equivalence", "memory", "speed", "decode", "generation"}
    for name, section in doc["sections"].items():
        assert "error" not in section, (name, section.get("error"))
        assert not [r for r in section["rows"] if "error" in r], (name, section["rows"])
    families = {r["family"] for r in doc["sections"]["equivalence"]["rows"]}
    assert {"tiny-llama", "tiny-gemma3", "tiny-deepseek-v3", "tiny-qwen3-next", "tiny-granite-hybrid"} <= families
    assert all(r["ok"] for r in doc["sections"]["equivalence"]["rows"]), doc["sections"]["equivalence"]["rows"]
    for row in doc["sections"]["memory"]["rows"]:  # the real cache holds exactly its bill (DynamicCache: FP16's)
        assert row["resident_mib"] == row["bill_mib"], row
    assert doc["sections"]["speed"]["rows"][-1]["fits"] is True
    decode = doc["sections"]["decode"]["rows"]
    assert {r["cache"] for r in decode} == {"dynamic", "lean", "buffered"} and all(r["tokens_per_s"] > 0 for r in decode)
    generation = doc["sections"]["generation"]["rows"]  # each batch: the FP loop, then the policy's
    assert [(r["batch"], r["policy"]) for r in generation] == [
        (b, p) for b in (1, 4) for p in ("fp16 (both DynamicCache)", "int4_g32")]
    assert all(r["tokens"] == r["batch"] * 8 and r["tokens_per_s"] > 0 for r in generation), generation
    assert all(r["vs_fp16"] > 0 for r in generation if r["policy"] == "int4_g32")
