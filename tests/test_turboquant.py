"""TurboQuant as vLLM stores it (kveval/quant/formats/turboquant.py, the vllm_turboquant_* presets, the
random_rotation transform): against a reference written from vLLM's source (tests/turboquant_reference.py), against
published Lloyd-Max tables and the exact coordinate density, and through both computation paths on tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from turboquant_reference import (
    PRESETS,
    boundary_skip_layers,
    hadamard,
    key_codes,
    lloyd_max_gaussian,
    load_keys,
    load_values,
    slot_bytes,
    store_keys,
    store_values,
    value_codes,
)
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy
from kveval.policy.presets import POLICY_PRESETS
from kveval.policy.selectors import layers_of
from kveval.quant import QuantSpec, dequantize, fake_quantize, packed_nbytes, preset, quantize
from kveval.quant.formats.turboquant import codebook, midpoints, vllm_codebook
from kveval.quant.rotation import hadamard_matrix as kveval_hadamard
from kveval.quant.rotation import random_matrix
from kveval.transforms import TransformContext
from kveval.transforms.random_rotation import RandomRotation

#: kveval policy preset -> vLLM --kv-cache-dtype
VLLM = {f"vllm_{name}": name for name in PRESETS}
#: kveval QuantSpec preset of vLLM's keys / values at each bit width
KEY_PRESET = {(4, True): "turboquant_k4_nc", (3, True): "turboquant_k3_nc", (4, False): "turboquant_k4"}
VALUE_PRESET = {4: "turboquant_v4", 3: "turboquant_v3"}


def rand(shape, seed, scale=1.0, shift=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)


def rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# ------------------------------------------------------------------------------------------------ codebook
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_is_vllms(d, bits):
    assert list(vllm_codebook(d, bits)) == lloyd_max_gaussian(d, bits)  # float64, to the last bit
    c = codebook(d, bits)
    assert c.dtype == torch.float32 and c.shape == (2**bits,)
    assert torch.equal(c, torch.tensor(lloyd_max_gaussian(d, bits), dtype=torch.float32).sort().values)


# Max (1960), "Quantizing for minimum distortion", Table I: optimal output levels for N(0, 1), positive half
MAX_TABLE = {1: [0.7979], 2: [0.4528, 1.5104], 3: [0.2451, 0.7560, 1.3439, 2.1520],
             4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326]}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_is_symmetric_and_close_to_max_tables(bits):
    for d in (64, 128):
        c = codebook(d, bits)
        assert torch.equal(c, -c.flip(0))  # exactly symmetric in float32
        positive = (c[2 ** (bits - 1):].double() * math.sqrt(d)).tolist()
        # vLLM's trapezoid integrals (200 panels) and its 200-iteration cap leave it within 2e-3 sigma of Max's values
        assert max(abs(a - b) for a, b in zip(positive, MAX_TABLE[bits])) < 2e-3, positive


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) if math.isfinite(x) else float(x > 0)


def _normal_pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_meets_the_lloyd_max_conditions(d, bits):
    """Thresholds are the midpoints of adjacent centroids (float32, exactly); each centroid is the conditional mean
    of N(0, 1/d) over its cell (exact formula sigma (phi(a) - phi(b)) / (Phi(b) - Phi(a))) to 1e-3 sigma, the
    accuracy of vLLM's trapezoid rule."""
    c, m = codebook(d, bits), midpoints(d, bits)
    assert torch.equal(m, (c[:-1] + c[1:]) / 2) and bool((m[1:] > m[:-1]).all())
    sigma = 1 / math.sqrt(d)
    edges = [-math.inf, *(m.double() / sigma).tolist(), math.inf]
    for i, ci in enumerate(c.double().tolist()):
        a, b = edges[i], edges[i + 1]
        mean = (_normal_pdf(a) - _normal_pdf(b)) / (_normal_cdf(b) - _normal_cdf(a))
        assert abs(ci / sigma - mean) < 1e-3, (i, ci / sigma, mean)


def test_codebook_against_the_exact_coordinate_density():
    """A coordinate of a uniformly random unit vector in d dims has density C (1 - x^2)^((d-3)/2) (a scaled Beta);
    vLLM's codebook is optimal for its Gaussian approximation N(0, 1/d). Its distortion d E[(x - c(x))^2] under the
    exact density stays within 2% of the exact Lloyd-Max optimum (measured: 4-bit +1.7% at d = 32, +0.4% at 64,
    +0.1% at 128)."""
    scipy_special = pytest.importorskip("scipy.special")
    from scipy.integrate import quad

    def density(d):
        const = math.exp(scipy_special.gammaln(d / 2) - scipy_special.gammaln((d - 1) / 2)) / math.sqrt(math.pi)
        return const, lambda x: const * (1 - x * x) ** ((d - 3) / 2)

    def cell_mean(d, a, b):
        const, _ = density(d)
        cdf = lambda x: 0.5 + math.copysign(0.5, x) * scipy_special.betainc(0.5, (d - 1) / 2, x * x)  # noqa: E731
        first = lambda x: -const * (1 - x * x) ** ((d - 1) / 2) / (d - 1)  # noqa: E731  (antiderivative of x f)
        return (first(b) - first(a)) / (cdf(b) - cdf(a))

    def distortion(d, c):
        _, f = density(d)
        e = [-1.0] + [(c[i] + c[i + 1]) / 2 for i in range(len(c) - 1)] + [1.0]
        return d * sum(quad(lambda x, ci=ci: (x - ci) ** 2 * f(x), e[i], e[i + 1], epsabs=1e-14)[0]
                       for i, ci in enumerate(c))

    for d in (32, 64, 128):
        for bits in (3, 4):
            c = codebook(d, bits).double().tolist()
            opt = c
            for _ in range(300):  # Lloyd iterations on the exact density, from vLLM's codebook
                e = [-1.0] + [(opt[i] + opt[i + 1]) / 2 for i in range(len(opt) - 1)] + [1.0]
                opt = [cell_mean(d, e[i], e[i + 1]) for i in range(len(opt))]
            ratio = distortion(d, c) / distortion(d, opt)
            assert 1.0 <= ratio < 1.02, (d, bits, ratio)


# ------------------------------------------------------------------------------------------------ keys
def test_hadamard_is_vllms():
    for d in (8, 32, 64, 128, 256):
        assert torch.equal(kveval_hadamard(d, torch.float32, torch.device("cpu")), hadamard(d))


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("bits, nc", [(4, True), (3, True), (4, False)])
def test_keys_match_the_reference_store_and_dequant(d, bits, nc):
    """Random keys: kveval's codes, packed bytes and fp16 norms are vLLM's slot bytes, and k^ is vLLM's
    dequantisation, bit for bit (float32, one CPU)."""
    spec = preset(KEY_PRESET[bits, nc])
    k = rand((2, 3, 41, d), seed=d + bits, scale=2.5, shift=0.3)
    k[0, 0, 0] = 0.0  # a zero vector: norm 0, k^ = 0
    k[0, 0, 1, ::3] = 40.0  # an outlier channel pattern
    qt = quantize(k, spec)
    ref = store_keys(rows(k), bits)
    nb = math.ceil(d * bits / 8)
    assert torch.equal(rows(qt.codes).to(torch.int32), key_codes(ref, bits, d))
    assert torch.equal(rows(spec.fmt.pack(qt.codes, spec)), ref[:, :nb])
    assert qt.scale.dtype == torch.float16
    assert torch.equal(qt.scale.reshape(-1, 1).view(torch.uint8), ref[:, nb : nb + 2])
    khat = dequantize(qt)
    assert torch.equal(rows(khat), load_keys(ref, bits, d, nc))
    assert torch.equal(khat[0, 0, 0], torch.zeros(d))
    assert qt.nbytes() == packed_nbytes(spec, k.shape)
    assert packed_nbytes(spec, (1, 1, 1, d))["total"] == slot_bytes("turboquant_4bit_nc" if bits == 4 else
                                                                     "turboquant_k3v4_nc", d)[0]


def test_key_by_hand_shows_the_norm_correction():
    """k = 3 e_0, D = 8, 2 bits: u = e_0 (to 3e-9), y = u H = [1/sqrt 8] * 8 = 0.35355; the codebook is
    +-0.4526 / sqrt 8 = +-0.16002, +-1.5096 / sqrt 8 = +-0.53374 with thresholds 0, +-0.34688: every y is above
    0.34688, code 3, v = [0.53374] * 8. Without correction k^ = 3 v H = 3 * 0.53374 * sqrt 8 e_0 = 4.529 e_0; with it
    v / ||v|| = [1 / sqrt 8] * 8 and k^ = 3 e_0 (to float32 rounding)."""
    c = codebook(8, 2)
    assert torch.allclose(c.double() * math.sqrt(8), torch.tensor([-1.5096, -0.4526, 0.4526, 1.5096],
                                                                  dtype=torch.float64), atol=1e-4)
    k = torch.zeros(1, 1, 1, 8)
    k[..., 0] = 3.0
    for name, nc in (("turboquant", False), ("turboquant_nc", True)):
        spec = QuantSpec(format=name, bits=2)
        qt = quantize(k, spec)
        assert qt.codes.flatten().tolist() == [3] * 8 and qt.scale.item() == 3.0
        khat = dequantize(qt).flatten()
        expected = 3.0 if nc else 3.0 * float(c[3]) * math.sqrt(8)
        torch.testing.assert_close(khat, torch.tensor([expected] + [0.0] * 7), rtol=0, atol=1e-5)
    assert abs(3.0 * float(c[3]) * math.sqrt(8) - 4.529) < 1e-3


def test_k8v4_keys_are_an_unscaled_saturating_fp8_cast():
    k = torch.tensor([500.0, -1000.0, 3.3, 0.01, -0.3, 448.0, 17.0, 0.0]).reshape(1, 1, 1, 8)
    ref = load_keys(store_keys(rows(k), 8), 8, 8, False)
    got = fake_quantize(k, preset(POLICY_PRESETS["vllm_turboquant_k8v4"][0]["key"]))
    assert torch.equal(rows(got), ref)
    assert got.flatten()[:3].tolist() == [448.0, -448.0, 3.25]


# ------------------------------------------------------------------------------------------------ values
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 3])
def test_values_match_the_reference_store_and_dequant(d, bits):
    spec = preset(VALUE_PRESET[bits])
    v = rand((2, 3, 41, d), seed=10 + d + bits, scale=0.7, shift=-0.2)
    v[0, 0, 0] = 0.5  # a constant row: s floored at 1e-8 (stored as fp16 0), codes 0, v^ = min
    qt = quantize(v, spec)
    ref = store_values(rows(v), bits)
    nb = math.ceil(d * bits / 8)
    assert torch.equal(rows(qt.codes).to(torch.int32), value_codes(ref, bits, d))
    assert torch.equal(rows(spec.fmt.pack(qt.codes, spec)), ref[:, :nb])
    assert torch.equal(qt.scale.reshape(-1, 1).view(torch.uint8), ref[:, nb : nb + 2])
    assert qt.zero_point is not None
    assert torch.equal(qt.zero_point.reshape(-1, 1).view(torch.uint8), ref[:, nb + 2 : nb + 4])
    assert torch.equal(rows(dequantize(qt)), load_values(ref, bits, d))
    assert torch.equal(dequantize(qt)[0, 0, 0], torch.full((d,), 0.5))
    assert packed_nbytes(spec, (1, 1, 1, d))["total"] == slot_bytes("turboquant_4bit_nc" if bits == 4 else
                                                                     "turboquant_3bit_nc", d)[1]


def test_values_by_hand_round_half_up_from_the_unrounded_scale():
    """v = [0, 1, 2.5, 3], 2 bits: s = 1, (v - 0) / s + 0.5 = [0.5, 1.5, 3, 3.5] -> trunc [0, 1, 3, 3] (kveval's
    'int' format rounds 2.5 half to even: 2). v = [0, 1, ..., 6, 7.5], 3 bits: s = 7.5 / 7 = 1.0714286 (codes from
    it: 0..7), stored fp16 1.0712890625, so v^[7] = 7 * 1.0712890625 = 7.4990234375."""
    spec = QuantSpec(format="turboquant_uniform", bits=2, mapping="asymmetric")
    qt = quantize(torch.tensor([0.0, 1.0, 2.5, 3.0]).reshape(1, 1, 1, 4), spec)
    assert qt.codes.flatten().tolist() == [0, 1, 3, 3]
    assert dequantize(qt).flatten().tolist() == [0.0, 1.0, 3.0, 3.0]
    v = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7.5]).reshape(1, 1, 1, 8)
    qt = quantize(v, preset("turboquant_v3"))
    assert qt.codes.flatten().tolist() == list(range(8)) and qt.scale.item() == 1.0712890625
    assert dequantize(qt).flatten()[-1].item() == 7 * 1.0712890625


# ------------------------------------------------------------------------------------------------ presets
def test_presets_are_vllms_dtypes():
    """Each vllm_turboquant_* preset: vLLM's key and value bits, norm correction, prompt attending to raw K/V, the
    first and last 2 layers unquantized (vLLM's rule for dense models of >= 4 layers), vLLM's version named."""
    for name, dtype in VLLM.items():
        cfg, desc = POLICY_PRESETS[name]
        assert "vLLM 0.20.1+" in desc and dtype in desc
        kb, vb, nc = PRESETS[dtype]
        policy = KVPolicy.preset(name)
        key = policy.key
        if kb == 8:
            assert key == preset("fp8_e4m3") and key.static_scale == 1.0
        else:
            assert key == preset(KEY_PRESET[kb, nc]) and key.fmt.norm_correction == nc
        assert policy.value == preset(VALUE_PRESET[vb])
        assert policy.prefill == "fp" and policy.residual == 0 and policy.sink_tokens == 0
        for n_layers in (4, 5, 16, 30, 64):
            specs = [policy.specs_for_layer(i, n_layers) for i in range(n_layers)]
            skipped = [i for i, (k, _) in enumerate(specs) if k.is_none]
            assert skipped == [i for i, (_, v) in enumerate(specs) if v.is_none]
            assert skipped == boundary_skip_layers(n_layers) == layers_of("first 2, last 2", n_layers)
    # 3 layers is where kveval's selector and vLLM's min(2, L // 2) differ ([0, 1, 2] against [0, 2])
    assert boundary_skip_layers(3) == [0, 2] and layers_of("first 2, last 2", 3) == [0, 1, 2]


def _unskipped(name: str, layers: dict | None = None) -> KVPolicy:
    return KVPolicy.from_config({"preset": name, "layers": layers or {}})


POLICIES = {
    **{f"{name}/all_layers": (name, {}) for name in VLLM},
    "vllm_turboquant_4bit_nc/first_last_1": ("vllm_turboquant_4bit_nc", {"first 1, last 1": {"spec": "none"}}),
}


@pytest.mark.parametrize("case", sorted(POLICIES))
@pytest.mark.parametrize("model_fixture", ["tiny_llama64", "tiny_gemma3_64"])
def test_emulation_equals_real_cache_decoding_float64(case, model_fixture, request):
    model, _ = request.getfixturevalue(model_fixture)
    name, layers = POLICIES[case]
    policy = _unskipped(name, layers)
    ids = ids_for(model, 30, seed=2)
    with torch.no_grad():
        baseline = model(ids).logits
    # decoding from one token (the cache's first call stores one token) is emulated with prefill_len 0, as in
    # tests/quant/test_format_plugin.py; a 9-token prompt attends to itself in full precision (prefill: fp)
    for emulated_prefill, decoded_prefill in ((0, 1), (9, 9)):
        emulated = emulated_logits(model, ids, policy, prefill_len=emulated_prefill)
        decoded, _ = decoded_logits(model, ids, policy, prefill_len=decoded_prefill)
        assert (emulated - baseline).abs().max() > 1e-4
        torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)


def test_presets_on_a_4_layer_model_quantize_nothing(tiny_llama64):
    """vLLM skips min(2, L // 2) layers at each end: a 4-layer model keeps every layer in its dtype."""
    model, _ = tiny_llama64
    ids = ids_for(model, 20)
    with torch.no_grad():
        baseline = model(ids).logits
    for name in VLLM:
        policy = KVPolicy.preset(name)
        assert all(spec.is_none for i in range(4) for spec in policy.specs_for_layer(i, 4))
        torch.testing.assert_close(decoded_logits(model, ids, policy)[0], baseline, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", ["vllm_turboquant_k8v4/all_layers", "vllm_turboquant_3bit_nc/all_layers",
                                  "vllm_turboquant_4bit_nc/first_last_1"])
@torch.no_grad()
def test_memory_bill_equals_the_real_cache(case, tiny_llama64):
    model, _ = tiny_llama64
    name, layers = POLICIES[case]
    policy = _unskipped(name, layers)
    arch = Arch.from_model(model)
    ids = ids_for(model, 12, seed=1)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    for t in range(7, 12):
        model(ids[:, :7] if t == 7 else ids[:, t - 1 : t], use_cache=True, **kw)
        bill = kv_bytes(arch, policy, t, 1, fp_bytes=8)
        got = cache.nbytes()
        assert (got["codes"], got["scales"], got["residual"], got["total"]) == (
            bill.codes, bill.scales, bill.residual, bill.total), t
    # per quantized layer, token and kv head: vLLM's key_packed_size + value_packed_size (head_dim 32)
    k_bytes, v_bytes = slot_bytes(VLLM[name], 32)
    quantized_layers = sum(not policy.specs_for_layer(i, 4)[0].is_none for i in range(4))
    fp8_scale = 4 * quantized_layers if PRESETS[VLLM[name]][0] == 8 else 0  # kveval's per-tensor scale 1.0
    assert got["codes"] + got["scales"] == quantized_layers * 11 * 2 * (k_bytes + v_bytes) + fp8_scale


# ------------------------------------------------------------------------------------------------ rotation
def test_random_rotation_matrices():
    q = random_matrix("orthogonal", 42, 64)
    torch.testing.assert_close(q @ q.T, torch.eye(64, dtype=torch.float64), rtol=0, atol=1e-13)
    assert torch.equal(q, random_matrix("orthogonal", 42, 64)) and not torch.equal(q, random_matrix(
        "orthogonal", 43, 64))
    s = random_matrix("signs", 7, 16)
    assert torch.equal(s.abs(), torch.eye(16, dtype=torch.float64))
    k = torch.tensor([3.0, 1.0], dtype=torch.float64).reshape(1, 1, 1, 2)
    t = RandomRotation(kind="signs", seed=0)
    ctx = TransformContext(layer=5, head_dim=2)
    signs = torch.diagonal(random_matrix("signs", 5, 2))  # layer 5 draws with seed 0 + 5
    assert torch.equal(t.key_in(k, ctx).flatten(), k.flatten() * signs)


@pytest.mark.parametrize("kind", ["orthogonal", "signs"])
def test_random_rotation_through_both_paths(kind, tiny_llama64, tiny_gemma3_64):
    for model, _ in (tiny_llama64, tiny_gemma3_64):
        ids = ids_for(model, 24, seed=3)
        with torch.no_grad():
            baseline = model(ids).logits
        fp = KVPolicy.from_config({"spec": "none", "transforms": [{"name": "random_rotation", "kind": kind,
                                                                      "on": "both"}]})
        torch.testing.assert_close(emulated_logits(model, ids, fp), baseline, rtol=0, atol=1e-10)
        torch.testing.assert_close(decoded_logits(model, ids, fp)[0], baseline, rtol=0, atol=1e-10)
        policy = KVPolicy.from_config({"key": "turboquant_k3_nc", "value": "turboquant_v3", "transforms": [
            {"name": "random_rotation", "kind": kind, "seed": 1}]})
        plain = emulated_logits(model, ids, _unskipped("vllm_turboquant_3bit_nc"))
        emulated = emulated_logits(model, ids, policy)
        assert (emulated - plain).abs().max() > 1e-6  # the rotation changes the quantized keys
        torch.testing.assert_close(emulated, decoded_logits(model, ids, policy)[0], rtol=0, atol=1e-9)


# ------------------------------------------------------------------------------------------------ bad input
def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def test_unknown_rotation_is_one_line():
    with pytest.raises(KvevalError) as exc:
        KVPolicy.from_config({"spec": "turboquant_k4_nc", "transforms": [{"name": "random_rotation", "kind": "haar"}]})
    assert "'kind' must be one of orthogonal, signs; got 'haar'" in _one_line(exc)
    with pytest.raises(KvevalError) as exc:
        KVPolicy.from_config({"spec": "turboquant_k4_nc", "transforms": [{"name": "random_rotation", "seed": -1}]})
    assert "'seed' must be a non-negative integer" in _one_line(exc)


def test_impossible_head_dim_is_one_line_before_any_forward_pass():
    for name in ("vllm_turboquant_4bit_nc", "turboquant_k3_nc"):
        policy = KVPolicy.preset(name)
        with pytest.raises(KvevalError) as exc:
            policy.check_model(30, 96)
        assert _one_line(exc).endswith("rotates by a Hadamard matrix: head_dim must be a power of two; got 96")
        with pytest.raises(KvevalError) as exc:  # the memory bill of `kveval memory` checks it too
            kv_bytes(Arch(layers=30, kv_heads=2, head_dim=96), policy, 128, 1)
        _one_line(exc)
    KVPolicy.preset("vllm_turboquant_k8v4").check_model(30, 96)  # FP8 keys and uniform values take any head_dim
    with pytest.raises(ValueError, match="head_dim must be a power of two; got 48"):
        quantize(torch.zeros(1, 1, 2, 48), preset("turboquant_k4"))


@pytest.mark.parametrize("fields, message", [
    ({"format": "turboquant_nc", "bits": 9}, "QuantSpec.bits must be in 1..8 for format 'turboquant_nc'; got 9"),
    ({"format": "turboquant_nc", "granularity": "group", "group_size": 32}, "granularity must be 'token'"),
    ({"format": "turboquant", "mapping": "asymmetric"}, "QuantSpec.mapping must be 'symmetric'"),
    ({"format": "turboquant_uniform", "bits": 4}, "QuantSpec.mapping must be 'asymmetric'"),
    ({"format": "turboquant_uniform", "mapping": "asymmetric", "zero_point": "int"}, "zero_point must be 'float'"),
    ({"format": "turboquant_nc", "clip_ratio": 0.9}, "takes no clip_ratio"),
])
def test_bad_specs_are_one_line(fields, message):
    with pytest.raises(KvevalError) as exc:
        KVPolicy.from_config({"key": fields, "value": "turboquant_v4"})
    assert message in _one_line(exc)
