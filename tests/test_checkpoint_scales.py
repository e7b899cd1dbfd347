"""Checkpoint KV scales in (kveval.scales.checkpoint): compressed-tensors and ModelOpt folders built in the tests are
read as vLLM / SGLang / TensorRT-LLM load them, and the engine presets use them by default: the same metrics as the
same scales given as a kveval scales file, scales of 1.0 reproduce the preset without checkpoint scales, a bad
scale costs KLD, and env.json and the report say where the scales came from."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_folders import add_compressed_tensors_scales, add_modelopt_scales, save_model_folder  # noqa: E402

from kveval.errors import KvevalError  # noqa: E402
from kveval.quant import preset  # noqa: E402
from kveval.scales.checkpoint import (  # noqa: E402
    PRESET_ENGINES,
    default_engine,
    load_checkpoint_scales,
    read_scheme,
    target_of,
)
from kveval.scales.file import load_scales, save_scales  # noqa: E402
from kveval.scales.ranges import Ranges  # noqa: E402

pytest.importorskip("compressed_tensors")

K = [0.0625, 0.09375, 0.125, 0.1875]  # bf16-exact: the checkpoint holds exactly these
V = [0.03125, 0.046875, 0.0625, 0.078125]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from kveval.models import build_tiny_model, byte_tokenizer

    return save_model_folder(build_tiny_model("tiny-llama"), byte_tokenizer(), tmp_path_factory.mktemp("plain"))


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def kveval_scales_file(path: Path, model: str, k: list, v: list, heads: int = 2, dim: int = 32) -> Path:
    """A kveval scales file whose FP8 scales (absmax / 448) are ``k`` / ``v`` per layer (lists per head, or one
    value per layer): absmax = s * 448 is exact in float32 for bf16-exact s, and so is the division back."""
    def ranges(scales):
        out = {}
        for gran in ("tensor", "head", "channel"):
            per = []
            for s in scales:
                t = torch.tensor(s, dtype=torch.float32) * 448
                t = t.max() if gran == "tensor" else t.expand(heads) if t.dim() == 0 else t
                t = t[:, None].expand(heads, dim) if gran == "channel" else t
                per.append(Ranges(t.clone(), -t.clone(), t.clone()))
            out[gran] = per
        return out

    rk, rv = ranges(k), ranges(v)
    data = {(kind, g): r[g] for kind, r in (("key", rk), ("value", rv)) for g in r}
    header = {"model": model, "layers": len(k), "kv_heads": heads, "head_dim": dim, "method": "absmax"}
    return save_scales(path, data, header)


def _run(tmp_path: Path, name: str, model: str, kv, tokens: int = 192) -> dict:
    from kveval.commands.run import run_experiment
    from kveval.config import validate

    cfg = validate({"name": name, "model": model, "data": "builtin", "kv": kv,
                    "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": tokens, "bootstrap": 0}}],
                    "output": str(tmp_path / "runs" / name)})
    return run_experiment(cfg, quiet=True)


def test_compressed_tensors_per_tensor_scales_as_vllm_loads_them(plain, tmp_path):
    folder = add_compressed_tensors_scales(_copy(plain, tmp_path / "ck"), [0.01] * 4, V)
    scheme = read_scheme(folder)
    assert (scheme.producer, scheme.algo, scheme.strategy) == ("compressed-tensors", "FP8", "tensor")
    cs = load_checkpoint_scales(folder)
    # bf16 on disk, float32 in vLLM: 0.01 is held as the bf16 nearest it
    assert cs.tensors["key.scale"].dtype == torch.float32
    assert torch.equal(cs.tensors["key.scale"][:, 0], torch.tensor([0.01] * 4, dtype=torch.bfloat16).float())
    assert torch.equal(cs.tensors["value.scale"][:, 0], torch.tensor(V))
    qp = cs.qparams(2, "value", preset("fp8_e4m3"))
    assert qp.scale.shape == (1, 1, 1, 1) and qp.scale.item() == 0.0625 and qp.zero_point is None
    head = cs.qparams(2, "value", preset("fp8_e4m3_head"))  # a per-tensor scale applies to every head
    assert head.scale.flatten().tolist() == [0.0625, 0.0625]
    with pytest.raises(KvevalError, match="post-RoPE"):
        cs.qparams(0, "key_pre_rope", preset("fp8_e4m3"))
    with pytest.raises(KvevalError, match="symmetric per-tensor or per-head"):
        cs.qparams(0, "key", preset("int4_g64"))


def test_attn_head_scales_and_the_gqa_max_of_q_scales(plain, tmp_path):
    heads_k = [[0.0625, 0.125]] * 4
    q = [[0.5, 0.25, 1.0, 0.125]] * 4  # four query heads over two KV heads: vLLM keeps each group's max
    folder = add_compressed_tensors_scales(_copy(plain, tmp_path / "ck"), heads_k, heads_k, strategy="attn_head",
                                           q=q)
    cs = load_checkpoint_scales(folder)
    assert cs.per_head and cs.tensors["key.scale"].shape == (4, 2)
    assert cs.qparams(1, "key", preset("fp8_e4m3_head")).scale.flatten().tolist() == [0.0625, 0.125]
    assert cs.query_scales()[0].tolist() == [0.5, 1.0]
    with pytest.raises(KvevalError, match="attn_head"):
        cs.qparams(1, "key", preset("fp8_e4m3"))


def test_modelopt_scales_and_the_engines_rules(plain, tmp_path):
    folder = add_modelopt_scales(_copy(plain, tmp_path / "ck"), [0.5, 1.0, 0.25, 2.0], [1.0, 0.75, 0.5, 1.0],
                                 algo="NVFP4")
    scheme = read_scheme(folder)
    assert (scheme.producer, scheme.algo, scheme.config_file) == ("modelopt", "NVFP4", "hf_quant_config.json")
    assert load_checkpoint_scales(folder).tensors["key.scale"][:, 0].tolist() == [0.5, 1.0, 0.25, 2.0]
    # SGLang on SM100 multiplies a loaded NVFP4 scale other than 1.0 by 6 (load_scales_from_model)
    sm100 = load_checkpoint_scales(target_of(folder, "sglang_sm100"))
    assert sm100.tensors["key.scale"][:, 0].tolist() == [3.0, 1.0, 1.5, 12.0]
    assert sm100.tensors["value.scale"][:, 0].tolist() == [1.0, 4.5, 3.0, 1.0]
    int8 = add_modelopt_scales(_copy(plain, tmp_path / "i8"), [0.5, 1.0, 0.25, 2.0], [1.0, 0.75, 0.5, 1.0],
                               algo="INT8")
    trt = load_checkpoint_scales(target_of(int8, "trtllm"))  # one factor per layer for K and V: the larger
    assert trt.tensors["key.scale"][:, 0].tolist() == trt.tensors["value.scale"][:, 0].tolist() == [1.0, 1.0, 0.5,
                                                                                                       2.0]
    assert load_scales(target_of(int8, "trtllm")).tensors["key.scale"][:, 0].tolist() == [1.0, 1.0, 0.5, 2.0]


def test_a_folder_without_a_kv_scheme_gives_the_engines_default(plain):
    assert read_scheme(plain) is None
    cs = load_checkpoint_scales(plain)
    assert cs.scheme is None and bool((cs.tensors["key.scale"] == 1).all())
    assert "no KV scheme" in cs.describe()


def test_which_policies_take_checkpoint_scales_by_default():
    assert default_engine("vllm_fp8") == "vllm" and default_engine({"preset": "vllm_fp8", "residual": 0}) == "vllm"
    assert default_engine({"preset": "vllm_fp8", "scales": "auto"}) is None  # its own scales win
    assert default_engine({"preset": "trtllm_int8"}) == "trtllm"
    assert default_engine({"spec": "fp8_e4m3_head", "scales": "checkpoint"}) == "vllm"
    assert default_engine("int8") is None and default_engine({"spec": "fp8_e4m3"}) is None
    for name in PRESET_ENGINES:
        from kveval.policy import KVPolicy

        KVPolicy.preset(name)  # every preset of the table exists


def test_vllm_fp8_runs_on_the_checkpoint_scales(plain, tmp_path):
    """The acceptance of #29 on a tiny model: vllm_fp8 on a compressed-tensors folder equals vllm_fp8 with the same
    scales as a kveval scales file, to the bit; a folder of 1.0 scales equals vllm_fp8 without checkpoint scales;
    a bad scale (values scaled into the E4M3 subnormals) costs KLD."""
    ck = add_compressed_tensors_scales(_copy(plain, tmp_path / "ck"), K, V)
    ones = add_compressed_tensors_scales(_copy(plain, tmp_path / "ones"), [1.0] * 4, [1.0] * 4)
    bad = add_compressed_tensors_scales(_copy(plain, tmp_path / "bad"), K, [64.0] * 4)  # values / 64: subnormals
    file = kveval_scales_file(tmp_path / "s.safetensors", str(plain), K, V)
    on_ckpt = _run(tmp_path, "ck", str(ck), ["vllm_fp8"])["policies"]["vllm_fp8"]
    as_file = _run(tmp_path, "file", str(plain), [{"vllm_fp8": {"preset": "vllm_fp8", "scales": str(file)}},
                                                 {"unit": "vllm_fp8"}])["policies"]
    assert on_ckpt["kld_mean"] == as_file["vllm_fp8"]["kld_mean"] and on_ckpt["ppl"] == as_file["vllm_fp8"]["ppl"]
    assert on_ckpt["kld_mean"] != as_file["unit"]["kld_mean"]  # the scales did change the cache
    on_ones = _run(tmp_path, "ones", str(ones), ["vllm_fp8"])["policies"]["vllm_fp8"]
    assert on_ones["kld_mean"] == as_file["unit"]["kld_mean"] and on_ones["ppl"] == as_file["unit"]["ppl"]
    on_bad = _run(tmp_path, "bad", str(bad), ["vllm_fp8"])["policies"]["vllm_fp8"]
    assert on_bad["kld_mean"] > 2 * on_ckpt["kld_mean"]
    env = json.loads((tmp_path / "runs" / "ck" / "env.json").read_text())
    assert env["scales"]["vllm_fp8"]["kind"] == "checkpoint"
    assert "compressed-tensors FP8 KV scales per tensor" in env["scales"]["vllm_fp8"]["describe"]
    assert "Static scales of vllm_fp8: " in (tmp_path / "runs" / "ck" / "report.md").read_text()
    env_unit = json.loads((tmp_path / "runs" / "file" / "env.json").read_text())["scales"]
    assert env_unit["unit"]["kind"] == "preset" and "declares no KV cache scheme" in env_unit["unit"]["describe"]


def test_per_head_scales_under_vllm_fp8_per_head(plain, tmp_path):
    heads = [[0.0625, 0.125], [0.09375, 0.0625], [0.125, 0.1875], [0.25, 0.125]]
    ck = add_compressed_tensors_scales(_copy(plain, tmp_path / "ck"), heads, heads, strategy="attn_head")
    file = kveval_scales_file(tmp_path / "s.safetensors", str(plain), heads, heads)
    on_ckpt = _run(tmp_path, "ck", str(ck), ["vllm_fp8_per_head"])["policies"]["vllm_fp8_per_head"]
    as_file = _run(tmp_path, "f", str(plain), [{"p": {"preset": "vllm_fp8_per_head", "scales": str(file)}}])
    assert on_ckpt["kld_mean"] == as_file["policies"]["p"]["kld_mean"]


def test_scales_dir_names_a_checkpoint_anywhere(plain, tmp_path):
    """``scales: DIR`` reads a model folder's KV scales for any policy (here on the plain folder's own weights)."""
    ck = add_compressed_tensors_scales(_copy(plain, tmp_path / "ck"), K, V)
    file = kveval_scales_file(tmp_path / "s.safetensors", str(plain), K, V)
    met = _run(tmp_path, "d", str(plain), [{"dir": {"spec": "fp8_e4m3", "scales": str(ck)}},
                                          {"file": {"spec": "fp8_e4m3", "scales": str(file)}}])["policies"]
    assert met["dir"]["kld_mean"] == met["file"]["kld_mean"]


def test_a_resume_on_a_folder_whose_scales_changed_is_refused(plain, tmp_path):
    ck = _copy(plain, tmp_path / "ck")
    _run(tmp_path, "r", str(ck), ["vllm_fp8"], tokens=96)  # no KV scheme yet: scale 1.0
    add_compressed_tensors_scales(ck, K, V)
    with pytest.raises(KvevalError, match="changed since this run's records were written"):
        _run(tmp_path, "r", str(ck), ["vllm_fp8"], tokens=96)


@pytest.mark.integration
def test_builtin_model_checkpoint_scales(builtin_model, tmp_path):
    """The acceptance of #29 on SmolLM2-135M: a compressed-tensors folder built from the builtin model with chosen
    per-layer scales (bf16 of absmax / 448 of each layer's keys and values on the first 256 corpus tokens)."""
    from kveval.calibration.collect import collect_kv
    from kveval.data import load_tokens

    model, tok = builtin_model
    plain = save_model_folder(model, tok, tmp_path / "plain")
    with torch.no_grad(), collect_kv(model) as kv:
        model(load_tokens("builtin", tok, max_tokens=256)[None])
    layers = model.config.num_hidden_layers

    def chosen(kind):
        return [float(torch.tensor(kv.samples(i)[kind].abs().max().item() / 448, dtype=torch.bfloat16))
                for i in range(layers)]

    k, v = chosen("key"), chosen("value")
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    ck = add_compressed_tensors_scales(_copy(plain, tmp_path / "ck"), k, v)
    ones = add_compressed_tensors_scales(_copy(plain, tmp_path / "ones"), [1.0] * layers, [1.0] * layers)
    bad = add_compressed_tensors_scales(_copy(plain, tmp_path / "bad"), [x / 16 for x in k], v)
    file = kveval_scales_file(tmp_path / "s.safetensors", str(plain), k, v, heads=heads, dim=dim)
    on_ckpt = _run(tmp_path, "ck", str(ck), ["vllm_fp8"], tokens=256)["policies"]["vllm_fp8"]
    ref = _run(tmp_path, "file", str(plain), [{"file": {"preset": "vllm_fp8", "scales": str(file)}},
                                             {"unit": "vllm_fp8"}], tokens=256)["policies"]
    assert on_ckpt["kld_mean"] == ref["file"]["kld_mean"]
    assert _run(tmp_path, "ones", str(ones), ["vllm_fp8"], tokens=256)["policies"]["vllm_fp8"]["kld_mean"] == \
        ref["unit"]["kld_mean"]
    on_bad = _run(tmp_path, "bad", str(bad), ["vllm_fp8"], tokens=256)["policies"]["vllm_fp8"]
    assert on_bad["kld_mean"] > 1.5 * on_ckpt["kld_mean"], (on_bad["kld_mean"], on_ckpt["kld_mean"])
