"""Hostile models: broken local folders, garbage GGUF files, NaN or overflowing weights, and a model cache whose
files changed after it was built. Each is refused safely (nothing pickled or remote is loaded) as one line; a run
never writes NaN metrics with exit 0; the cache notices any changed byte and cleans up after killed conversions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kveval.models as km
import kveval.models.cache as kcache
import kveval.models.load as kload
from kveval.errors import KvevalError
from kveval.models import build_tiny_model, byte_tokenizer, load_model, tiny_model_config

ROOT = Path(__file__).resolve().parents[2]


def _save_tiny(folder: Path, *, scale_mlp: float | None = None, nan: bool = False, **save) -> Path:
    model = build_tiny_model("tiny-llama")
    with torch.no_grad():
        if nan:
            model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        if scale_mlp is not None:
            for layer in model.model.layers:
                layer.mlp.up_proj.weight.mul_(scale_mlp)
                layer.mlp.gate_proj.weight.mul_(scale_mlp)
    model.save_pretrained(folder, **save)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _run(h, tmp_path, model, **extra):
    raw = h.tiny_raw(tmp_path / "out", model=model, **extra)
    return h.invoke("run", h.write_config(tmp_path / "c.yaml", raw))


# --- broken local folders ---------------------------------------------------------------------------------------


def test_folder_with_garbage_config(h, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{garbage")
    h.assert_user_error(_run(h, tmp_path, str(tmp_path / "m")), "config.json is not valid JSON")
    assert not (tmp_path / "out").exists()


def test_folder_with_a_config_that_is_not_an_object(h, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("[1, 2]")
    h.assert_user_error(_run(h, tmp_path, str(tmp_path / "m")), "not a JSON object")


def test_folder_without_weights(h, tmp_path):
    (tmp_path / "m").mkdir()
    tiny_model_config("tiny-llama").save_pretrained(tmp_path / "m")
    h.assert_user_error(_run(h, tmp_path, str(tmp_path / "m")), "has no weights")


def test_folder_with_pickle_weights_only_is_never_unpickled(h, tmp_path, monkeypatch):
    folder = tmp_path / "m"
    folder.mkdir()
    model = build_tiny_model("tiny-llama")
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    byte_tokenizer().save_pretrained(folder)

    def no_unpickling(*a, **k):
        raise AssertionError("torch.load was called on a pickle")

    monkeypatch.setattr(torch, "load", no_unpickling)
    h.assert_user_error(_run(h, tmp_path, str(folder)), "pickle weights only", "pytorch_model.bin")


def test_folder_that_needs_remote_code(h, tmp_path):
    folder = _save_tiny(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "modeling_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    cfg["model_type"] = "xmodel"
    (folder / "config.json").write_text(json.dumps(cfg))
    planted = tmp_path / "PWNED"
    (folder / "modeling_x.py").write_text(f"open({str(planted)!r}, 'w').write('x')\n")
    h.assert_user_error(_run(h, tmp_path, str(folder)), "needs its own Python code", "--allow-code")
    assert not planted.exists(), "the model's code was executed"


def test_folder_with_garbage_tokenizer(h, tmp_path):
    folder = _save_tiny(tmp_path / "m")
    (folder / "tokenizer.json").write_text("{not json")
    h.assert_user_error(_run(h, tmp_path, str(folder)), "cannot be loaded")


def test_folder_with_garbage_safetensors(h, tmp_path):
    folder = _save_tiny(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    h.assert_user_error(_run(h, tmp_path, str(folder)), "cannot be loaded")


def test_garbage_gguf(h, tmp_path):
    (tmp_path / "m.gguf").write_bytes(os.urandom(4096))
    h.assert_user_error(_run(h, tmp_path, str(tmp_path / "m.gguf")), "no GGUF magic")


def test_gguf_of_an_unknown_version(h, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + (99).to_bytes(4, "little") + os.urandom(4096))
    h.assert_user_error(_run(h, tmp_path, str(tmp_path / "m.gguf")), "GGUF version 99")


def test_gguf_with_a_garbage_body(h, tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + os.urandom(4096))
    h.assert_user_error(_run(h, tmp_path, str(tmp_path / "m.gguf")), "not a GGUF model")
    assert not [p for p in (tmp_path / "cache" / "models").iterdir()], "nothing is left in the cache"


# --- NaN and overflow ---------------------------------------------------------------------------------------------


def test_nan_weights_are_refused_at_load(h, tmp_path):
    folder = _save_tiny(tmp_path / "m", nan=True)
    h.assert_user_error(_run(h, tmp_path, str(folder)), "model.layers.1.mlp.down_proj.weight", "NaN")
    assert not (tmp_path / "out").exists()


def test_weights_that_overflow_float16_when_cast(tmp_path):
    model = build_tiny_model("tiny-llama")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1e6
    model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    assert load_model(str(tmp_path / "m"), dtype="bfloat16")  # bfloat16 has float32's range
    with pytest.raises(KvevalError, match="hold infinity.*use a wider dtype"):
        kload._finish(build_like(tmp_path / "m"), byte_tokenizer(), "m", torch.device("cpu"), torch.float16)


def build_like(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)


def test_activations_that_overflow_float16_stop_the_run(h, tmp_path):
    """Finite weights whose activations overflow float16: the baseline's logits are NaN. The run says it is the
    model's fault, exits 2, and writes no NaN metrics."""
    folder = _save_tiny(tmp_path / "m", scale_mlp=1000.0)
    result = _run(h, tmp_path, {"name": str(folder), "dtype": "float16"})
    h.assert_user_error(result, "the model's own logits hold", "float16", "without any KV quantization")
    assert not (tmp_path / "out" / "metrics.json").exists()
    records = tmp_path / "out" / "records.jsonl"
    assert not records.exists() or records.read_text() == ""


def test_nan_in_a_policy_is_the_quantizers_fault(h, tmp_path, monkeypatch):
    """Baseline finite, a policy's logits NaN: the line names the policy and blames quantizer/emulation."""
    import contextlib

    import kveval.patch as patch

    real = patch.emulate

    @contextlib.contextmanager
    def poisoned(model, policy, **kw):
        with real(model, policy, **kw) as emu:
            handle = model.lm_head.register_forward_hook(lambda m, i, o: o * float("nan"))
            try:
                yield emu
            finally:
                handle.remove()

    monkeypatch.setattr(patch, "emulate", poisoned)
    h.assert_user_error(_run(h, tmp_path, "builtin:tiny-llama"), "policy 'int8'", "quantizer", "emulation")
    assert not (tmp_path / "out" / "metrics.json").exists()
    recs = [json.loads(x) for x in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert all(r["policy"] == "baseline" for r in recs), "no NaN record is written"


def test_non_finite_keys_given_to_a_quantizer(h, tmp_path, monkeypatch):
    import kveval.patch as patch

    def raising(*a, **k):
        raise ValueError("non-finite values in input to quantize")

    monkeypatch.setattr(patch, "emulate", raising)
    h.assert_user_error(_run(h, tmp_path, "builtin:tiny-llama"), "policy 'int8'", "NaN or infinity")


# --- the model cache ----------------------------------------------------------------------------------------------


def _entry(tmp_path: Path) -> Path:
    """A cache entry built the way the GGUF conversion builds one (a tiny model instead of a converted GGUF)."""
    source = tmp_path / "src.gguf"
    source.write_bytes(b"GGUF")
    entry = tmp_path / "entry"
    _save_tiny(entry)
    km.write_marker(entry, source)
    assert kcache._verify_entry(entry) is None
    return entry


def test_cache_entry_with_a_flipped_block_in_the_middle(tmp_path):
    entry = _entry(tmp_path)
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # away from the first and last MiB of a real model; here: the middle
        f.seek(size // 2)
        block = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))
    assert weights.stat().st_size == size
    assert "model.safetensors changed" in kcache._verify_entry(entry)


def test_cache_entry_with_an_edited_config(tmp_path):
    entry = _entry(tmp_path)
    text = (entry / "config.json").read_text()
    (entry / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-01'))
    assert (entry / "config.json").read_text() != text
    assert "config.json" in kcache._verify_entry(entry)


def test_cache_entry_with_an_edited_tokenizer_of_the_same_size(tmp_path):
    entry = _entry(tmp_path)
    data = bytearray((entry / "tokenizer.json").read_bytes())
    i = data.index(b'"<unk>"')
    data[i + 2] = ord("x")  # same length
    (entry / "tokenizer.json").write_bytes(bytes(data))
    assert "tokenizer.json" in kcache._verify_entry(entry)


def test_cache_entry_with_an_extra_file(tmp_path):
    entry = _entry(tmp_path)
    (entry / "modeling_evil.py").write_text("print('hi')\n")
    assert "unexpected file modeling_evil.py" in kcache._verify_entry(entry)


def test_cache_entry_with_an_old_marker_is_rebuilt(tmp_path):
    entry = _entry(tmp_path)
    marker = json.loads((entry / km.MARKER).read_text())
    marker["format"] = 1
    (entry / km.MARKER).write_text(json.dumps(marker))
    assert kcache._verify_entry(entry) == "marker of another format"


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()

    def make(name: str, age: float) -> Path:
        p = models / name
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"x" * 100)
        for q in (p / "model.safetensors", p):
            os.utime(q, (now - age, now - age))
        return p

    entry = "SmolLM2-135M-Instruct.Q4_1-be52718836c8c51d"
    gone = make(f".{entry}.0a1b2c3d.pid{dead.pid}", 3600)
    young = make(f".{entry}.1a1b2c3d.pid{dead.pid}", 5)
    alive = make(f".{entry}.2a1b2c3d.pid{os.getpid()}", 3600 * 24)
    legacy = make(f".{entry}.ab_cd9xy", 3600 * 2)
    legacy_young = make(f".{entry}.zz_cd9xy", 60)
    other = make(".something-else", 3600 * 24)
    real_entry = make(entry, 3600 * 24)
    removed = km.clean_stale_temporaries(models, now=now)
    assert sorted(removed) == sorted([gone, legacy])
    for p in (young, alive, legacy_young, other, real_entry):
        assert p.is_dir(), p


def test_temporaries_with_a_lock_file_follow_the_lock(tmp_path):
    """A temporary folder with a lock file beside it is removed when nobody holds the lock (its writer died),
    however fresh, and kept while the lock is held, however old; a lock file whose folder is gone is removed
    once free."""
    from kveval.models.temporaries import holding_lock

    models = tmp_path / "models"
    models.mkdir()
    entry = "SmolLM2-135M-Instruct.Q4_1-be52718836c8c51d"
    dead = models / f".{entry}.0a1b2c3d.pid{os.getpid()}"  # this process is alive, but its lock is free
    dead.mkdir()
    (models / (dead.name + ".lock")).write_text("")
    held = models / f".{entry}.1a1b2c3d.pid999999"
    held.mkdir()
    old = time.time() - 10 * km.STALE_TEMP_SECONDS
    os.utime(held, (old, old))
    orphan = models / f".{entry}.2a1b2c3d.pid999998.lock"
    orphan.write_text("")
    with holding_lock(held):
        assert (models / (held.name + ".lock")).exists()
        assert km.clean_stale_temporaries(models) == [dead]
        assert held.is_dir() and not dead.exists() and not orphan.exists()
    assert not (models / (held.name + ".lock")).exists(), "the writer removes its lock file when it is done"


@pytest.mark.integration
def test_killed_conversion_leaves_nothing_behind(tmp_path):
    """A GGUF conversion killed midway leaves its temporary folder; the next load removes it at once (nobody
    holds its lock any more), instead of keeping 500 MiB in the cache until it is old enough."""
    cache = tmp_path / "cache"
    env = {**os.environ, "KVEVAL_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-c", "from kveval.models import load_model; "
                             "load_model('builtin:smollm2-135m')"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    models = cache / "models"
    deadline = time.time() + 300
    temps: list[Path] = []
    while time.time() < deadline and not temps:
        temps = [p for p in models.glob(".*") if p.is_dir()] if models.is_dir() else []
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert temps, "the conversion was killed while it wrote its temporary folder"
    assert all(p.name.endswith(f".pid{proc.pid}") for p in temps)
    # the conversion's lock died with it: the next look removes its folder at once, however fresh
    assert sorted(km.clean_stale_temporaries(models)) == sorted(temps)
    assert not [p for p in models.iterdir() if p.name.startswith(".")]


@pytest.mark.integration
def test_builtin_cache_with_a_flipped_block_is_rebuilt(tmp_path, monkeypatch):
    """End to end on the builtin model: a flipped block in the middle of the weights (sizes, first and last MiB
    unchanged) is noticed at the next load, the entry is rebuilt, and the logits are those of a clean load."""
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))
    model, tok = load_model("builtin:smollm2-135m")
    ids = torch.tensor([tok("The KV cache holds keys and values.", add_special_tokens=False).input_ids])
    with torch.no_grad():
        ref = model(ids).logits
    entry = km.gguf_cache_path(km.smollm2_gguf())
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.seek(size // 2)
        block = f.read(4096)
        f.seek(size // 2)
        f.write(bytes(b ^ 0x55 for b in block))
    calls = []
    real = kcache._convert_gguf
    monkeypatch.setattr(kcache, "_convert_gguf", lambda *a: (calls.append(a), real(*a))[1])
    model, tok = load_model("builtin:smollm2-135m")
    assert len(calls) == 1, "the changed entry was rebuilt"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    assert kcache._verify_entry(entry) is None
