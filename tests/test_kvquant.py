"""KVQuant (format 'nuq', the kvquant*_1pct presets) against a reference written from KVQuant's source
(tests/kvquant_reference.py, SqueezeAILab/KVQuant @57a2383): NormalFloat signposts, percentiles, k-means fixed points,
calibrated bounds and codebooks, codes and reconstructions of keys and values on crafted tensors; emulation against
real-cache decoding (float64), cache bytes against the bill, the Fisher information, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from kvquant_reference import calibrate as ref_calibrate
from kvquant_reference import capped, nf_signposts, quant_keys, quant_values
from twopaths import decoded_logits, emulated_logits, ids_for
from typer.testing import CliRunner

from kveval.calibration.calibrate import calibrate
from kveval.calibration.collect import collect_kv
from kveval.cli import app
from kveval.config import validate
from kveval.data import load_tokens
from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy
from kveval.policy.presets import POLICY_PRESETS, kvquant_config
from kveval.quant import QParams, QuantSpec, dequantize, fake_quantize, packed_nbytes, preset, quantize
from kveval.quant.formats.nuq import nearest_codes, nf_codebook, outlier_capacity, quantile_levels, quantile_sorted
from kveval.scales.codebooks import bounds_names, codebook_name, fit_layer, kmeans_1d, percentile
from kveval.scales.file import load_scales

KVQ = {"tokens": 96, "seq_len": 48}


def _cfg(kv, out="/tmp/unused"):
    return validate({"name": "kvq", "model": "builtin:tiny-llama", "data": "builtin", "kv": kv,
                     "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 256, "bootstrap": 50,
                                               "diagnostics": False}}],
                     "calibration": KVQ, "output": str(out)})


def _scales(model, tok, path, kv=("kvquant4_1pct", "kvquant2_1pct"), fisher=True):
    return calibrate(model, tok, load_tokens("builtin", tok), _cfg(list(kv)), path, fisher=fisher)


@pytest.fixture(scope="module")
def llama_kvq(tiny_llama64, tmp_path_factory):
    model, tok = tiny_llama64
    return _scales(model, tok, tmp_path_factory.mktemp("kvq") / "llama.safetensors")


@pytest.fixture(scope="module")
def gemma_kvq(tiny_gemma3_64, tmp_path_factory):
    model, tok = tiny_gemma3_64
    return _scales(model, tok, tmp_path_factory.mktemp("kvq") / "gemma.safetensors")


def _policy(name: str, path, **over) -> KVPolicy:
    return KVPolicy.from_config({"preset": name, "scales": str(path), **over}, name=name)


# ------------------------------------------------------------------------------------------------ pieces
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_nf_signposts_equal_kvquant(bits):
    book = nf_codebook(bits)
    assert book.dtype == torch.float32 and book.shape == (2**bits,)
    assert torch.equal(book, torch.tensor(nf_signposts(bits), dtype=torch.float32))
    assert book[0] == -1 and book[-1] == 1 and (book == 0).sum() == 1 and (book[1:] > book[:-1]).all()


def test_nf4_is_qlora_normalfloat():
    # QLoRA's NF4 (bitsandbytes create_normal_map(offset=0.9677083)): the same construction in float64
    nf4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
    torch.testing.assert_close(nf_codebook(4), torch.tensor(nf4), rtol=0, atol=2e-6)


def test_levels_and_capacity():
    assert quantile_levels(0.01) == (1 - (1 - ((1 - 0.99) / 2)), 0.995)
    # KVQuant's cache: int(((1 - 0.99) / 2) * hidden) + 1 per side
    assert [outlier_capacity(0.01, n) for n in (4096, 192, 64, 200, 1024)] == [21, 1, 1, 2, 6]
    assert outlier_capacity(0.0, 4096) == 0


def test_percentile_is_numpy_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    assert percentile(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 50.0).tolist() == [1.5]
    lo, hi = quantile_levels(0.01)
    for n in (2, 7, 192, 2048):
        x = torch.randn(33, n, generator=g) * torch.rand(33, 1, generator=g) * 10
        srt = x.sort(-1).values
        for pct in (hi * 100, lo * 100, 50.0, 100.0, 0.0, 37.3):
            assert torch.equal(percentile(srt, pct), torch.from_numpy(np.percentile(x.numpy(), pct, axis=-1))), (n, pct)


def test_quantile_is_torch_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        y = torch.randn(20, 192, generator=g, dtype=dtype)
        for q in quantile_levels(0.01) + (0.5, 0.0, 1.0):
            assert torch.equal(quantile_sorted(y.sort(-1).values, q), torch.quantile(y, q, dim=-1, keepdim=True))


def test_nearest_codes_first_index_on_ties():
    c = torch.tensor([-1.0, 0.0, 1.0])
    assert nearest_codes(torch.tensor([-0.5, 0.7, 3.0, -9.0, 0.5, 0.0]), c).tolist() == [0, 2, 2, 0, 1, 1]
    g = torch.Generator().manual_seed(2)
    s, book = torch.randn(1000, generator=g), nf_codebook(3)
    ref = (s[:, None] - book[None]).abs().argmin(-1)  # KVQuant's round_to_nearest_pole_sim
    assert torch.equal(nearest_codes(s, book).long(), ref)


# ------------------------------------------------------------------------------------------------ k-means
def test_kmeans_worked_and_weighted_by_hand():
    assert kmeans_1d(torch.tensor([0.0, 1.0, 9.0, 10.0]), 2).tolist() == [0.5, 9.5]
    # three separated groups, weighted means by hand: (-0.9*1 - 0.8*3)/4, (0.1 + 0.2 + 0.3*2)/4, (0.9*1 + 1.0*1)/2
    v = torch.tensor([-0.9, -0.8, 0.1, 0.2, 0.3, 0.9, 1.0], dtype=torch.float64)
    w = torch.tensor([1.0, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0])
    want = torch.tensor([(-0.9 - 2.4) / 4, (0.1 + 0.2 + 0.6) / 4, 0.95]).float()
    torch.testing.assert_close(kmeans_1d(v, 3, w), want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("weighted", [False, True])
def test_kmeans_ends_at_a_lloyd_fixed_point(weighted):
    """Each centre is the weighted mean of the values nearest to it (the fixed point k-means converges to)."""
    g = torch.Generator().manual_seed(3)
    v = torch.cat([torch.randn(3000, generator=g) * 0.05 + m for m in (-0.8, -0.2, 0.3, 0.7)]).clamp(-1, 1)
    w = torch.rand(v.numel(), generator=g) if weighted else torch.ones_like(v)
    c = kmeans_1d(v, 4, w if weighted else None, max_iter=500, tol=0.0).double()
    cell = nearest_codes(v.double(), c).long()
    for j in range(4):
        sel = cell == j
        mean = (v.double()[sel] * w.double()[sel]).sum() / w.double()[sel].sum()
        assert abs(float(mean) - float(c[j])) < 1e-6, (j, float(mean), float(c[j]))


@pytest.mark.parametrize("weighted", [False, True])
def test_kmeans_equals_scikit_learn_on_separated_clusters(weighted):
    """KVQuant's KMeans(n_clusters=2^b, random_state=0, n_init='auto', max_iter=50) finds the same centres when the
    clusters are separated (its k-means++ start and kveval's quantile start reach the same fixed point)."""
    KMeans = pytest.importorskip("sklearn.cluster").KMeans
    g = torch.Generator().manual_seed(4)
    v = torch.cat([torch.rand(500 + 100 * i, generator=g) * 0.04 + m
                   for i, m in enumerate((-0.9, -0.5, -0.1, 0.3, 0.6, 0.9))]).float()
    w = torch.rand(v.numel(), generator=g).float() + 0.5 if weighted else None
    km = KMeans(n_clusters=6, random_state=0, n_init="auto", max_iter=50)
    km = km.fit(v.numpy()[:, None], sample_weight=None if w is None else w.numpy())
    torch.testing.assert_close(kmeans_1d(v, 6, w), torch.from_numpy(np.sort(km.cluster_centers_[:, 0])), rtol=0, atol=2e-6)


# ------------------------------------------------------------------------------------------------ calibration
def _crafted_samples(seed: int, style: str, N: int = 600, H: int = 2, D: int = 8) -> torch.Tensor:
    """[N, H, D] float32 whose normalised values sit near 4 separated levels: each channel (style channel) or each
    token (style token) scaled and shifted, the two extreme levels present in every row so that the percentile
    bounds land on them; and rare large entries beyond those bounds (outliers)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([-0.9, -0.3, 0.2, 0.9])
    pick = torch.randint(0, 4, (N, H * D), generator=g)
    if style == "token":
        pick[:, :3], pick[:, 3:6] = 0, 3
    x = levels[pick] + torch.randn(N, H * D, generator=g) * 0.005
    if style == "channel":
        x = x * (1 + torch.arange(H * D)) + torch.arange(H * D) * 0.5
    else:
        x = x * (1 + torch.rand(N, 1, generator=g) * 3) + torch.randn(N, 1, generator=g)
    x[torch.rand(N, H * D, generator=g) < 0.002] *= 8
    return x.reshape(N, H, D).float()


@pytest.mark.parametrize("style", ["channel", "token"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fit_layer_equals_kvquant_calibration(style, weighted):
    """SimQuant.quantize (keys: qchannel 0, values: qchannel -1) on crafted samples: the same bounds, bit for bit,
    and the same 2-bit codebook (scikit-learn's k-means as KVQuant calls it)."""
    pytest.importorskip("sklearn")
    x = _crafted_samples(5, style)
    N, H, D = x.shape
    fisher = torch.rand(x.shape, generator=torch.Generator().manual_seed(6)) if weighted else None
    ours = fit_layer(x, 0.01, style, [2], fisher)
    up, lo, book = ref_calibrate(x.reshape(N, H * D).numpy(), 2, 0.99, style == "channel",
                                 None if fisher is None else fisher.reshape(N, H * D).numpy())
    if style == "channel":
        assert torch.equal(ours["hi"].flatten(), torch.from_numpy(up))
        assert torch.equal(ours["lo"].flatten(), torch.from_numpy(lo))
    torch.testing.assert_close(ours["nuq2"], torch.from_numpy(book).float(), rtol=0, atol=2e-5)


def test_calibration_writes_bounds_and_codebooks(tiny_llama64, llama_kvq):
    model, tok = tiny_llama64
    sf = load_scales(llama_kvq)
    h = sf.header["nuq"]
    assert h["fisher"] is True and h["kmeans"]["max_iter"] == 50
    assert {(f["kind"], f["style"], f["outliers"]) for f in h["fits"]} == {("key_pre_rope", "channel", 0.01),
                                                                          ("value", "token", 0.01)}
    hi, lo = bounds_names("key_pre_rope", 0.01)
    assert sf.tensors[hi].shape == sf.tensors[lo].shape == (4, 2, 32) and (sf.tensors[lo] <= sf.tensors[hi]).all()
    for b in (2, 4):
        for kind, style in (("key_pre_rope", "channel"), ("value", "token")):
            book = sf.tensors[codebook_name(kind, 0.01, style, b)]
            assert book.shape == (4, 2**b) and (book[:, 1:] >= book[:, :-1]).all() and book.abs().max() <= 1
    # the file holds fit_layer of the collected samples, weighted by their squared gradients
    with collect_kv(model, fisher=True) as kv:
        toks = load_tokens("builtin", tok)[-96:]
        for w in (toks[:48], toks[48:]):
            with torch.enable_grad():
                logits = model(w[None], use_cache=False).logits[0, :-1].float()
                torch.nn.functional.cross_entropy(logits, w[1:]).backward()
            kv.harvest()
        x, f = kv.samples(1)["key_pre_rope"], kv.fisher(1)["key_pre_rope"]
    fitted = fit_layer(x, 0.01, "channel", [4], f)
    assert torch.equal(fitted["nuq4"], sf.tensors[codebook_name("key_pre_rope", 0.01, "channel", 4)][1])
    assert torch.equal(fitted["hi"], sf.tensors[hi][1])


def test_fisher_is_the_squared_gradient_of_the_projections(tiny_llama64):
    """KVQuant's run-fisher.py: (k_proj.act.grad ** 2, v_proj.act.grad ** 2); kveval gets the pre-RoPE key's gradient
    through the transposed rotation: equal to the gradient taken at k_proj's output."""
    model, _ = tiny_llama64
    ids = ids_for(model, 24)
    acts = {}

    def keep(name):
        def hook(_m, _i, out):
            out.retain_grad()
            acts[name] = out
        return hook

    attn = model.model.layers[2].self_attn
    hooks = [attn.k_proj.register_forward_hook(keep("k")), attn.v_proj.register_forward_hook(keep("v"))]
    try:
        with collect_kv(model, fisher=True) as kv, torch.enable_grad():
            logits = model(ids, use_cache=False).logits[0, :-1]
            torch.nn.functional.cross_entropy(logits, ids[0, 1:]).backward()
            kv.harvest()
    finally:
        for h in hooks:
            h.remove()
    f = kv.fisher(2)
    H, D = f["value"].shape[1:]
    want_k, want_v = ((acts[n].grad[0] ** 2).reshape(-1, H, D).float() for n in ("k", "v"))  # samples are float32
    assert want_k.abs().max() > 0 and want_v.abs().max() > 0
    torch.testing.assert_close(f["key_pre_rope"], want_k, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(f["value"], want_v, rtol=1e-5, atol=1e-30)
    assert f["key"].shape == f["value"].shape and not torch.allclose(f["key"], f["key_pre_rope"])


# ------------------------------------------------------------------------------------------------ codes
BOOK2 = torch.tensor([-0.75, -0.25, 0.25, 0.75])


def _keys_case():
    """Keys of 2 heads x 4 channels (n = 8), bounds hi = 1.5 + c, lo = -0.5 - c per channel c (offset 0.5,
    half-range 1 + c, exact in fp16), 6 tokens of values o + r * s with s multiples of 1/8 (every operation exact)."""
    c = torch.arange(8.0) / 4
    hi, lo = 1.5 + c, -0.5 - c
    s = torch.tensor([
        [0.125, -0.5, 0.375, 0.875, -1.0, 0.0, 0.25, -0.625],  # no outliers (|s| <= 1)
        [1.5, -0.5, 0.375, 0.875, -1.25, 0.0, 0.25, -0.625],   # one above, one below
        [0.5, 2.0, -3.0, 0.125, 0.0, 0.5, 0.625, -0.125],      # one above, one below
        [1.25, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],             # two above: the larger s is kept (capacity 1)
        [-1.125, -4.0, -1.5, 0.25, 0.0, 0.0, 0.0, 0.375],      # three below
        [0.0] * 8,
    ])
    return hi, lo, 0.5 + (1 + c) * s, s


def test_keys_equal_kvquant_codes_and_reconstructions():
    hi, lo, y, s = _keys_case()
    spec = QuantSpec(format="nuq", bits=2, mapping="asymmetric", granularity="channel", outliers=0.01)
    qp = QParams(hi.half().reshape(1, 2, 1, 4), lo.half().reshape(1, 2, 1, 4), BOOK2)
    x = y.reshape(1, 6, 2, 4).permute(0, 2, 1, 3)
    qt = quantize(x, spec, qp)
    got = dequantize(qt).permute(0, 2, 1, 3).reshape(6, 8)
    codes = qt.codes.permute(0, 2, 1, 3).reshape(6, 8)
    ref, mask = quant_keys(y, hi, lo, BOOK2.tolist())
    # tokens within the capacity (at most one outlier per side): KVQuant's simulation, number for number
    assert torch.equal(got[:3], ref[:3]) and torch.equal(got[5], ref[5])
    assert torch.equal(codes[~mask], (s.clamp(-1, 1)[~mask][:, None] - BOOK2).abs().argmin(-1).to(torch.uint8))
    # tokens over it: KVQuant's cache keeps the largest s above / smallest below, the others take the codebook end
    kept = capped(y > hi, y < lo, s, outlier_capacity(0.01, 8))
    end = torch.where(s > 0, 0.75, -0.75) * (1 + torch.arange(8.0) / 4) + 0.5
    want = torch.where(kept, y, torch.where(mask, end, ref))
    assert torch.equal(got, want)
    assert kept[3].tolist() == [False, True] + [False] * 6 and kept[4].tolist() == [False, True] + [False] * 6
    assert got[3, 0] == 0.75 * 1 + 0.5 and got[4, 2] == -0.75 * 1.5 + 0.5
    assert torch.equal(fake_quantize(x, spec, qparams=qp), dequantize(qt))


def test_values_equal_kvquant_codes_and_reconstructions():
    """Values per token over both heads: quantile outliers (one per side for n = 8), the median trick, the lookup."""
    y = torch.tensor([
        [0.5, -1.0, 2.0, 0.25, 3.5, -0.75, 1.25, 0.0],
        [8.0, 0.5, 0.25, -0.5, 0.75, -6.0, 0.125, 0.375],
        [-0.125, 0.625, 0.25, -0.375, 0.5, 0.0, -0.25, 0.125],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    ])
    spec = QuantSpec(format="nuq", bits=2, mapping="asymmetric", scale_dtype="float32", outliers=0.01)
    qt = quantize(y.reshape(1, 4, 2, 4).permute(0, 2, 1, 3), spec, QParams(torch.empty(0), codebook=BOOK2))
    got = dequantize(qt).permute(0, 2, 1, 3).reshape(4, 8)
    ref, mask = quant_values(y, 0.99, BOOK2.tolist())
    assert torch.equal(got, ref)
    assert mask.sum(-1).tolist()[:3] == [2, 2, 2]
    assert torch.equal(qt.scale.flatten()[:3], torch.tensor([2.0, 0.75, 0.5]))  # max without the outliers
    assert torch.equal(qt.zero_point.flatten()[:3], torch.tensor([-0.75, -0.5, -0.25]))
    assert qt.outlier_values.shape == (1, 1, 4, 2) and qt.outlier_index.dtype == torch.uint8
    assert qt.outlier_values[0, 0, 1].tolist() == [8.0, -6.0] and qt.outlier_index[0, 0, 1].tolist() == [0, 5]
    # p = 0: the bounds are max and min
    plain = QuantSpec(format="nuq", bits=2, mapping="asymmetric", scale_dtype="float32")
    got0 = dequantize(quantize(y.reshape(1, 4, 2, 4).permute(0, 2, 1, 3), plain, QParams(torch.empty(0), codebook=BOOK2)))
    o, r = (y.amax(-1, keepdim=True) + y.amin(-1, keepdim=True)) / 2, (y.amax(-1, keepdim=True) - y.amin(-1, keepdim=True)) / 2
    s = torch.where(r == 0, 0.0, (y - o) / torch.where(r == 0, 1.0, r))
    want = BOOK2[(s[..., None] - BOOK2).abs().argmin(-1)] * r + o
    assert torch.equal(got0.permute(0, 2, 1, 3).reshape(4, 8), want)


def test_random_tensors_equal_kvquant_within_its_rounding():
    """Random K/V rows (n = 192, the builtin model's 3 heads x 64), NormalFloat-2 codes: values equal KVQuant's
    simulation to its own rounding ((y - o) + o for an outlier); keys wherever a token is within the capacity."""
    g = torch.Generator().manual_seed(7)
    y = torch.randn(64, 192, generator=g) * torch.linspace(0.5, 3, 192)
    book = nf_codebook(2)
    spec = QuantSpec(format="nuq", bits=2, mapping="asymmetric", scale_dtype="float32", outliers=0.01)
    x = y.reshape(1, 64, 3, 64).permute(0, 2, 1, 3)
    got = dequantize(quantize(x, spec)).permute(0, 2, 1, 3).reshape(64, 192)
    ref, _ = quant_values(y, 0.99, book.tolist())
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    cal = fit_layer((torch.randn(2000, 192, generator=g) * torch.linspace(0.5, 3, 192)).reshape(2000, 3, 64),
                    0.01, "channel", [2])  # bounds from other tokens: about one outlier per side and token
    kspec = QuantSpec(format="nuq", bits=2, mapping="asymmetric", granularity="channel", outliers=0.01)
    qp = QParams(cal["hi"].half().reshape(1, 3, 1, 64), cal["lo"].half().reshape(1, 3, 1, 64), book)
    gotk = dequantize(quantize(x, kspec, qp)).permute(0, 2, 1, 3).reshape(64, 192)
    refk, mask = quant_keys(y, cal["hi"], cal["lo"], book.tolist())
    up, dn = y > cal["hi"].half().float().flatten(), y < cal["lo"].half().float().flatten()
    within = (up.sum(-1) <= 1) & (dn.sum(-1) <= 1)
    assert within.sum() > 20 and (~within).sum() > 0  # the capacity binds on some tokens (static thresholds)
    torch.testing.assert_close(gotk[within], refk[within], rtol=1e-6, atol=1e-6)


def test_bytes_of_a_quantized_tensor():
    """nuq4 per token with 1% outliers, calibrated codebook, [1, 3, 512, 64] fp16 (n = 192, 1 slot per side):
    codes 1536 rows * 32 B; bounds 512 * 2 * 4 B + codebook 16 * 4 B; outliers 512 * 2 * (2 B + 1 B)."""
    spec = QuantSpec(format="nuq", bits=4, mapping="asymmetric", scale_dtype="float32", outliers=0.01)
    want = {"codes": 49152, "scales": 4160, "outliers": 3072, "total": 56384}
    assert packed_nbytes(spec, (1, 3, 512, 64), dtype=torch.float16, static=True) == want
    x = torch.randn(1, 3, 512, 64, dtype=torch.float16)
    assert quantize(x, spec, QParams(torch.empty(0), codebook=nf_codebook(4))).nbytes() == want


# ------------------------------------------------------------------------------------------------ presets
def test_presets_name_kvquant():
    for b in (4, 3, 2):
        cfg, desc = POLICY_PRESETS[f"kvquant{b}_1pct"]
        assert (cfg, desc) == kvquant_config(b) and "SqueezeAILab/KVQuant @57a2383" in desc and "\n" not in desc
        p = KVPolicy.preset(f"kvquant{b}_1pct")
        assert p.pre_rope and p.scales == "auto" and p.prefill == "quantized" and p.sink_tokens == 1
        assert (p.key.format, p.key.granularity, p.key.scale_dtype, p.key.outliers) == ("nuq", "channel", "float16", 0.01)
        assert (p.value.format, p.value.granularity, p.value.scale_dtype) == ("nuq", "token", "float32")
        assert p.key.bits == p.value.bits == b
    assert preset("nuq4").fmt.name == "nuq" and not preset("nuq4").outliers


# ------------------------------------------------------------------------------------------------ two paths
@pytest.mark.parametrize("name, over", [("kvquant4_1pct", {}), ("kvquant2_1pct", {}),
                                        ("kvquant4_1pct", {"sink_tokens": 2, "residual": 5})])
@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_emulation_equals_real_cache_float64(name, over, which, request):
    model, _ = request.getfixturevalue("tiny_llama64" if which == "llama" else "tiny_gemma3_64")
    policy = _policy(name, request.getfixturevalue(f"{which}_kvq"), **over)
    ids = ids_for(model, 40)
    emulated = emulated_logits(model, ids, policy)
    decoded, _ = decoded_logits(model, ids, policy, prefill_len=1)
    with torch.no_grad():
        assert (emulated - model(ids).logits).abs().max() > 1e-3
    torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)


def test_quantized_prefill_matches_decoding(tiny_llama64, llama_kvq):
    model, _ = tiny_llama64
    policy = _policy("kvquant4_1pct", llama_kvq)
    ids = ids_for(model, 30, seed=3)
    emulated = emulated_logits(model, ids, policy, prefill_len=11)
    decoded, _ = decoded_logits(model, ids, policy, prefill_len=11)
    torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["kvquant4_1pct", "kvquant3_1pct", "kvquant2_1pct"])
@torch.no_grad()
def test_real_cache_bytes_equal_the_bill(name, tiny_llama, tmp_path):
    model, tok = tiny_llama
    path = _scales(model, tok, tmp_path / "f32.safetensors", kv=[name], fisher=False)
    policy = _policy(name, path)
    arch = Arch.from_model(model)
    ids = ids_for(model, 20, seed=2)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    model(ids[:, :7], use_cache=True, **kw)
    for t in range(7, 20):
        model(ids[:, t:t + 1], use_cache=True, **kw)
        bill = kv_bytes(arch, policy, t + 1, 1, 4)
        got = cache.nbytes()
        assert (got["codes"], got["scales"], got["residual"]) == (bill.codes, bill.scales, bill.residual), t
    # by hand (4 layers, 2 kv heads x head_dim 32, n = 64: one outlier slot per side, float32 value + uint8 index),
    # 20 tokens, the first in full precision (float32), per layer: 19 tokens of keys and values at b bits per
    # element; keys 2 fp16 bounds per channel (256 B), values 2 fp32 bounds per token; a float32 codebook of 2^b
    # each; 2 slots * 5 B per token each
    b = int(name[7])
    per_layer = 2 * 2 * 19 * 32 * b // 8 + 256 + 19 * 8 + 2 * 4 * 2**b + 2 * 19 * 2 * 5 + 2 * 64 * 4
    assert got["total"] == 4 * per_layer


# ------------------------------------------------------------------------------------------------ bad input
def test_scales_for_another_model_is_refused(tiny_gemma3_64, llama_kvq):
    model, _ = tiny_gemma3_64
    with pytest.raises(KvevalError, match="calibrate for this model"):
        QuantizedKVCache(model, _policy("kvquant4_1pct", llama_kvq))


def test_missing_or_other_bits_codebook_is_one_line(tiny_llama64, llama_kvq, tmp_path):
    model, tok = tiny_llama64
    with pytest.raises(KvevalError, match=r"no nuq3 codebook for key_pre_ropes per channel with 0.01 outliers") as e:
        QuantizedKVCache(model, _policy("kvquant3_1pct", llama_kvq))
    assert "\n" not in str(e.value) and "it holds key_pre_rope@0.01.channel.nuq2" in str(e.value)
    plain = calibrate(model, tok, load_tokens("builtin", tok), _cfg(["int8"]), tmp_path / "plain.safetensors")
    with pytest.raises(KvevalError, match="it holds none"):
        QuantizedKVCache(model, _policy("kvquant4_1pct", plain))


def test_tampered_codebook_is_refused(llama_kvq, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(llama_kvq), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = codebook_name("value", 0.01, "token", 4)
    for bad, match in ((tensors[name][:, :8].contiguous(), r"has shape \[4, 8\], a nuq4 codebook is \[4, 16\]"),
                       (tensors[name].flip(-1).contiguous(), "not a finite ascending codebook")):
        path = tmp_path / "bad.safetensors"
        save_file({**tensors, name: bad}, str(path), metadata=meta)
        with pytest.raises(KvevalError, match=match):
            load_scales(path)


def test_run_refuses_a_scales_file_without_codebooks_in_one_line(tiny_llama, tmp_path):
    model, tok = tiny_llama
    plain = calibrate(model, tok, load_tokens("builtin", tok), _cfg(["int8"]), tmp_path / "plain.safetensors")
    cfg = json.loads(json.dumps(_cfg(["int8"], tmp_path / "run").resolved()))
    cfg["kv"] = {"policies": {"kvq": {"preset": "kvquant4_1pct", "scales": str(plain)}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "no nuq4 codebook" in errors[0] and "policy 'kvq'" in errors[0]
    assert not (tmp_path / "run" / "records.jsonl").exists()


def test_per_channel_without_calibration_is_refused():
    key = QuantSpec(format="nuq", bits=4, mapping="asymmetric", granularity="channel")
    with pytest.raises(KvevalError, match="calibrate static scales"):
        KVPolicy(key=key, value=preset("nuq4"))
    with pytest.raises(ValueError, match="needs calibrated bounds"):
        quantize(torch.zeros(1, 1, 2, 8), key)
    with pytest.raises(ValueError, match="QuantSpec.bits must be one of 2, 3, 4, 5"):
        QuantSpec(format="nuq", bits=8, mapping="asymmetric")
