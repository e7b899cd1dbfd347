"""Hostile configs: every case is one line on stderr, exit status 2, no traceback, caught by `kveval validate` as
well as `kveval run` (before the first forward pass), and a bad rerun leaves the recorded work alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _validate(h, tmp_path, raw=None, *, text=None, data=None, args=()):
    path = h.write_config(tmp_path / "c.yaml", raw, text=text, data=data)
    return h.invoke("validate", path, *args)


# --- the YAML itself ------------------------------------------------------------------------------------------


def test_duplicate_keys_are_refused(h, tmp_path):
    text = "name: t\nmodel: builtin:tiny-llama\nkv:\n  policies: {mine: int2_g32, mine: int8}\ntasks: [perplexity]\n"
    h.assert_user_error(_validate(h, tmp_path, text=text), "duplicate key 'mine'", "line 4")


def test_duplicate_top_level_keys_are_refused(h, tmp_path):
    text = "name: t\nkv: int8\ntasks: [perplexity]\nseed: 1\nseed: 2\n"
    h.assert_user_error(_validate(h, tmp_path, text=text), "duplicate key 'seed'", "line 5")


def test_merge_keys_may_still_be_overridden(h, tmp_path):
    text = ("name: t\nkv: int8\ntasks:\n  - perplexity: &p {seq_len: 32, max_tokens: 96}\n"
            "  - perplexity: {<<: *p, seq_len: 64}\n")
    result = _validate(h, tmp_path, text=text)
    assert result.exit_code == 0, result.output


def test_duplicate_keys_in_an_override_are_refused(h, tmp_path):
    result = _validate(h, tmp_path, h.tiny_raw(), args=("-s", "kv={policies: {a: int8, a: int4_g64}}"))
    h.assert_user_error(result, "duplicate key 'a'", "override")


def test_python_tag_is_refused(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, text="name: !!python/object/apply:os.system ['echo hi']\n"),
                        "not valid YAML", "!!python/object/apply:os.system", "no tags")


def test_binary_tag_is_refused(h, tmp_path):
    text = yaml.safe_dump(h.tiny_raw()).replace("name: tiny", "name: !!binary dGlueQ==")
    h.assert_user_error(_validate(h, tmp_path, text=text), "!!binary", "no tags")


def test_custom_tag_is_refused(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, text="name: t\nkv: !function os.system\ntasks: [perplexity]\n"),
                        "!function", "no tags")


def test_deeply_nested_yaml_is_one_line(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, text="name: " + "[" * 5000 + "]" * 5000 + "\n"), "nesting deeper")


def test_deeply_nested_yaml_mapping_is_one_line(h, tmp_path):
    text = "name: t\nkv: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n"
    h.assert_user_error(_validate(h, tmp_path, text=text), "nesting deeper")


def test_alias_bomb_is_refused(h, tmp_path):
    lines = ["x:", "  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    text = "\n".join(lines) + "\nname: t\nkv:\n  policies:\n    m: {spec: int8, layers: {'0': *a8}}\ntasks: [perplexity]\n"
    h.assert_user_error(_validate(h, tmp_path, text=text), "aliases are expanded")


def test_recursive_alias_is_refused(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, text="name: t\nkv: &a {policies: {m: *a}}\ntasks: [perplexity]\n"),
                        "recursive alias")


def test_empty_config_is_one_line(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, text=""), "expected a YAML mapping")


def test_huge_config_file_is_refused_unread(h, tmp_path):
    text = yaml.safe_dump(h.tiny_raw()) + "# " + "x" * (2 << 20) + "\n"
    h.assert_user_error(_validate(h, tmp_path, text=text), "bytes, more than")


def test_config_that_is_a_folder(h, tmp_path):
    h.assert_user_error(h.invoke("validate", tmp_path), "is a folder")


# --- encodings ------------------------------------------------------------------------------------------------


def test_utf16_config(h, tmp_path):
    data = yaml.safe_dump(h.tiny_raw()).encode("utf-16")
    h.assert_user_error(_validate(h, tmp_path, data=data), "UTF-16", "save it as UTF-8")


def test_latin1_config(h, tmp_path):
    data = ("# caf\xe9\n" + yaml.safe_dump(h.tiny_raw())).encode("latin-1")
    h.assert_user_error(_validate(h, tmp_path, data=data), "not UTF-8", "0xe9", "line 1")


def test_binary_config(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, data=bytes(range(256)) * 4), "binary")


def test_utf8_bom_config_is_read(h, tmp_path):
    data = b"\xef\xbb\xbf" + yaml.safe_dump(h.tiny_raw(tmp_path / "o")).encode()
    result = _validate(h, tmp_path, data=data)
    assert result.exit_code == 0, result.output


def test_non_utf8_config_through_a_real_process(tmp_path):
    """The promise holds for the installed entry point, not only in-process: exit 2, one line, no traceback."""
    path = tmp_path / "c.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    out = subprocess.run([sys.executable, "-m", "kveval", "validate", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [line for line in out.stderr.splitlines() if line.strip()] == [out.stderr.strip()]
    assert "not UTF-8" in out.stderr


# --- names -----------------------------------------------------------------------------------------------------


def test_policy_named_baseline_is_reserved(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(kv={"policies": {"baseline": "int2_g32"}})),
                        "'baseline' is reserved")


def test_policy_named_baseline_in_list_form(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(kv=["int8", {"baseline": "int2_g32"}])), "reserved")


def test_policy_named_baseline_through_an_override(h, tmp_path):
    result = _validate(h, tmp_path, h.tiny_raw(), args=("-s", "kv.policies.baseline=int8"))
    h.assert_user_error(result, "reserved")


def test_run_name_too_long_for_the_file_system(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(name="x" * 300)), "at most 100 characters")


def test_run_name_dot_dot(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(name="..")), "name:")


def test_run_name_with_a_slash(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(name="a/b")), "name:")


def test_policy_name_with_a_path(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(kv={"policies": {"../x": "int8"}})), "policy name '../x'")


def test_policy_name_too_long(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(kv={"policies": {"p" * 300: "int8"}})), "policy name")


def test_output_component_too_long(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(tmp_path / ("o" * 300))), "longer than the file system")


# --- numbers that used to fail only at the end -------------------------------------------------------------------


def test_negative_seed(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(seed=-1)), "seed")


def test_seed_beyond_64_bits(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(seed=2**70)), "seed", "4294967295")


def test_huge_bootstrap(h, tmp_path):
    raw = h.tiny_raw(tasks=[{"perplexity": {"seq_len": 32, "max_tokens": 96, "bootstrap": 10**12}}])
    h.assert_user_error(_validate(h, tmp_path, raw), "bootstrap", "100000")


def test_bad_gpu_memory(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(memory={"gpu_memory": "lots"})), "memory.gpu_memory")


def test_infinite_gpu_memory(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(memory={"gpu_memory": "1e400GiB"})), "not a finite size")


def test_gpu_memory_beyond_any_gpu(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(memory={"gpu_memory": "1e30GiB"})), "larger than any GPU")


@pytest.mark.parametrize(("size", "needle"), [("1e30GiB", "larger than any GPU"), ("1e400GiB", "not a finite size"),
                                              ("10**40", "bad memory size"), ("-1GiB", "bad memory size")])
def test_memory_command_with_an_impossible_gpu_memory(h, size, needle):
    """``kveval memory --gpu-memory`` takes sizes as the config does: beyond 1 EiB, infinite or malformed is one
    line (it used to end in an OverflowError traceback)."""
    h.assert_user_error(h.invoke("memory", "--shape", "llama-7b-mha", "--context", "2048", "--kv", "int8",
                                 "--gpu-memory", size), needle)


def test_a_short_window_with_the_default_position_bins_runs(h, tmp_path):
    """seq_len below the default 8 position bins: one bin per position, not an error (more bins than positions,
    asked for explicitly, is still one)."""
    from kveval.config import validate

    raw = h.tiny_raw(tmp_path / "run", tasks=[{"perplexity": {"seq_len": 4, "max_tokens": 16, "bootstrap": 0}}])
    assert validate(raw).tasks[0].params.position_bins == 4
    result = h.invoke("run", h.write_config(tmp_path / "c.yaml", raw), "--quiet")
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert len(metrics["policies"]["int8"]["kld_by_position"]) == 4
    raw["tasks"][0]["perplexity"]["position_bins"] = 5
    h.assert_user_error(_validate(h, tmp_path, raw), "position_bins 5 is more than seq_len 4")


def test_zero_gpu_memory(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(memory={"gpu_memory": "0GiB"})), "positive")


def test_max_tokens_one(h, tmp_path):
    raw = h.tiny_raw(tasks=[{"perplexity": {"seq_len": 32, "max_tokens": 1}}])
    h.assert_user_error(_validate(h, tmp_path, raw), "max_tokens 1", "at least 2")


def test_sensitivity_max_tokens_one(h, tmp_path):
    raw = h.tiny_raw(tasks=[{"sensitivity": {"seq_len": 32, "max_tokens": 1}}])
    h.assert_user_error(_validate(h, tmp_path, raw), "sensitivity.max_tokens 1")


def test_more_position_bins_than_positions(h, tmp_path):
    raw = h.tiny_raw(tasks=[{"perplexity": {"seq_len": 32, "position_bins": 10**12}}])
    h.assert_user_error(_validate(h, tmp_path, raw), "position_bins")


def test_nan_threshold(h, tmp_path):
    text = yaml.safe_dump(h.tiny_raw()) + "threshold: {delta_ppl_pct: .nan}\n"
    h.assert_user_error(_validate(h, tmp_path, text=text), "threshold.delta_ppl_pct")


def test_last_zero_selects_no_layer(h, tmp_path):
    raw = h.tiny_raw(kv={"policies": {"m": {"spec": "int8", "layers": {"last 0": {"spec": "int2_g32"}}}}})
    h.assert_user_error(_validate(h, tmp_path, raw), "'last 0' selects no layer")


def test_first_zero_selects_no_layer(h, tmp_path):
    raw = h.tiny_raw(kv={"policies": {"m": {"spec": "int8", "layers": {"0, first 0": {"spec": "int2_g32"}}}}})
    h.assert_user_error(_validate(h, tmp_path, raw), "'first 0' selects no layer")


def test_reversed_layer_range(h, tmp_path):
    raw = h.tiny_raw(kv={"policies": {"m": {"spec": "int8", "layers": {"3-1": {"spec": "int2_g32"}}}}})
    h.assert_user_error(_validate(h, tmp_path, raw), "reversed")


# --- code from a config -------------------------------------------------------------------------------------------


def test_trust_remote_code_in_a_config_needs_the_flag(h, tmp_path):
    raw = h.tiny_raw(model={"name": "builtin:tiny-llama", "trust_remote_code": True})
    h.assert_user_error(_validate(h, tmp_path, raw), "trust_remote_code", "--allow-code")


def test_trust_remote_code_with_the_flag(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", model={"name": "builtin:tiny-llama", "trust_remote_code": True})
    result = _validate(h, tmp_path, raw, args=("--allow-code",))
    assert result.exit_code == 0, result.output


def test_allow_code_is_not_a_config_key(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(allow_code=True)), "allow_code: unknown key")


# --- paths on this machine ------------------------------------------------------------------------------------------


def test_output_is_a_file(h, tmp_path):
    (tmp_path / "afile").write_text("x")
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(tmp_path / "afile")), "is a file, not a folder")


def test_output_under_a_file(h, tmp_path):
    (tmp_path / "afile").write_text("x")
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(tmp_path / "afile" / "sub")), "is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes everywhere")
def test_output_unwritable(h, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(locked / "run")), "not writable")
    finally:
        locked.chmod(0o700)


def test_output_unwritable_for_root_too(h, tmp_path, monkeypatch):
    """A read-only place (faked: os.access says no, as on a read-only mount even for root)."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p) == str(tmp_path) else real(p, mode, **k))
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(tmp_path / "run")), "not writable")


def test_calibration_output_is_a_folder(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", calibration={"output": str(tmp_path)})
    h.assert_user_error(_validate(h, tmp_path, raw), "calibration.output", "is a folder")


def test_cache_root_is_a_file(h, tmp_path, monkeypatch):
    (tmp_path / "cachefile").write_text("x")
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cachefile"))
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(tmp_path / "o")), "KVEVAL_CACHE", "is a file")


def test_cache_root_under_a_file_at_load_time(tmp_path, monkeypatch):
    """The cache code itself (not only config checks): a KvevalError, never NotADirectoryError."""
    from kveval.errors import KvevalError
    from kveval.paths import cache_dir

    (tmp_path / "cachefile").write_text("x")
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cachefile" / "sub"))
    with pytest.raises(KvevalError, match="KVEVAL_CACHE"):
        cache_dir("tokens")


# --- run refuses the same, before touching recorded work --------------------------------------------------------


def test_run_refuses_bad_override_and_keeps_records(h, finished_run):
    path, out, before = finished_run
    h.assert_user_error(h.invoke("run", path, "-s", "seed=-1"), "seed")
    assert (out / "records.jsonl").read_text() == before


def test_run_refuses_duplicate_keys_and_keeps_records(h, finished_run):
    path, out, before = finished_run
    text = path.read_text() + "seed: 3\nseed: 4\n"
    path.write_text(text)
    h.assert_user_error(h.invoke("run", path), "duplicate key 'seed'")
    assert (out / "records.jsonl").read_text() == before


def test_run_refuses_seed_beyond_range(h, tmp_path):
    path = h.write_config(tmp_path / "c.yaml", h.tiny_raw(tmp_path / "o", seed=2**70))
    h.assert_user_error(h.invoke("run", path), "seed")
    assert not (tmp_path / "o").exists()


def test_validate_still_accepts_every_shipped_config():
    from kveval.config import load_config

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if not path.read_text().startswith("# kveval sweep "):  # sweep files: tests/test_config.py loads them
            load_config(path, check=False)  # the inputs on this machine: tests/test_config.py


def test_calibration_output_that_is_a_device(h, tmp_path):
    """An atomic write would replace /dev/null itself (as root): a path that is not a regular file is refused."""
    raw = h.tiny_raw(tmp_path / "o", calibration={"output": "/dev/null"})
    h.assert_user_error(_validate(h, tmp_path, raw), "not a regular file")


def test_cuda_device_without_cuda(h, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    raw = h.tiny_raw(tmp_path / "o", model={"name": "builtin:tiny-llama", "device": "cuda"})
    h.assert_user_error(_validate(h, tmp_path, raw), "CUDA is not available")


def test_validate_sees_a_missing_model_path(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", model=str(tmp_path / "no" / "model"))
    h.assert_user_error(_validate(h, tmp_path, raw), "does not exist")


def test_validate_sees_an_unknown_builtin_model(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(tmp_path / "o", model="builtin:tiny-lama")),
                        "unknown builtin model")


def test_validate_sees_a_pickle_only_model_folder(h, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(tmp_path / "o", model=str(folder))), "pickle weights only")


def test_lm_eval_num_fewshot_beyond_reason(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", tasks=[{"lm_eval": {"tasks": ["x"], "num_fewshot": 10**9}}])
    h.assert_user_error(_validate(h, tmp_path, raw), "num_fewshot")


def test_residual_beyond_any_context(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", kv={"policies": {"a": {"spec": "int8", "residual": 10**30}}})
    h.assert_user_error(_validate(h, tmp_path, raw), "residual", "more tokens than any context")


def test_sink_tokens_beyond_any_context(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", kv={"policies": {"a": {"spec": "int8", "sink_tokens": 10**30}}})
    h.assert_user_error(_validate(h, tmp_path, raw), "sink_tokens")


def test_layer_range_of_10_to_the_20_is_refused_at_once(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", kv={"policies": {"a": {"spec": "int8",
                                                            "layers": {"0-99999999999999999999": {"spec": "int2_g32"}}}}})
    h.assert_user_error(h.invoke("run", h.write_config(tmp_path / "c.yaml", raw)), "has 4 layers")
    assert not (tmp_path / "o").exists()


def test_output_with_a_nul_character(h, tmp_path):
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(output="res/\x00x")), "control character")


def test_scales_that_are_a_device(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", kv={"policies": {"s": {"spec": "int8_tensor", "scales": "/dev/zero"}}})
    h.assert_user_error(_validate(h, tmp_path, raw), "is not a file")


def test_corpus_that_is_a_pipe(h, tmp_path):
    os.mkfifo(tmp_path / "f.txt")
    h.assert_user_error(_validate(h, tmp_path, h.tiny_raw(tmp_path / "o", data=str(tmp_path / "f.txt"))),
                        "is not a file")


def test_validate_sees_a_window_longer_than_a_builtin_model(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", tasks=[{"perplexity": {"seq_len": 4096}}])
    h.assert_user_error(_validate(h, tmp_path, raw), "seq_len 4096", "2048")


def test_validate_sees_a_needle_context_longer_than_a_local_model(h, tmp_path):
    from kveval.models import build_tiny_model, byte_tokenizer

    build_tiny_model("tiny-llama").save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    raw = h.tiny_raw(tmp_path / "o", model=str(tmp_path / "m"),
                     tasks=[{"needle": {"context_lengths": [1024, 100000], "depths": [0.5]}}])
    h.assert_user_error(_validate(h, tmp_path, raw), "needle.context_lengths 100000", "2048")
