"""`kveval report` on two runs of one config from two machines says which differences are within the runs' noise
(issue 54: int8 ΔPPL +0.18% on one machine, +0.30% on another, the same commit and config; the Gemma-3 GGUF's
int4_g64 +67% and +80%)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "results" / "reference"


def _machine(tmp_path: Path, name: str, cpu: str, factors: dict[str, float]) -> Path:
    """A copy of the reference run as if run on another machine: its policies' PPL scaled by ``factors``."""
    out = tmp_path / name
    shutil.copytree(REFERENCE, out)
    metrics = json.loads((out / "metrics.json").read_text())
    base = metrics["baseline"]["ppl"]
    for policy, factor in factors.items():
        m = metrics["policies"][policy]
        m["ppl"] *= factor
        m["delta_ppl"], m["delta_ppl_pct"] = m["ppl"] - base, 100.0 * (m["ppl"] / base - 1.0)
    (out / "metrics.json").write_text(json.dumps(metrics))
    env = json.loads((out / "env.json").read_text())
    env.update({"cpu": cpu, "cpu_capability": "AVX2" if "AMD" in cpu else "AVX512"})
    (out / "env.json").write_text(json.dumps(env))
    config = (out / "config.resolved.yaml").read_text().replace("output: results/reference", f"output: {out}")
    (out / "config.resolved.yaml").write_text(config)
    return out


def _report(tmp_path: Path, *runs: Path) -> str:
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "kveval", "report", *map(str, runs), "-o", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return (out / "report.md").read_text()


def test_two_machines_differences_within_and_beyond_the_runs_noise(tmp_path):
    metrics = json.loads((REFERENCE / "metrics.json").read_text())
    base, int8 = metrics["baseline"]["ppl"], metrics["policies"]["int8"]["ppl"]
    # int8 from +0.18% to +0.30% ΔPPL (the measured pair: within what the runs resolve); int4_g64 up by 12%
    a = _machine(tmp_path, "a", "Intel(R) Xeon(R) Processor", {})
    b = _machine(tmp_path, "b", "AMD EPYC 9B14", {"int8": base * 1.002994 / int8, "int4_g64": 1.12})
    md = _report(tmp_path, a, b)
    section = md.split("## Same config: ")[1].split("\n## ")[0]
    assert "AMD EPYC 9B14" in section and "AVX2" in section and "AVX512" in section
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in section.splitlines()
            if line.startswith("| ")}
    assert rows[("int8", "ΔPPL %")].rstrip(" |").endswith("yes")
    assert rows[("int4_g64", "ΔPPL %")].rstrip(" |").endswith("no")
    assert rows[("baseline", "PPL")].rstrip(" |").endswith("yes")  # the same numbers: difference 0
    assert "Beyond it: int4_g64 ΔPPL %" in section


def test_runs_of_different_configs_are_not_compared(tmp_path):
    a = _machine(tmp_path, "a", "Intel(R) Xeon(R) Processor", {})
    b = _machine(tmp_path, "b", "AMD EPYC 9B14", {})
    config = (b / "config.resolved.yaml").read_text().replace("seed: 0", "seed: 1")
    (b / "config.resolved.yaml").write_text(config)
    assert "## Same config" not in _report(tmp_path, a, b)
    # the same config on other tokens (a changed corpus: the digest .kveval-run.json records) neither
    # (the reference run's marker is not committed: each copy gets one naming its tokens' digest)
    c = _machine(tmp_path, "c", "AMD EPYC 9B14", {})
    for run, digest in ((a, "1" * 64), (c, "0" * 64)):
        (run / ".kveval-run.json").write_text(json.dumps({"tokens": {"sha256": digest, "count": 4096}}))
    assert "## Same config" not in _report(tmp_path, a, c)
    # and the same digest on both is compared
    (c / ".kveval-run.json").write_text((a / ".kveval-run.json").read_text())
    assert "## Same config" in _report(tmp_path, a, c)
