"""llama-perplexity's statistics (kveval.stats), its --kl-divergence-base file (kveval.parity.kld_base) and the
power of a run (minimum detectable effect, ``inconclusive``), each against a hand-computed example or an
independent implementation (Python's statistics module, numpy's percentile), never kveval's own output. The real
llama-perplexity is the check in tests/parity/test_llama_perplexity.py."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kveval.errors import KvevalError
from kveval.parity import kld_base
from kveval.parity.llama_perplexity import parse_summary
from kveval.stats import (
    MDE_FACTOR,
    LogSoftmaxScratch,
    add_llama_sums,
    binomial_sd_points,
    bootstrap_standard_error,
    covariance_of_means,
    float32_values,
    inconclusive,
    llama_median,
    llama_percentile,
    llama_perplexity_stats,
    llama_sums,
    llama_token_values,
    mean_and_uncertainty,
    minimum_detectable_effect,
    paired_standard_error,
    predicted_mde_delta_ppl_pct,
    samples_to_resolve,
    size_to_decide,
    tokens_to_resolve,
    top_index,
)

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- the helpers
def test_mean_and_uncertainty_by_hand():
    x = list(range(12))  # mean 5.5; Σx² = 506; population variance 506/12 - 5.5² = 11.91667
    mean, unc = mean_and_uncertainty(sum(x), sum(v * v for v in x), 12)
    assert mean == 5.5 and unc == pytest.approx(math.sqrt(11.916666666666666 / 11))
    assert mean_and_uncertainty(10.0, 30.0, 10) == (1.0, 0.0)  # n <= 10: no uncertainty, as llama.cpp
    assert mean_and_uncertainty(0.0, 0.0, 0) == (0.0, 0.0)
    assert mean_and_uncertainty(24.0, 48.0, 12) == (2.0, 0.0)  # zero variance


def test_covariance_of_means_by_hand():
    a = list(range(1, 13))
    b = [2 * v for v in a]  # cov of the means = 2 * population variance / (n - 1) = 2 * 11.91667 / 11
    got = covariance_of_means(sum(a), sum(b), sum(u * v for u, v in zip(a, b)), 12)
    assert got == pytest.approx(2 * 11.916666666666666 / 11)
    assert covariance_of_means(1.0, 1.0, 1.0, 9) == 0.0


def test_percentile_and_median_by_hand():
    v = np.array([0, 1, 2, 3, 4], dtype=np.float32)
    assert llama_percentile(v, 0.999) == pytest.approx(3.996, rel=1e-6)  # position 0.999 * 4, between 3 and 4
    assert llama_percentile(v, 0.5) == 2.0
    assert llama_percentile(v, 0.1) == pytest.approx(0.4, rel=1e-6)
    assert llama_percentile(v, 1.0) == 4.0 and llama_percentile(v, 0.0) == 0.0
    assert llama_median(np.array([1, 2, 3, 4], dtype=np.float32)) == 2.5
    assert llama_median(np.array([1, 5, 9], dtype=np.float32)) == 5.0
    rng = np.random.default_rng(0)
    w = np.sort(rng.lognormal(size=1001).astype(np.float32))
    for f in (0.999, 0.99, 0.95, 0.9, 0.1, 0.05, 0.01, 0.001):  # numpy's linear percentile: the same rule in float64
        assert llama_percentile(w, f) == pytest.approx(float(np.percentile(w.astype(np.float64), 100 * f)), rel=1e-5)


def test_float32_values_round_trip_through_json():
    x = torch.tensor([0.1, 1 / 3, 1e-7, 123456.7, -2.5e-5], dtype=torch.float64)
    got = float32_values(x)
    assert json.loads(json.dumps(got)) == got
    assert (np.asarray(got, dtype=np.float32) == x.numpy().astype(np.float32)).all()
    assert json.dumps(got) == "[0.1, 0.33333334, 1e-07, 123456.7, -2.5e-05]"  # short, not 17 digits


# ------------------------------------------------------------------------------------------- per-token values
def test_token_values_by_hand():
    """Two-token vocabulary: base (0, 0) is (1/2, 1/2), the policy (ln 3, 0) is (3/4, 1/4); target 0."""
    base = torch.tensor([[0.0, 0.0]])
    q = torch.tensor([[math.log(3.0), 0.0]])
    v = llama_token_values(base, q, torch.tensor([0]))
    assert v["kld"].item() == pytest.approx(0.5 * math.log(4 / 3))  # ½ ln(½/¾) + ½ ln(½/¼)
    assert v["nll"].item() == pytest.approx(-math.log(0.75))
    assert v["nll_base"].item() == pytest.approx(math.log(2))
    assert v["p_diff"].item() == pytest.approx(0.25)  # Q minus base
    assert v["same_top"].item() == 1.0  # a tie in the base: its first maximum, token 0


def test_token_values_with_reused_buffers_are_the_same_bits():
    """The run's comparisons reuse two float64 buffers (``LogSoftmaxScratch``): for slices of several sizes in turn
    (a larger one after a smaller one reallocates), every value equals the fresh computation bit for bit and none
    of them aliases the buffers (the next comparison overwrites them)."""
    g = torch.Generator().manual_seed(3)
    scratch = LogSoftmaxScratch()
    kept = []
    for n in (7, 3, 11, 11):
        base = torch.randn(n, 50, generator=g) * 3
        q = base + 0.3 * torch.randn(n, 50, generator=g)
        targets = torch.randint(0, 50, (n,), generator=g)
        want = llama_token_values(base, q, targets)
        got = llama_token_values(base, q, targets, scratch=scratch)
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        kept.append((got, {k: v.clone() for k, v in got.items()}))
    for got, copy in kept:  # later comparisons left earlier results alone
        assert all(torch.equal(got[k], copy[k]) for k in got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_top_index_is_the_first_maximum_ties_included(dtype):
    """``top_index`` (``torch.max(dim)``, the comparisons' top-1 term) against numpy's argmax (the first maximal
    index, documented), independent of torch: rows full of ties (three values), -0.0 beside +0.0, vocabularies
    that are and are not multiples of the vector width, a transposed (strided) tensor and one row."""
    g = torch.Generator().manual_seed(11)
    for n, vocab in ((1, 1), (3, 7), (17, 64), (5, 1000), (9, 49152), (2, 49157)):
        x = torch.randint(-1, 2, (n, vocab), generator=g).to(torch.float64)
        x[:, ::3] *= -0.0  # -0.0 == +0.0: ties between signed zeros
        x = x.to(dtype)
        for t in (x, x.t().contiguous().t()):
            want = np.argmax(t.double().numpy(), axis=1)
            got = top_index(t)
            assert got.dtype == torch.int64
            assert got.tolist() == want.tolist()
            assert torch.equal(got, t.argmax(-1))


def _hand_example():
    nll = [1.0, 2.0, 0.5, 3.0, 1.5, 2.5, 0.2, 1.1, 0.9, 2.2, 1.7, 0.4]
    nll_base = [0.9, 2.1, 0.4, 2.5, 1.5, 2.0, 0.3, 1.0, 1.0, 2.0, 1.2, 0.5]
    kld = [0.01, 0.02, 0.005, 0.2, 0.0, 0.08, 0.001, 0.03, 0.015, 0.04, 0.12, 0.002]
    p_diff = [-0.04, 0.03, -0.05, -0.2, 0.0, -0.1, 0.02, -0.03, 0.04, -0.05, -0.12, 0.03]
    same = [1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1]
    return nll, nll_base, kld, p_diff, same


def test_summary_by_hand():
    """Every statistic of the summary on 12 tokens, from the definitions (Python's statistics module)."""
    nll, nll_base, kld, p_diff, same = _hand_example()
    n = len(nll)
    half = _hand_sums(slice(0, 5)), _hand_sums(slice(5, None))  # two windows, added
    s = llama_perplexity_stats(add_llama_sums(half), kld, p_diff)
    se = lambda xs: math.sqrt(statistics.pvariance(xs) / (n - 1))  # noqa: E731 - llama.cpp's uncertainty
    mu, mub = statistics.fmean(nll), statistics.fmean(nll_base)
    assert s["tokens"] == 12
    assert s["ppl"] == pytest.approx(math.exp(mu)) and s["ppl_unc"] == pytest.approx(math.exp(mu) * se(nll))
    assert s["ppl_base"] == pytest.approx(math.exp(mub))
    assert s["cor_ln_ppl_pct"] == pytest.approx(100 * statistics.correlation(nll, nll_base))
    diff = [a - b for a, b in zip(nll, nll_base)]
    assert s["ln_ppl_ratio"] == pytest.approx(mu - mub)
    assert s["ln_ppl_ratio_unc"] == pytest.approx(se(diff))  # sqrt(σ² + σb² - 2 cov) = SE of the difference
    assert s["ppl_ratio"] == pytest.approx(math.exp(mu - mub))
    assert s["ppl_ratio_unc"] == pytest.approx(math.exp(mu - mub) * se(diff))
    assert s["ppl_diff"] == pytest.approx(math.exp(mu) - math.exp(mub))
    assert s["kld_mean"] == pytest.approx(statistics.fmean(kld)) and s["kld_mean_unc"] == pytest.approx(se(kld))
    srt = sorted(kld)  # 0, .001, .002, .005, .01, .015, .02, .03, .04, .08, .12, .2
    assert s["kld_max"] == pytest.approx(0.2) and s["kld_min"] == 0.0
    assert s["kld_median"] == pytest.approx((0.015 + 0.02) / 2)
    assert s["kld_p99"] == pytest.approx(srt[10] + 0.89 * (srt[11] - srt[10]), rel=1e-5)  # position 0.99 * 11 = 10.89
    assert s["kld_p90"] == pytest.approx(srt[9] + 0.9 * (srt[10] - srt[9]), rel=1e-5)  # position 9.9
    assert s["kld_p10"] == pytest.approx(srt[1] + 0.1 * (srt[2] - srt[1]), rel=1e-5)  # position 1.1
    assert s["delta_p_mean_pct"] == pytest.approx(100 * statistics.fmean(p_diff))
    assert s["delta_p_mean_pct_unc"] == pytest.approx(100 * se(p_diff))
    assert s["delta_p_max_pct"] == pytest.approx(4.0) and s["delta_p_min_pct"] == pytest.approx(-20.0)
    # sorted Δp: -.2, -.12, -.1, -.05, -.05, -.04, -.03, 0, .02, .03, .03, .04: the median is (-.04 - .03) / 2
    assert s["delta_p_median_pct"] == pytest.approx(100 * (-0.04 - 0.03) / 2, rel=1e-6)
    sq = [d * d for d in p_diff]
    rms = math.sqrt(statistics.fmean(sq))
    assert s["delta_p_rms_pct"] == pytest.approx(100 * rms)
    assert s["delta_p_rms_pct_unc"] == pytest.approx(100 * 0.5 / rms * se(sq))
    assert s["same_top_p_pct"] == pytest.approx(100 * 10 / 12)
    assert s["same_top_p_pct_unc"] == pytest.approx(100 * math.sqrt(10 / 12 * 2 / 12 / 11))
    assert json.loads(json.dumps(s, allow_nan=False)) == s


def _hand_sums(sl):
    nll, nll_base, kld, p_diff, same = (np.asarray(a, dtype=np.float64)[sl] for a in _hand_example())
    return llama_sums(nll, nll_base, kld, p_diff, same)


def test_summary_of_identical_models_has_no_nan():
    """One token, or a zero variance: llama.cpp prints nan/inf; kveval writes None, never NaN, into metrics."""
    s = llama_perplexity_stats(llama_sums(np.ones(3), np.ones(3), np.zeros(3), np.zeros(3), np.ones(3)),
                               np.zeros(3), np.zeros(3))
    assert s["cor_ln_ppl_pct"] is None and s["delta_p_rms_pct_unc"] is None and s["kld_mean"] == 0.0
    assert llama_perplexity_stats(add_llama_sums([]), [], []) == {}
    json.dumps(s, allow_nan=False)


PRINTED = """
====== Perplexity statistics ======
Mean PPL(Q)                   :  16.171342 ±   2.708369
Mean PPL(base)                :  16.138961 ±   2.729988
Cor(ln(PPL(Q)), ln(PPL(base))):  99.07%
Mean ln(PPL(Q)/PPL(base))     :   0.002004 ±   0.023034
Mean PPL(Q)/PPL(base)         :   1.002006 ±   0.023081
Mean PPL(Q)-PPL(base)         :   0.032381 ±   0.371767

====== KL divergence statistics ======
Mean    KLD:   0.047361 ±   0.003921
Maximum KLD:   0.474847
99.9%   KLD:   0.456091
99.0%   KLD:   0.344013
95.0%   KLD:   0.142168
90.0%   KLD:   0.092131
Median  KLD:   0.028457
10.0%   KLD:   0.008010
 5.0%   KLD:   0.003266
 1.0%   KLD:   0.000369
 0.1%   KLD:   0.000092
Minimum KLD:   0.000085

====== Token probability statistics ======
Mean    Δp: -0.555 ± 0.359 %
Maximum Δp: 40.221%
99.9%   Δp: 35.627%
99.0%   Δp: 18.878%
95.0%   Δp:  5.547%
90.0%   Δp:  2.971%
75.0%   Δp:  0.659%
Median  Δp: -0.020%
25.0%   Δp: -1.974%
10.0%   Δp: -6.004%
 5.0%   Δp: -8.538%
 1.0%   Δp: -15.014%
 0.1%   Δp: -26.408%
Minimum Δp:   -nan%
RMS Δp    :  5.736 ± 0.702 %
Same top p: 86.614 ± 2.141 %
"""


def test_parse_the_printed_summary():
    """The block as llama-perplexity 0c1e570 prints it (a KL pass of q4_0 over 2 chunks of 256 here, with one
    value replaced by nan): every statistic, by its label."""
    got = parse_summary(PRINTED)
    assert got["ppl"] == 16.171342 and got["ppl_unc"] == 2.708369 and got["cor_ln_ppl_pct"] == 99.07
    assert got["kld_mean"] == 0.047361 and got["kld_mean_unc"] == 0.003921 and got["kld_p99"] == 0.344013
    assert got["kld_p0_1"] == 0.000092 and got["kld_median"] == 0.028457 and got["kld_min"] == 0.000085
    assert got["delta_p_mean_pct"] == -0.555 and got["delta_p_p75_pct"] == 0.659 and got["delta_p_min_pct"] is None
    assert got["delta_p_rms_pct"] == 5.736 and got["same_top_p_pct_unc"] == 2.141
    assert len(got) == 43
    with pytest.raises(KvevalError, match="no KL divergence statistics"):
        parse_summary("chunk  PPL\n   1   17.0788\n")


# ------------------------------------------------------------------------------------------- the base file
def test_encode_a_row_by_hand():
    """Logits (2, 0, -20), an odd vocabulary: the range is clamped to 16 nats below the maximum (-14 .. 2), the
    maximum codes 65535, 0 codes round(14 · 65535 / 16) = 57343, -20 (below the range) 0, the padding stays 0."""
    row = kld_base.encode_rows(np.array([[2.0, 0.0, -20.0]], dtype=np.float32))
    assert row.shape == (1, 8) and row.dtype == np.uint16  # 4 (two float32) + 3 codes rounded up to 4
    scale, low = kld_base.row_headers(row)
    lse = math.log(1 + math.exp(-2) + math.exp(-22))
    assert scale[0] == pytest.approx(16 / 65535) and low[0] == pytest.approx(-14 - 2 - lse, rel=1e-6)
    assert list(row[0, 4:]) == [65535, 57343, 0, 0]
    logp = kld_base.decode_rows(row, 3)[0]
    exact = [2 - 2 - lse, 0 - 2 - lse]
    assert abs(logp[0] - exact[0]) < 1e-5 and abs(logp[1] - exact[1]) < 16 / 65535
    assert logp[2] == pytest.approx(-16 - lse, rel=1e-6)  # the bottom of the range
    flat = kld_base.encode_rows(np.zeros((1, 4), dtype=np.float32))  # equal logits: scale 0, codes 0
    assert kld_base.row_headers(flat)[0][0] == 0 and (flat[0, 4:] == 0).all()
    assert kld_base.decode_rows(flat, 4)[0] == pytest.approx([-math.log(4)] * 4)


def test_token_stats_against_a_row_by_hand():
    """Against the coded base (½, ½) the policy (¾, ¼) has KLD ½ ln(4/3) (ln 2 is coded exactly: scale 0)."""
    rows = kld_base.encode_rows(np.zeros((1, 2), dtype=np.float32))
    v = kld_base.token_stats(np.array([[math.log(3), 0.0]], dtype=np.float32), rows, np.array([1]))
    assert v["kld"][0] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert v["nll"][0] == pytest.approx(math.log(4), rel=1e-6) and v["nll_base"][0] == pytest.approx(math.log(2))
    assert v["p_diff"][0] == pytest.approx(-0.25, rel=1e-6) and v["same_top"][0] == 1.0
    # tokens more than 16 nats below the base maximum leave the sum (the bottom of the range is -16 - lse)
    base = np.array([[0.0, -30.0]], dtype=np.float32)
    v = kld_base.token_stats(np.array([[0.0, 0.0]], dtype=np.float32), kld_base.encode_rows(base), np.array([0]))
    assert v["kld"][0] == pytest.approx(math.log(2), abs=1e-6)  # 1 · (0 - ln ½), the second token dropped


def _write(path: Path, n_ctx: int = 8, n_vocab: int = 5, n_chunk: int = 2, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, n_vocab, size=(n_chunk, n_ctx))
    rows = [kld_base.encode_rows(rng.standard_normal((kld_base.rows_per_chunk(n_ctx), n_vocab)).astype(np.float32))
            for _ in range(n_chunk)]
    return kld_base.write_base(path, n_ctx, n_vocab, tokens, rows)


def test_base_file_round_trip(tmp_path):
    path = _write(tmp_path / "b.kld", n_ctx=8, n_vocab=5, n_chunk=2)
    # 20 header bytes + 2·8 int32 ids + 2 chunks · 3 rows · (4 + 6) uint16
    assert path.stat().st_size == 20 + 4 * 16 + 2 * 2 * 3 * 10 == kld_base.file_size(8, 5, 2)
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_" and np.frombuffer(raw[8:20], "<i4").tolist() == [8, 5, 2]
    f = kld_base.BaseFile(path, n_vocab=5)
    assert (f.n_ctx, f.n_vocab, f.n_chunk, f.scored) == (8, 5, 2, 6) and f.rows(1).shape == (3, 10)
    assert kld_base.first_scored(8) == 4 and kld_base.rows_per_chunk(7) == 3  # positions 3..5 predict 4..6


def _bad(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case,needle", [
    ("missing", "no such file"),
    ("magic", "not a llama-perplexity base file"),
    ("short_header", "truncated in its header"),
    ("header", "corrupt header"),
    ("truncated", "truncated: 148 bytes where its header"),
    ("longer", "7 bytes more than its header"),
    ("vocab", "vocabulary of 5 tokens, the model's has 7"),
    ("ids", "corrupt token ids (id 9 at index 3"),
    ("nan_row", "corrupt row 1 of chunk 0"),
])
def test_base_file_refused_in_one_line(tmp_path, case, needle):
    good = _write(tmp_path / "good.kld").read_bytes()
    path = tmp_path / "bad.kld"
    if case == "magic":
        _bad(path, b"_notlog_" + good[8:])
    elif case == "short_header":
        _bad(path, good[:14])
    elif case == "header":
        _bad(path, good[:8] + np.array([0, 5, 2], "<i4").tobytes() + good[20:])
    elif case == "truncated":
        _bad(path, good[:148])
    elif case == "longer":
        _bad(path, good + b"\0" * 7)
    elif case == "ids":
        b = bytearray(good)
        b[20 + 12:20 + 16] = np.array([9], "<i4").tobytes()
        _bad(path, bytes(b))
    elif case == "nan_row":
        b = bytearray(good)
        at = 20 + 4 * 16 + 2 * 10  # chunk 0, row 1: its scale
        b[at:at + 4] = np.array([np.nan], "<f4").tobytes()
        _bad(path, bytes(b))
    elif case != "missing":
        _bad(path, good)
    with pytest.raises(KvevalError) as err:
        kld_base.BaseFile(path, n_vocab=7 if case == "vocab" else 5)
    assert needle in str(err.value) and "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_corrupt_base_file_is_one_line_from_the_command(tmp_path):
    """``kveval parity llamacpp --tool perplexity --kl-divergence-base FILE``: a file written for another
    vocabulary is refused before any model is loaded: one line, exit status 2."""
    path = _write(tmp_path / "other.kld", n_vocab=5)
    proc = subprocess.run([sys.executable, "-m", "kveval", "parity", "llamacpp", "--tool", "perplexity",
                           "--model", "builtin:tiny-llama", "--types", "int8", "--kl-divergence-base", str(path),
                           "-o", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "vocabulary of 5 tokens, the model's has 260" in lines[0]
    assert not (tmp_path / "out").exists()


def test_tool_options_only_with_the_tool():
    from kveval.commands.parity import parity_command, parity_options

    with pytest.raises(KvevalError, match="--tool must be one of library, perplexity"):
        parity_options(tool="server")
    with pytest.raises(KvevalError, match="only llamacpp takes --tool perplexity"):
        parity_command("kivi", options=parity_options(tool="perplexity"))
    with pytest.raises(KvevalError, match="does not take --kl-divergence-base"):
        parity_command("llamacpp", options=parity_options(kl_divergence_base="x.kld"))


# ------------------------------------------------------------------------------------------- power
def test_mde_and_the_size_that_decides():
    assert MDE_FACTOR == pytest.approx(1.959964 + 0.841621, abs=1e-6)
    assert minimum_detectable_effect(1.0) == pytest.approx(2.8016, abs=1e-4) and minimum_detectable_effect(None) is None
    # threshold 1 below an MDE of 2: a measurement within 2 of 1 is undecided, one farther off is decided
    assert inconclusive(1.5, 1.0, 2.0) and inconclusive(-0.9, 1.0, 2.0)
    assert not inconclusive(3.5, 1.0, 2.0) and not inconclusive(-1.5, 1.0, 2.0)
    assert not inconclusive(1.5, 1.0, 0.5) and not inconclusive(1.5, 1.0, None)  # the run resolves 1
    # the MDE shrinks as 1/sqrt(n): it reaches max(threshold, |delta - threshold|) = 1 at 100 · (2/1)² tokens
    assert size_to_decide(100, 1.5, 1.0, 2.0) == 400 and size_to_decide(100, 2.5, 1.0, 2.0) == 178
    assert size_to_decide(100, 0.0, 0.0, 2.0) is None
    # the prediction before a run: 255 tokens cannot resolve 1% ΔPPL, and the size it names would
    mde = predicted_mde_delta_ppl_pct(1.0, 255)
    need = tokens_to_resolve(mde, 1.0, 255)
    assert mde > 1.0 and predicted_mde_delta_ppl_pct(1.0, need) <= 1.0 < predicted_mde_delta_ppl_pct(1.0, need - 50)


def test_bootstrap_standard_error_matches_the_formula():
    """Units with equal weight: the bootstrap SE of the mean approaches sd/sqrt(n) (population sd)."""
    x = [0.0, 1.0] * 50
    se = bootstrap_standard_error(x, [1.0] * 100, n_resamples=4000, seed=1)
    assert se == pytest.approx(0.5 / 10, rel=0.05)
    assert bootstrap_standard_error([1.0], [1.0]) is None and bootstrap_standard_error(x, [1] * 100, n_resamples=0) is None


def test_paired_and_binomial_spread_by_hand():
    assert paired_standard_error([0.0, 60.0]) == pytest.approx(42.42640687 / math.sqrt(2))
    assert paired_standard_error([0.0, 0.0], floor_sd=10.0) == pytest.approx(10 / math.sqrt(2))
    assert paired_standard_error([5.0]) is None and paired_standard_error([]) is None
    assert binomial_sd_points(5.0) == pytest.approx(100 * math.sqrt(0.05 * 0.95))
    assert samples_to_resolve(5.0) == math.ceil((MDE_FACTOR * 100 * math.sqrt(0.0475) / 5) ** 2) == 150


def _ppl_records(deltas_per_window: list[float], kld: float = 0.01, n: int = 100, per_token: bool = True,
                 noise: float = 0.005):
    """Records of a baseline and policy ``q`` over windows whose policy NLL exceeds the baseline's by the given
    amounts per token (plus a per-token scatter of sd ``noise``); with ``per_token`` as kveval writes them now, else
    as an older kveval did."""
    rng = np.random.default_rng(0)
    out = []
    for w, d in enumerate(deltas_per_window):
        for name, extra in (("baseline", 0.0), ("q", d)):
            rec = {"key": f"perplexity/w{w}/{name}", "task": "perplexity", "window": w, "policy": name, "start": w * n,
                   "n_tokens": n, "nll_sum": n * (2.0 + extra), "kld_sum": 0.0 if name == "baseline" else n * kld,
                   "agree_sum": float(n), "bin_nll": [n * (2.0 + extra)], "bin_kld": [0.0], "bin_count": [n]}
            if per_token and name == "q":
                nll_b = rng.normal(2.0, 0.5, n)
                nll = nll_b + extra + rng.normal(0, noise, n)
                k = np.abs(rng.normal(kld, kld / 2, n))
                pd = rng.normal(0, 0.01, n)
                rec.update(llama_sums=llama_sums(nll, nll_b, k, pd, np.ones(n)), kld_values=float32_values(k),
                           p_diff_values=float32_values(pd))
            out.append(rec)
    return out


def _aggregate(records, threshold_pct=1.0, kld=None, bootstrap=500):
    from kveval.tasks.perplexity.params import Params
    from kveval.tasks.perplexity.task import aggregate

    thr = SimpleNamespace(delta_ppl_pct=threshold_pct, kld=kld)
    return aggregate(records, ["q"], Params(seq_len=101, position_bins=1, bootstrap=bootstrap), seed=0, threshold=thr)


def test_perplexity_verdicts_with_power():
    """Windows whose ΔPPL scatters widely (mean +1.2%): the threshold of 1% lies below the MDE and the measurement
    near it: inconclusive, with the tokens that would decide it; the same mean on steady windows passes or fails
    as the threshold says; a measurement far beyond the threshold fails however small the run."""
    noisy = _aggregate(_ppl_records([0.03, -0.01, 0.04, -0.02, 0.02]))["policies"]["q"]
    assert noisy["delta_ppl_pct"] == pytest.approx(100 * (math.exp(0.012) - 1))
    assert noisy["delta_ppl_pct_mde"] > 1.0 and noisy["mde_method"]["delta_ppl_pct"] == "bootstrap over windows"
    assert noisy["verdict"] == "inconclusive"
    more = noisy["more_tokens_to_decide"]
    assert more == math.ceil(500 * (noisy["delta_ppl_pct_mde"] / 1.0) ** 2) - 500
    steady = _aggregate(_ppl_records([0.012] * 5))["policies"]["q"]
    assert steady["delta_ppl_pct_mde"] < 0.2 and steady["verdict"] == "fail" and "more_tokens_to_decide" not in steady
    assert _aggregate(_ppl_records([0.005] * 5))["policies"]["q"]["verdict"] == "pass"
    assert _aggregate(_ppl_records([0.3, 0.1, 0.25, 0.05, 0.2]))["policies"]["q"]["verdict"] == "fail"
    # a KLD threshold below its MDE: inconclusive even when ΔPPL is decided
    k = _aggregate(_ppl_records([0.005] * 5, kld=0.01), kld=0.0101)["policies"]["q"]
    assert k["kld_mde"] > 0.0101 * 0.01 and k["verdict"] in ("pass", "inconclusive")


def test_records_of_an_older_kveval_still_aggregate():
    """Records without per-token values (an older kveval, or a folder resumed from one): no llama_perplexity
    fields (nothing to recompute them from), the MDE from the windows alone; one window: no MDE, plain verdict."""
    old = _aggregate(_ppl_records([0.03, -0.01, 0.04, -0.02, 0.02], per_token=False))["policies"]["q"]
    assert "llama_perplexity" not in old and old["mde_method"]["delta_ppl_pct"] == "bootstrap over windows"
    mixed = _ppl_records([0.01, 0.01]) [:2] + _ppl_records([0.01, 0.01], per_token=False)[2:]
    assert "llama_perplexity" not in _aggregate(mixed)["policies"]["q"]
    one = _aggregate(_ppl_records([0.005], per_token=False))["policies"]["q"]
    assert one["delta_ppl_pct_mde"] is None and one["verdict"] == "pass"
    new = _aggregate(_ppl_records([0.005]))["policies"]["q"]
    assert new["mde_method"]["delta_ppl_pct"] == "per-token variance" and new["llama_perplexity"]["tokens"] == 100


def test_metrics_are_the_same_from_records_read_back():
    """A record written and read back (what a resumed run aggregates) gives the same metrics."""
    records = _ppl_records([0.03, -0.01, 0.04])
    again = [json.loads(json.dumps(r)) for r in records]
    assert _aggregate(again) == _aggregate(records)


def test_ruler_verdicts_decided_with_enough_samples():
    from kveval.tasks.ruler.params import Params
    from kveval.tasks.ruler.task import aggregate

    def recs(policy, family, scores):
        return [{"task": "ruler", "family": family, "length": 1024, "sample": i, "policy": policy, "score": s,
                 "answer_logprob": -1.0, "answer_token_acc": 1.0} for i, s in enumerate(scores)]

    n = 400
    base = recs("baseline", "vt", [1.0] * n) + recs("baseline", "cwe", [1.0] * n)
    lost_30 = recs("q", "vt", [0.0] * 120 + [1.0] * 280)  # 30 points lost: decided, fail
    lost_1 = recs("q", "cwe", [0.0] * 4 + [1.0] * 396)  # 1 point lost: decided, pass
    q = aggregate(base + lost_30 + lost_1, ["q"], Params(families=["vt", "cwe"], lengths=[1024], samples=n,
                                                         max_drop=5.0))["policies"]["q"]
    vt, cwe = q["ruler_cells"]
    # vt: differences 100 (120 times) and 0: sd = 100 sqrt(.3 · .7 · 400/399), MDE = 2.80 sd / 20
    assert vt["drop_mde"] == pytest.approx(MDE_FACTOR * 100 * math.sqrt(0.21 * 400 / 399) / 20)
    assert (vt["verdict"], cwe["verdict"]) == ("fail", "pass")
    assert q["ruler_families"]["vt"]["verdict"] == "fail" and q["ruler_verdict"] == "fail"
    # 3 samples, one lost (33 points): differences 100, 0, 0, MDE 2.80 · 57.7 / sqrt(3) = 93 points: undecided;
    # 3 samples, all lost (100 points): no spread, the binomial floor 21.8 gives an MDE of 35: decided, fail
    few = aggregate(base[:3] + recs("q", "vt", [0.0, 1.0, 1.0]), ["q"], Params(families=["vt"], lengths=[1024]))
    assert few["policies"]["q"]["ruler_families"]["vt"]["verdict"] == "inconclusive"
    assert few["policies"]["q"]["ruler_cells"][0]["drop_mde"] == pytest.approx(MDE_FACTOR * 57.735 / 3 ** 0.5, rel=1e-4)
    all_lost = aggregate(base[:3] + lost_30[:3], ["q"], Params(families=["vt"], lengths=[1024]))
    assert all_lost["policies"]["q"]["ruler_families"]["vt"]["verdict"] == "fail"


def test_needle_and_lm_eval_deltas_get_their_mde():
    from kveval.tasks.lm_eval.params import Params as LmParams
    from kveval.tasks.lm_eval.task import aggregate as lm_aggregate
    from kveval.tasks.needle.task import aggregate as needle_aggregate

    def trial(policy, i, hit):
        return {"task": "needle", "policy": policy, "variant": "passkey", "context": 256, "depth": 0.0, "trial": i,
                "exact_match": hit, "answer_logprob": -0.1, "answer_token_acc": 1.0}

    records = [trial("baseline", i, True) for i in range(4)] + [trial("q", i, i < 2) for i in range(4)]
    q = needle_aggregate(records, ["q"])["policies"]["q"]
    # paired differences 0, 0, -1, -1: sd 0.57735, SE 0.288675
    assert q["needle_accuracy_delta_mde"] == pytest.approx(MDE_FACTOR * 0.5773502692 / 2)
    lm = [{"task": "lm_eval", "lm_eval_task": "t", "policy": p, "layers_quantized": 2,
           "results": {"t": {"acc": a, "acc_stderr": se, "n": 100}}}
          for p, a, se in (("baseline", 0.6, 0.03), ("q", 0.55, 0.04))]
    m = lm_aggregate(lm, ["q"], LmParams(tasks=["t"]))["policies"]["q"]["lm_eval"]["t"]
    assert m["delta_acc"] == pytest.approx(-0.05) and m["delta_acc_mde"] == pytest.approx(MDE_FACTOR * 0.05)


def test_a_deliberately_small_run_says_inconclusive(tmp_path, capsys):
    """127 scored tokens of the tiny model: kveval run warns before it starts that they cannot resolve ΔPPL <= 1%,
    and int2_g32's verdict (ΔPPL about +2.5%, MDE about 2.2%) is inconclusive with the tokens that would decide
    it, in metrics.json, the console table, the report's verdict table."""
    from kveval.commands.run import run_experiment
    from kveval.config import validate

    out = tmp_path / "small"
    cfg = {"name": "small", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8", "int2_g32"],
           "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 128, "bootstrap": 200, "diagnostics": False}}],
           "threshold": {"delta_ppl_pct": 1.0}, "output": str(out)}
    metrics = run_experiment(validate(cfg), quiet=True)
    printed = capsys.readouterr().out
    assert "warning: perplexity: 127 scored tokens cannot resolve threshold.delta_ppl_pct 1%" in " ".join(printed.split())
    q = metrics["policies"]["int2_g32"]
    assert q["delta_ppl_pct_mde"] > 1.0 and abs(q["delta_ppl_pct"] - 1.0) <= q["delta_ppl_pct_mde"]
    assert q["verdict"] == "inconclusive" and q["more_tokens_to_decide"] > 0
    assert metrics["policies"]["int8"]["verdict"] == "pass"  # far below the threshold: decided
    assert "inconclusive" in printed
    lp = q["llama_perplexity"]
    assert lp["tokens"] == 127 and lp["kld_mean"] == pytest.approx(q["kld_mean"])
    assert lp["same_top_p_pct"] == pytest.approx(100 * q["top1_agree"])
    assert lp["ppl"] == pytest.approx(q["ppl"]) and lp["ppl_base"] == pytest.approx(metrics["baseline"]["ppl"])
    report = (out / "report.md").read_text()
    assert "inconclusive (+" in report and "llama-perplexity statistics" in report
    assert (out / "plots" / "kld_distribution.png").is_file() and (out / "tables" / "llama_perplexity.csv").is_file()


def test_parity_rows_carry_both_sides_statistics():
    """kveval.parity.compare: llama-perplexity's statistics of the system's side and of kveval's, each against its
    own full-precision run: vocabulary 2, P_fp = (½, ½), P_kv = (¼, ¾) at both scored positions."""
    from kveval.parity import compare

    ids = torch.tensor([0, 1, 1])
    fp = torch.zeros(3, 2, dtype=torch.float64)
    kv = torch.tensor([[0.0, math.log(3)]] * 3, dtype=torch.float64)
    row = compare("sys", "t", "p", ids, ref_fp=fp, ref=fp, kv_fp=fp, kv=kv)
    assert row.kv_stats["kld_mean"] == pytest.approx(0.5 * math.log(4 / 3)) and row.kv_stats["tokens"] == 2
    assert row.kv_stats["delta_p_mean_pct"] == pytest.approx(25.0) and row.kv_stats["same_top_p_pct"] == 0.0
    assert row.ref_stats["kld_mean"] == 0.0 and row.ref_stats["same_top_p_pct"] == 100.0
    assert json.loads(json.dumps(row.to_dict()["kv_stats"], allow_nan=False))["kld_max"] == pytest.approx(
        0.5 * math.log(4 / 3), rel=1e-6)
