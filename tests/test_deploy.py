"""``kveval deploy`` and ``kveval plan --engine``: the README's plan (``kveval plan results/layer_scan_1w --budget
int4_g64`` on SmolLM2-135M, here on a scan built with its shape and its most sensitive cells) in each engine's
syntax, checked against each engine's own argument grammar (the choices below are copied from the engines'
sources, cited), and plans restricted to what an engine can run."""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from kveval.commands.deploy import deploy_command, render
from kveval.commands.plan import plan_command
from kveval.engines.costs import Costs
from kveval.engines.express import NotExpressible, deploy, express
from kveval.engines.tables import ENGINES
from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.policy import KVPolicy
from kveval.tasks.sensitivity.planner import plan

# vLLM 0.33.0 vllm/config/cache.py CacheDType (L44-67)
VLLM_KV_DTYPES = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
                  "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "octave_k3v4",
                  "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit", "int4_per_token_head",
                  "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6"]
# llama.cpp 0c1e570 common/arg.cpp kv_cache_types (L304-314); -fa on|off|auto
LLAMACPP_KV_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
# SGLang 0.5.23 srt/arg_groups/fields/model.py kv_cache_dtype choices (L197-220); attention backends choices.py
SGLANG_KV_DTYPES = ["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"]
SGLANG_BACKENDS = ["triton", "torch_native", "flex_attention", "fa3", "fa4", "flashinfer", "trtllm_mha"]
# TensorRT-LLM's KvCacheConfig(dtype=...) of its quantization docs (features/quantization.html)
TRTLLM_DTYPES = ["auto", "fp8", "nvfp4"]

SPECS = ["int8", "int4_g64", "int2_g32", "fp8_e4m3", "nvfp4", "q8_0", "q4_0", "mxfp8", "nvfp4_flashinfer",
         "int4_g32"]
#: the README's scan: keys more sensitive than values, the keys of layers 10, 2, 19, 3 and 1 the most under int4_g64
SENSITIVE_KEYS = {10: 12, 2: 10, 19: 9, 3: 5, 1: 4}
BITS = {"int8": 8, "int4_g64": 4, "int2_g32": 2, "fp8_e4m3": 6, "nvfp4": 4.2, "q8_0": 8.2, "q4_0": 4.1,
        "mxfp8": 6.2, "nvfp4_flashinfer": 4.2, "int4_g32": 4.1}


README_SPECS = ["int8", "int4_g64", "int2_g32"]  # configs/layer_scan.yaml


def readme_scan(folder: Path, specs: list[str] = README_SPECS) -> Path:
    """A scan folder of SmolLM2-135M's shape (30 layers x 3 kv heads x 64): per-cell KLDs falling 4x per bit,
    keys 10x values, the README's most sensitive keys weighted up, late values cheap."""
    cells = []
    for i in range(30):
        for t in ("key", "value"):
            base = 0.004 * (10 if t == "key" else 1) * SENSITIVE_KEYS.get(i, 1) * (1 if t == "key" or i < 22 else 0.05)
            for s in specs:
                kld = base * 4.0 ** (4 - BITS[s])
                cells.append({"layer": i, "tensor": t, "spec": s, "kld": kld, "nll_delta": kld})
    arch = Arch.named("smollm2-135m")
    metrics = {"run": "layer_scan_1w", "model": "builtin:smollm2-135m", "policies": {},
               "memory": {"arch": arch.to_dict(), "context": 256},
               "sensitivity": {"specs": specs, "seq_len": 256, "cells": cells, "tokens": 255, "token_end": 256}}
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"name": "builtin:smollm2-135m"},
                                                                  "data": "builtin", "seed": 0}))
    return folder


@pytest.fixture
def scan(tmp_path):
    """The README's scan (int8, int4_g64, int2_g32)."""
    return readme_scan(tmp_path / "layer_scan_1w")


@pytest.fixture
def engine_scan(tmp_path):
    """The same with the engines' own formats scanned too (what kveval plan --engine plans from)."""
    return readme_scan(tmp_path / "engine_scan", SPECS)


def _plan_json(tmp_path: Path, scan: Path, budget: str, engine: str | None = None) -> Path:
    out = tmp_path / "gen" / f"plan_{engine or 'any'}.yaml"
    plan_command(str(scan), budget, str(out), engine=engine)
    return out.with_name(out.stem + ".plan.json")


# ------------------------------------------------------------------------------------------------- grammars
def vllm_args(line: str):
    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"], line
    ap = argparse.ArgumentParser(exit_on_error=False)
    ap.add_argument("model")
    ap.add_argument("--kv-cache-dtype", choices=VLLM_KV_DTYPES, required=True)
    ap.add_argument("--kv-cache-dtype-skip-layers", nargs="+")  # list[str] -> nargs="+" (arg_utils.py L256-259)
    ap.add_argument("--attention-backend")
    args = ap.parse_args(argv[2:])
    for s in args.kv_cache_dtype_skip_layers or []:
        assert s == "sliding_window" or (s.isdigit() and int(s) < 30), s
    return args


def llamacpp_args(line: str):
    argv = shlex.split(line)
    env = {}
    while "=" in argv[0]:
        k, v = argv.pop(0).split("=", 1)
        env[k] = v
    assert argv[0] == "llama-server" and set(env) <= {"LLAMA_ATTN_ROT_DISABLE"}, line
    ap = argparse.ArgumentParser(exit_on_error=False)
    ap.add_argument("-m", required=True)
    ap.add_argument("-ctk", choices=LLAMACPP_KV_TYPES, required=True)
    ap.add_argument("-ctv", choices=LLAMACPP_KV_TYPES, required=True)
    ap.add_argument("-fa", choices=["on", "off", "auto"])
    args = ap.parse_args(argv[1:])
    assert args.ctv == "f16" or args.fa == "on", "a quantized V cache needs flash attention"
    return args, env


def sglang_args(line: str):
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"], line
    ap = argparse.ArgumentParser(exit_on_error=False)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--kv-cache-dtype", choices=SGLANG_KV_DTYPES, required=True)
    ap.add_argument("--attention-backend", choices=SGLANG_BACKENDS)
    return ap.parse_args(argv[3:])


def trtllm_dtype(lines: list[str]) -> str:
    tree = ast.parse("\n".join(lines))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "KvCacheConfig"]
    (call,) = calls
    (kw,) = [k for k in call.keywords if k.arg == "dtype"]
    assert kw.value.value in TRTLLM_DTYPES
    return kw.value.value


# ------------------------------------------------------------------------------------------------- tests
def test_the_readme_plan_in_every_engine(scan, tmp_path):
    """The plan at int4_g64's memory mixes INT8 keys, INT4 g64 and INT2 values: no engine runs it, so each lists
    its nearest policies with the scan's predicted cost, in its own syntax."""
    side = _plan_json(tmp_path, scan, "int4_g64")
    planned = json.loads(side.read_text())
    keys = [e["key"] for e in planned["layers"]]
    assert {i for i, k in enumerate(keys) if k == "int8"} >= {2, 10, 19}
    assert any(e["value"] == "int2_g32" for e in planned["layers"][22:])
    text = deploy_command(str(side))
    for engine in ENGINES.values():
        assert f"== {engine.title} ==" in text
    deps = {d.engine: d for d in deploy(*_loaded(side))}
    for key, d in deps.items():
        assert not d.exact and d.nearest, key
    # the scan holds int4_g64, transformers' quanto int4 type: its cost is predicted; the others are not measured
    quanto = next(o for o in deps["transformers"].nearest if o.preset == "hf_quanto_int4")
    assert quanto.kld is not None and "predicted from the scan" in quanto.source
    assert "not measured" in next(o for o in deps["vllm"].nearest).line()
    assert any("--kv-cache-dtype nvfp4" in o.label for o in deps["vllm"].nearest)
    assert any("-ctk q4_0 -ctv q4_0" in o.label for o in deps["llamacpp"].nearest)
    for o in deps["vllm"].nearest:
        vllm_args(f"vllm serve M {o.label}")
    for o in deps["sglang"].nearest:
        sglang_args(f"python -m sglang.launch_server --model-path M {o.label}")
    assert "mixes" in deps["vllm"].reason or "none of" in deps["vllm"].reason


def _loaded(side: Path):
    from kveval.commands.deploy import load_target

    policies, arch, context, model, scan, scan_name, hint = load_target(str(side))
    return policies, arch, context, model, Costs(scan=scan, scan_name=scan_name)


@pytest.mark.parametrize("engine", ["vllm", "llamacpp", "sglang", "trtllm", "transformers"])
def test_plan_engine_restricts_the_candidates_and_deploys_exactly(engine_scan, tmp_path, engine):
    side = _plan_json(tmp_path, engine_scan, "5", engine)
    planned = json.loads(side.read_text())
    eng = ENGINES[engine]
    allowed = set(eng.candidates(SPECS)) | {"none"}
    assert planned["engine"] == engine
    assert {e["key"] for e in planned["layers"]} | {e["value"] for e in planned["layers"]} <= allowed
    assert planned["total_bytes"] <= planned["budget_bytes"]
    (dep,) = [d for d in deploy(*_loaded(side)) if d.engine == engine]
    assert dep.exact, dep.reason
    if engine == "vllm":
        args = vllm_args(dep.lines[0])
        skipped = [i for i, e in enumerate(planned["layers"]) if e["key"] == "none"]
        assert [int(s) for s in args.kv_cache_dtype_skip_layers or []] == skipped and skipped
        assert args.kv_cache_dtype == eng.type_named(next(e["key"] for e in planned["layers"] if e["key"] != "none")).name
    elif engine == "llamacpp":
        args, env = llamacpp_args(dep.lines[0])
        assert env == {"LLAMA_ATTN_ROT_DISABLE": "1"}  # bare ggml specs: llama.cpp's rotation off
    elif engine == "sglang":
        sglang_args(dep.lines[0])
    elif engine == "trtllm":
        assert trtllm_dtype(dep.lines) in ("fp8", "nvfp4")
    else:
        _run_the_transformers_line(dep.lines[0])


def _run_the_transformers_line(line: str, model=None) -> None:
    """The printed line runs as written against the installed transformers (a tiny Llama unless ``model`` is
    given; its ``generate`` wrapped only to keep the cache it built), and the cache it builds is transformers'
    QuantizedCache with exactly the printed configuration at every layer."""
    from kveval.models import build_tiny_model

    model = build_tiny_model("tiny-llama") if model is None else model
    ids = torch.randint(4, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    config = ast.literal_eval(re.search(r"cache_config=(\{.*?\})", line).group(1))
    new_tokens = int(re.search(r"max_new_tokens=(\d+)", line).group(1))
    built = {}
    generate = model.generate

    def keeping_the_cache(**kwargs):
        out = generate(**kwargs, do_sample=False, min_new_tokens=new_tokens, return_dict_in_generate=True)
        built["cache"] = out.past_key_values
        return out.sequences

    namespace = {"model": SimpleNamespace(generate=keeping_the_cache), "inputs": {"input_ids": ids}}
    exec(compile(line, "<deploy>", "exec"), namespace)  # noqa: S102 - kveval's own printed code, on a tiny model
    assert namespace["out"].shape == (1, 40 + new_tokens)
    cache = built["cache"]
    assert type(cache).__name__ == "QuantizedCache" and len(cache.layers) == model.config.num_hidden_layers
    backend = {"quanto": "QuantoQuantizedLayer", "hqq": "HQQQuantizedLayer", "fp8": "Fp8QuantizedLayer"}
    for layer in cache.layers:
        assert type(layer).__name__ == backend[config["backend"]]
        for key, value in config.items():
            if key != "backend":
                assert getattr(layer, key) == value, (key, getattr(layer, key), value)


def test_the_vllm_plan_is_the_best_one_type_with_skipped_layers(engine_scan):
    """Brute force over vLLM's runnable plans: one scanned type for every layer, any set of layers skipped (to
    the model dtype), within the budget: the planner's choice has the least summed KLD (checked on 4 layers)."""
    import itertools

    metrics = json.loads((engine_scan / "metrics.json").read_text())
    metrics["memory"]["arch"]["layers"] = 4
    metrics["sensitivity"]["cells"] = [c for c in metrics["sensitivity"]["cells"] if c["layer"] < 4]
    arch = Arch.from_dict(metrics["memory"]["arch"])
    p = plan(metrics, "6", engine="vllm")
    kld = {(c["layer"], c["tensor"], c["spec"]): c["kld"] for c in metrics["sensitivity"]["cells"]}
    best = None
    for d in ENGINES["vllm"].candidates(SPECS):
        for skip in itertools.product([False, True], repeat=4):
            cfg = {"spec": d, "layers": {str(i): {"spec": "none"} for i in range(4) if skip[i]}} if any(skip) \
                else {"spec": d}
            if kv_bytes(arch, KVPolicy.from_config(cfg), 256).total > p.budget_bytes:
                continue
            total = sum(kld[(i, t, d)] for i in range(4) for t in ("key", "value") if not skip[i])
            best = total if best is None or total < best else best
    assert p.predicted_kld_sum == pytest.approx(best)


def test_an_expressible_policy_of_each_engine(tmp_path):
    arch = Arch.named("smollm2-135m")
    cases = {
        "vllm": ({"preset": "vllm_fp8_per_head", "layers": {"0, last 1": {"spec": "none"}}},
                 "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 29 --attention-backend FLASH_ATTN"),
        "llamacpp": ("llamacpp_q4_0", "llama-server -m model.gguf -ctk q4_0 -ctv q4_0 -fa on"),
        "sglang": ("sglang_mxfp8", "--kv-cache-dtype mxfp8 --attention-backend fa4"),
        "trtllm": ("trtllm_nvfp4", "KvCacheConfig(dtype='nvfp4')"),
        "transformers": ("hf_quanto_int4", "'residual_length': 128"),
    }
    for key, (cfg, want) in cases.items():
        dep = express(ENGINES[key], KVPolicy.from_config(cfg, name="p"), arch, "M")
        assert want in "\n".join(dep.lines), (key, dep.lines)
    norot = express(ENGINES["llamacpp"], KVPolicy.preset("llamacpp_q8_0_norot"), arch, "M")
    assert norot.lines[0].startswith("LLAMA_ATTN_ROT_DISABLE=1 llama-server") and "-ctk q8_0" in norot.lines[0]
    notes = express(ENGINES["vllm"], KVPolicy.preset("vllm_fp8_per_head"), arch, "M").notes
    assert any("--export compressed-tensors CONFIG-kv-checkpoint --strategy attn_head" in n for n in notes)


def test_transformers_code_runs(tiny_llama):
    """The printed transformers call generates through the real QuantizedCache (quanto, hqq, fp8) with exactly the
    printed configuration."""
    model, tok = tiny_llama
    arch = Arch.from_model(model)
    for cfg in ("hf_quanto_int4", {"preset": "hf_hqq_int4", "residual": 8, "spec": {"preset": "hqq4_g32"}}, "hf_fp8"):
        policy = KVPolicy.from_config(cfg, name="p")
        if policy.key.group_size == 64:
            policy = KVPolicy.from_config({"preset": "hf_quanto_int4", "spec": {"preset": "int4_g32",
                                                                                "scale_dtype": "model"}})
        (line,) = express(ENGINES["transformers"], policy, arch, "M").lines
        _run_the_transformers_line(line, model)


def test_measured_costs_come_from_a_run_folder(scan, tmp_path):
    from synthetic_runs import write_synthetic_run

    run = write_synthetic_run(tmp_path / "engines", policies=("vllm_nvfp4", "llamacpp_q4_0"), records=False)
    side = _plan_json(tmp_path, scan, "int4_g64")
    text = deploy_command(str(side), run_dir=str(run), engines=["vllm", "llamacpp"])
    measured = [line for line in text.splitlines() if "measured in" in line]
    assert any("--kv-cache-dtype nvfp4" in line for line in measured)
    assert any("-ctk q4_0" in line for line in measured)
    assert "== SGLang" not in text


def test_bad_deploy_input_is_one_line(tmp_path, scan):
    from typer.testing import CliRunner

    from kveval.cli import app

    result = CliRunner().invoke(app, ["deploy", str(tmp_path / "none.plan.json")])
    assert result.exit_code == 2 and "does not exist" in result.stderr
    side = _plan_json(tmp_path, scan, "int4_g64")
    result = CliRunner().invoke(app, ["deploy", str(side), "--engine", "vlm"])
    assert result.exit_code == 2 and "did you mean 'vllm'" in result.stderr
    with pytest.raises(KvevalError, match="none of the specs"):
        metrics = json.loads((scan / "metrics.json").read_text())
        metrics["sensitivity"]["specs"] = ["int4_g64"]
        metrics["sensitivity"]["cells"] = [c for c in metrics["sensitivity"]["cells"] if c["spec"] == "int4_g64"]
        plan(metrics, "5", engine="vllm")


def test_render_names_the_context(scan, tmp_path):
    policies, arch, context, model, costs = _loaded(_plan_json(tmp_path, scan, "int4_g64"))
    assert f"(memory at {context} tokens" in render(deploy(policies, arch, context, model, costs), arch, context)


def _printed_lines(text: str) -> list[str]:
    """The command lines of deploy's output: engine lines (indented two spaces) and the ``run it:`` kveval lines."""
    lines = [line[2:] for line in text.splitlines() if line.startswith("  ") and not line.startswith(("  #", "   "))
             and not line.strip().startswith("nearest")]
    lines += re.findall(r"run it: (kveval .*)\)$", text, flags=re.M)
    return lines


def test_every_kveval_line_deploy_prints_passes_validate(tmp_path):
    """The "run it:" lines of the nearest options, pasted back with run -> validate as they are, are accepted: each
    names a policy kveval has (never an engine flag such as --kv-cache-dtype fp8_e5m2 or KvCacheConfig(dtype='fp8'))
    and an output folder of its own (the config's folder holds the config's run, which validate refuses as run
    does)."""
    from typer.testing import CliRunner

    from kveval.cli import app

    text = deploy_command("configs/engines.yaml")
    runs = sorted(set(re.findall(r"run it: (kveval .*)\)$", text, flags=re.M)))
    assert len(runs) >= 10, runs
    for line in runs:
        argv = shlex.split(line)
        assert argv[:2] == ["kveval", "run"], line
        assert argv[-2] == "-o" and argv[-1].startswith("results/engines-"), line
        result = CliRunner().invoke(app, ["validate", *argv[2:]])
        assert result.exit_code == 0, (line, result.output)


def test_printed_engine_lines_are_quoted_for_the_shell(tmp_path):
    """A model path holding a space, ';' and '$' comes back as one argument when the printed line is split as a
    shell would, so pasting it runs one command with that path."""
    hostile = str(tmp_path / "my models; rm -rf $HOME" / "m.gguf")
    policies = {n: KVPolicy.preset(n) for n in ("vllm_fp8", "llamacpp_q4_0", "sglang_mxfp8")}
    deps = deploy(policies, Arch.named("smollm2-135m"), 256, hostile, Costs())
    shell_lines = [line for d in deps if d.exact and d.engine in ("vllm", "llamacpp", "sglang") for line in d.lines]
    assert len(shell_lines) >= 3, shell_lines
    for line in shell_lines:
        argv = shlex.split(line)
        assert hostile in argv, (line, argv)
        assert ";" not in [a for a in argv if a != hostile and ";" in a]


def test_nearest_is_ordered_by_bits_then_cost():
    """int8 (8.25 bits) on llama.cpp: q8_0 (8.5 bits) first, then the 6- and 5.5-bit types, never q5_1 first."""
    deps = deploy({"int8": KVPolicy.preset("int8")}, Arch.named("smollm2-135m"), 512, "m.gguf", Costs(),
                  ["llamacpp"])
    labels = [o.label for o in deps[0].nearest]
    assert labels == ["-ctk q8_0 -ctv q8_0", "-ctk q5_1 -ctv q5_1", "-ctk q5_0 -ctv q5_0"], labels


def test_transformers_quantized_cache_is_refused_where_transformers_refuses_it():
    """A model with sliding-window layers: transformers' own QuantizedCache raises, and deploy says the policy is not
    expressible there (with the nearest options) instead of printing code that fails; likewise a group size that
    does not divide head_dim."""
    from transformers import QuantizedCache

    from kveval.models import tiny_model_config

    config = tiny_model_config("tiny-gemma3")
    with pytest.raises(ValueError, match="full attention"):
        QuantizedCache(backend="quanto", config=config, nbits=4, q_group_size=32, residual_length=0)
    arch = Arch.from_model_config(config, name="builtin:tiny-gemma3")
    assert arch.sliding_layers
    policy = KVPolicy.from_config({"preset": "hf_quanto_int4", "spec": "int4_g32"}, name="q")
    dep = deploy({"q": policy}, arch, 64, "m", Costs(), ["transformers"])[0]
    assert not dep.exact and "sliding-window" in dep.reason and dep.nearest
    odd = Arch.from_dict({**Arch.named("smollm2-135m").to_dict(), "head_dim": 96})
    with pytest.raises(NotExpressible, match="does not divide head_dim 96"):
        express(ENGINES["transformers"], KVPolicy.preset("hf_quanto_int4"), odd, "m")
    with pytest.raises(KvevalError, match="does not divide head_dim 96"):  # and the policy has no bill there
        deploy({"q": KVPolicy.preset("hf_quanto_int4")}, odd, 64, "m", Costs(), ["transformers"])


def test_the_calibrate_line_of_a_static_scales_note_parses_as_kveval_calibrate():
    """The note's `kveval calibrate ...` line names a real folder (no DIR placeholder) and kveval calibrate's own
    parser accepts every argument of it."""
    import typer.main

    from kveval.cli import app

    deps = deploy({"p": KVPolicy.preset("vllm_fp8_per_head")}, Arch.named("smollm2-135m"), 256, "m", Costs(),
                  ["vllm"], config_hint="configs/engines.yaml")
    note = next(n for n in deps[0].notes if "kveval calibrate" in n)
    line = re.search(r"\((kveval calibrate .*?), then serve", note).group(1)
    argv = shlex.split(line)
    assert "DIR" not in argv and argv[-2:] == ["--strategy", "attn_head"]
    command = typer.main.get_command(app).commands["calibrate"]
    ctx = command.make_context("calibrate", argv[2:])
    assert ctx.params["export"][0] == "compressed-tensors" and str(ctx.params["config"]) == "configs/engines.yaml"
