"""kveval's llamacpp_* presets against llama.cpp's own llama-perplexity --kl-divergence (built from the vendored
llama.cpp 0c1e570 of the pinned llama-cpp-python 0.3.36 sdist by scripts/build_llama_perplexity.sh, which the
set-up runs and caches), on kveval's F32 GGUF of the builtin model and the same token chunks: every statistic the
tool prints beside kveval's, computed as the tool computes them on the same scored tokens against the same base.

A fresh machine without the cached build builds it here (minutes); without cmake or a C++ compiler the tests skip.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from kveval.parity import kld_base
from kveval.parity.llama_perplexity import find_tool, run
from kveval.stats import LLAMA_STATS

pytestmark = pytest.mark.integration
ALL_KEYS = {k for key, _, unc in LLAMA_STATS for k in ((key, f"{key}_unc") if unc else (key,))}


@pytest.fixture(scope="module")
def tool():
    if not (shutil.which("cmake") and shutil.which("c++")):
        pytest.skip("llama-perplexity needs cmake and a C++ compiler to build")
    return find_tool(build=True)


def test_q8_0_and_q4_0_against_llama_perplexity(tool):
    """4 chunks of 512 ids of the builtin corpus (1,020 scored tokens), all 30 layers: the mean KLD of kveval's
    preset within 10% of llama-perplexity's, for q8_0 and q4_0 (measured: 1.02 and 0.93), the median within 5%
    (1.03, 0.98); the F32-cache row shows what the two implementations leave when nothing is quantized
    (llama-perplexity's KLD 1e-6, kveval's own model against its 16-bit-coded base 8e-7).

    At 30 layers the two are two draws of a chaotic process (tests/parity/test_llamacpp.py): the mean is set by a
    few tokens of the tail, so 10% holds at this size only; on 8 chunks q4_0's ratio is 0.89 (docs/engines.md),
    almost all of it from one stretch of 20 positions of one chunk where llama.cpp's KLD reaches 2.2. Another CPU
    re-draws that tail (llama.cpp's float path follows the machine: -march=native), so this test allows 0.8-1.25;
    the 10% acceptance is held where the draw does not move, on the first 2 layers (the next test)."""
    rows = {r.cache_type: r for r in run(types=["q8_0", "q4_0"], tokens=2048, ctx=512)}
    assert list(rows) == ["f32/f32", "q8_0/q8_0", "q4_0/q4_0"]
    for label in ("q8_0/q8_0", "q4_0/q4_0"):
        r = rows[label]
        assert r.tokens == 4 * 255 and set(r.system) == ALL_KEYS and set(r.kveval) == ALL_KEYS | {"tokens"}
        assert 0.8 <= r.kld_ratio <= 1.25, (label, r.system["kld_mean"], r.kveval["kld_mean"])
        assert r.kveval["kld_median"] == pytest.approx(r.system["kld_median"], rel=0.1)
        assert r.system["ppl_base"] == pytest.approx(r.kveval["ppl_base"], rel=1e-5)  # the same base, read alike
        assert abs(r.system["same_top_p_pct"] - r.kveval["same_top_p_pct"]) < 3
    floor = rows["f32/f32"]
    assert floor.system["kld_mean"] < 0.05 * rows["q8_0/q8_0"].system["kld_mean"]
    assert abs(floor.kveval["kld_mean"]) < 1e-5 and floor.kveval["same_top_p_pct"] == 100.0
    assert rows["q4_0/q4_0"].system["kld_mean"] > 20 * rows["q8_0/q8_0"].system["kld_mean"]


def test_two_layers_rotation_on_and_off(tool):
    """The first 2 decoder layers, where float path noise does not re-draw the rounding (tests/parity/
    test_llamacpp.py): every statistic of kveval's preset equals the tool's to the digits it prints, rotation on
    and off (the tool's log confirms the rotation state), and a mixed type (measured on 4 chunks of 256: mean KLD
    ratio 1.0001, 1.00004, 1.0011; q4_0 99.9% KLD 0.20902 against 0.20914, RMS Δp 1.376 against 1.377 %, same top
    p 96.063 against 96.063 %)."""
    rows = run(types=["q4_0", "q4_0:norot", "f16/q4_0", "q8_0"], tokens=1024, ctx=256, layers=2, floor=False)
    assert [r.cache_type for r in rows] == ["q4_0/q4_0", "q4_0/q4_0 norot", "f16/q4_0", "q8_0/q8_0"]
    q8 = rows.pop()  # q8_0's KLD is at the float-path level: its mean within 10% (measured 1.003), not its tail
    assert 0.9 <= q8.kld_ratio <= 1.1, (q8.system["kld_mean"], q8.kveval["kld_mean"])
    for r in rows:
        assert r.kld_ratio == pytest.approx(1.0, abs=0.01), (r.cache_type, r.system["kld_mean"], r.kveval["kld_mean"])
        for key in ("kld_median", "kld_p99", "kld_p99_9", "delta_p_rms_pct", "ppl"):
            assert r.kveval[key] == pytest.approx(r.system[key], rel=0.02), (r.cache_type, key)
        assert r.kveval["same_top_p_pct"] == pytest.approx(r.system["same_top_p_pct"], abs=0.5)
    assert ("LLAMA_ATTN_ROT_DISABLE=1" in rows[1].command) and "LLAMA_ATTN_ROT_DISABLE" not in rows[0].command


def test_a_base_file_llama_perplexity_wrote(tool, tmp_path):
    """llama-perplexity writes its own base (the builtin model's first 2 layers, F32 cache, the builtin corpus as
    text, its own tokenizer); kveval reads it (chunks, ids, rows) and scores its full-precision model and its
    q4_0 preset against it beside the tool: kveval's unquantized model agrees with llama.cpp's base to a KLD
    below 1e-5, and the q4_0 statistics agree as on kveval's own base."""
    from kveval.data import load_text, tokenize_text
    from kveval.models import load_model
    from kveval.parity.llamacpp import f32_gguf, truncate

    model, tok = load_model("builtin:smollm2-135m", dtype="float32")
    gguf = f32_gguf(truncate(model, 2), "builtin:smollm2-135m")
    corpus = load_text("builtin")[:20_000]
    text = tmp_path / "corpus.txt"
    text.write_text(corpus)
    base = tmp_path / "base.kld"
    proc = subprocess.run([str(tool), "-m", str(gguf), "-f", str(text), "-c", "256", "-b", "256", "--chunks", "3",
                           "-ctk", "f32", "-ctv", "f32", "-fa", "on", "-t", "2", "--no-warmup",
                           "--kl-divergence-base", str(base)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    f = kld_base.BaseFile(base, n_vocab=49152)
    assert (f.n_ctx, f.n_chunk) == (256, 3) and base.stat().st_size == kld_base.file_size(256, 49152, 3)
    assert np.array_equal(f.tokens[0, :64], tokenize_text(corpus[:2000], tok)[:64])  # the same ids as kveval's
    rows = {r.cache_type: r for r in run(types=["q4_0"], kl_divergence_base=str(base), layers=2)}
    floor, q4 = rows["f32/f32"], rows["q4_0/q4_0"]
    assert floor.tokens == 3 * 127 and abs(floor.kveval["kld_mean"]) < 1e-5 and abs(floor.system["kld_mean"]) < 1e-5
    assert floor.kveval["same_top_p_pct"] > 99
    assert q4.kld_ratio == pytest.approx(1.0, abs=0.03), (q4.system["kld_mean"], q4.kveval["kld_mean"])
