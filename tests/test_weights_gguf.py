"""GGUF weight variants (model.weights: {NAME: {gguf: FILE}}): a tiny Llama written in code to an HF folder and to
GGUF files whose matrices gguf-py quantizes; the variant's parameters against gguf-py's own dequantization of the
file (llama.cpp's Q/K row order undone here, independently of transformers) and against kveval's bit-exact ggml
formats, the logits of a run against kveval's q8_0 variant, what env.json and metrics.json say of the file, and
bad input (one line, exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import yaml
from gguf.quants import dequantize
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.errors import KvevalError
from kveval.gguf import add_llama_metadata, unpermute_rows, write_llama_gguf
from kveval.models import build_tiny_model, byte_tokenizer, load_model, tiny_model_config
from kveval.patch import emulate
from kveval.policy import KVPolicy
from kveval.quant import preset
from kveval.weights import fake_quantize_weight, parse_variants
from kveval.weights.apply import prepare
from kveval.weights.spec import check_variant_files

Q = gguf.GGMLQuantizationType
#: llama.cpp's tensor names of one block's HF parameters
BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
MIXED = {"attention": Q.Q4_0, "mlp": Q.Q5_1, "embeddings": Q.Q8_0}
ALL_Q8 = {"attention": Q.Q8_0, "mlp": Q.Q8_0, "embeddings": Q.Q8_0}
TINY_PARAMS = 213_824  # tiny-llama: 4 x (49,152 matrix + 128 norm) weights, 260 x 64 embeddings (tied), 64 norm


def write_gguf(path: Path, model, types: dict | None) -> Path:
    """``model`` (a tiny Llama, tied embeddings) as a GGUF file by kveval's writer (:func:`kveval.gguf.write_llama_gguf`:
    llama.cpp's names, q/k rows in llama.cpp's order), its matrices quantized by gguf-py to ``types``
    (``{group: GGMLQuantizationType}``; None: every tensor F32), norms F32, the byte tokenizer as a gpt2
    vocabulary."""
    cfg = model.config

    def metadata(w) -> None:
        vocab = byte_tokenizer().get_vocab()
        w.add_name("tiny")
        add_llama_metadata(w, cfg, [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])],
                           token_types=[3] * 4 + [1] * 256, merges=[], add_bos=None,
                           special_ids={"bos": 1, "eos": 2, "pad": 0, "unk": 3},
                           file_type=gguf.LlamaFileType.MOSTLY_Q8_0 if types else gguf.LlamaFileType.ALL_F32)
        w.add_token_scores([0.0] * len(vocab))

    def tensor_type(name: str, group: str):
        return None if group == "other" else (types or {}).get(group)

    write_llama_gguf(path, model.state_dict(), cfg, metadata=metadata, tensor_type=tensor_type)
    return path


def file_tensors(path: Path, n_head: int, n_kv: int) -> dict[str, torch.Tensor]:
    """``{HF parameter name: tensor}``: gguf-py's dequantization of every tensor of the file, q/k rows put back in
    HF's order by :func:`kveval.gguf.unpermute_rows` (the reference, independent of transformers' loader)."""
    hf = {v: k for k, v in BLOCK.items()}
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        a = dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape.tolist())])
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            name = f"model.layers.{parts[1]}.{hf[parts[2]]}.weight"
            if parts[2] == "attn_q":
                a = unpermute_rows(a, n_head)
            elif parts[2] == "attn_k":
                a = unpermute_rows(a, n_kv)
        out[name] = torch.from_numpy(np.array(a, dtype=np.float32))
    return out


def tiny_with(**changes):
    """A tiny Llama (seed 0) whose config differs from tiny-llama's by ``changes``."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_model_config("tiny-llama")
    for k, v in changes.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The HF folder of tiny-llama (seed 0) and its GGUF files (mixed, all Q8_0, F32, another MLP width, other
    head counts), with the kveval cache in a temporary folder and every file converted once (later loads are
    quiet, so that a refusal is the only line on stderr)."""
    root = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVEVAL_CACHE", str(root / "cache"))
        model = build_tiny_model("tiny-llama", seed=0)
        folder = root / "tiny-hf"
        model.save_pretrained(folder, safe_serialization=True)
        byte_tokenizer().save_pretrained(folder)
        out = {"model": model, "folder": folder,
               "mixed": write_gguf(root / "tiny.mixed.gguf", model, MIXED),
               "q8_0": write_gguf(root / "tiny.Q8_0.gguf", model, ALL_Q8),
               "f32": write_gguf(root / "tiny.F32.gguf", model, None),
               "wider": write_gguf(root / "wider.Q8_0.gguf", tiny_with(intermediate_size=96), ALL_Q8),
               "heads": write_gguf(root / "heads.Q8_0.gguf",
                                   tiny_with(num_attention_heads=8, num_key_value_heads=4, head_dim=16), ALL_Q8)}
        for key in ("mixed", "q8_0", "f32", "wider", "heads"):
            load_model(str(out[key]))
        yield out


def variant(path: Path, name: str = "g", **extra):
    return parse_variants({name: {"gguf": str(path), **extra}})[name]


def _ids(n: int = 40) -> torch.Tensor:
    return torch.arange(n).remainder(200).add(4)[None]


# ------------------------------------------------------------------------------------------- the numbers


def test_variant_holds_the_files_tensors_and_kvevals_ggml_formats(files):
    """Every parameter under the variant is gguf-py's dequantization of the file's tensor (q/k rows put back), and
    is kveval's own q4_0 / q5_1 / q8_0 of the source's weights (the same formats, bit for bit); the model's
    own tensors come back on exit."""
    model = files["model"]
    prepared = prepare(model, variant(files["mixed"]))
    want = file_tensors(files["mixed"], 4, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ggml = {"self_attn": "q4_0", "mlp": "q5_1", "embed_tokens": "q8_0"}
    with prepared.applied(model):
        got = dict(model.named_parameters())
        assert sorted(want) == sorted(got)  # the tied lm_head is the embeddings' tensor
        for name, ref in want.items():
            assert torch.equal(got[name], ref), name
            kind = next((v for k, v in ggml.items() if f".{k}." in name), None)
            expected = before[name] if kind is None else fake_quantize_weight(before[name], preset(kind))
            assert torch.equal(got[name], expected), name
        assert model.lm_head.weight is model.model.embed_tokens.weight
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    info = prepared.info()
    assert info["tensor_types"] == {"attention": {"Q4_0": 16}, "mlp": {"Q5_1": 12}, "embeddings": {"Q8_0": 1},
                                    "other": {"F32": 9}}
    assert info["tensors_replaced"] == {"attention": 16, "mlp": 12, "embeddings": 1}
    assert info["tensors_identical"] == {"other": 9}  # the F32 norms are the source's
    # bytes in the file: per 32 weights Q4_0 18 B, Q5_1 24 B, Q8_0 34 B; 98,304 attention and 98,304 MLP weights,
    # 260 x 64 embeddings
    total = 98_304 // 32 * 18 + 98_304 // 32 * 24 + 16_640 // 32 * 34
    assert info["quantized_bytes"] == {"total": total} and total == 146_704
    assert info["params_quantized"] == 213_248 and info["params_total"] == TINY_PARAMS
    assert info["bits_per_weight"] == pytest.approx(8 * total / 213_248)
    assert info["modules_quantized"] == ["attention", "mlp", "lm_head", "embeddings"]
    assert info["describe"] == "GGUF tiny.mixed.gguf (Q4_0, Q5_1, Q8_0)"
    assert info["gguf"]["file"] == "tiny.mixed.gguf" and info["gguf"]["size"] == files["mixed"].stat().st_size
    assert info["gguf"]["architecture"] == "llama" and len(info["gguf"]["xxh3_128"]) == 32
    assert 0 < info["relative_error"]["attention"] < 0.2 and info["relative_error"]["other"] == 0.0


def test_q8_0_file_gives_the_logits_of_kvevals_q8_0(files):
    """A Q8_0 GGUF and kveval's q8_0 on the same source weights and modules are the same model: equal logits, with
    the full-precision cache and with an int8 cache; and the same stored bytes."""
    model = files["model"]
    from_file = prepare(model, variant(files["q8_0"]))
    own = prepare(model, parse_variants({"k": {"spec": "q8_0", "modules": ["attention", "mlp", "embeddings"]}})["k"])
    ids = _ids()
    with torch.no_grad():
        plain = model(ids).logits
        with from_file.applied(model):
            a = model(ids).logits
            with emulate(model, KVPolicy.preset("int8")):
                a_kv = model(ids).logits
        with own.applied(model):
            b = model(ids).logits
            with emulate(model, KVPolicy.preset("int8")):
                b_kv = model(ids).logits
        assert torch.equal(model(ids).logits, plain)  # restored
    assert torch.equal(a, b) and torch.equal(a_kv, b_kv)
    assert (a - plain).abs().max() > 1e-4  # the weights did change
    assert from_file.quantized_bytes()["total"] == own.quantized_bytes()["total"] == 213_248 // 32 * 34
    assert from_file.params_quantized == own.params_quantized == 213_248


def test_f32_file_is_the_source_itself_and_can_be_the_source(files):
    """An F32 GGUF of the source (the file's 'none' quantization) replaces nothing: every tensor equals the
    source's after the round trip through llama.cpp's row order, and the logits are the plain model's. An F32
    GGUF is also a source: a Q8_0 variant on it holds the same tensors as on the HF folder."""
    model = files["model"]
    prepared = prepare(model, variant(files["f32"]))
    info = prepared.info()
    assert prepared.swaps == [] and info["tensors_replaced"] == {}
    assert info["tensors_identical"] == {"attention": 16, "mlp": 12, "embeddings": 1, "other": 9}
    assert info["params_quantized"] == 0 and info["bits_per_weight"] is None and info["modules_quantized"] == []
    ids = _ids()
    with torch.no_grad():
        plain = model(ids).logits
        with prepared.applied(model):
            assert torch.equal(model(ids).logits, plain)
    source, _ = load_model(str(files["f32"]))
    on_gguf, on_hf = prepare(source, variant(files["q8_0"])), prepare(model, variant(files["q8_0"]))
    assert [n for n, *_ in on_gguf.swaps] == [n for n, *_ in on_hf.swaps]
    for (_, _, _, x), (_, _, _, y) in zip(on_gguf.swaps, on_hf.swaps, strict=True):
        assert torch.equal(x, y)


def test_modules_restrict_the_tensors_taken(files):
    model = files["model"]
    prepared = prepare(model, variant(files["mixed"], modules=["mlp"]))
    want = file_tensors(files["mixed"], 4, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with prepared.applied(model):
        for n, p in model.named_parameters():
            assert torch.equal(p, want[n] if ".mlp." in n else before[n]), n
    info = prepared.info()
    assert info["tensors_replaced"] == {"mlp": 12} and info["modules"] == ["mlp"]
    assert info["params_quantized"] == 98_304 and info["quantized_bytes"] == {"total": 98_304 // 32 * 24}
    assert info["tensor_types"]["attention"] == {"Q4_0": 16}  # what the file holds, covered or not
    assert info["modules_quantized"] == ["mlp"]


# ------------------------------------------------------------------------------------------- a run


def run_config(out: Path, folder: Path, weights, **extra) -> dict:
    return {"name": "tg", "model": {"name": str(folder), "weights": weights}, "data": "builtin", "kv": ["int8"],
            "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 128, "bootstrap": 20}}], "output": str(out),
            **extra}


def test_run_with_a_gguf_variant_equals_kvevals_q8_0_and_names_the_file(files, tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVAL_CACHE", str(Path(files["q8_0"]).parent / "cache"))
    weights = {"q8": {"gguf": str(files["q8_0"])}, "k8": {"spec": "q8_0", "modules": ["attention", "mlp",
                                                                                         "embeddings"]}}
    cfg = validate(run_config(tmp_path / "r", files["folder"], weights))
    assert cfg.resolved()["model"]["weights"]["q8"] == {"gguf": str(files["q8_0"])}
    metrics = run_experiment(cfg, quiet=True)
    v = metrics["weights"]["variants"]
    q8, k8 = v["q8"], v["k8"]
    assert q8["alone"]["ppl"] == k8["alone"]["ppl"] and q8["alone"]["kld_mean"] == k8["alone"]["kld_mean"] > 0
    assert q8["policies"]["int8"]["kld_mean"] == k8["policies"]["int8"]["kld_mean"]
    assert q8["policies"]["int8"]["kld_excess"] == k8["policies"]["int8"]["kld_excess"]
    assert q8["weight_bytes"] == k8["weight_bytes"] < q8["weight_bytes_fp16"]
    for source in (json.loads((tmp_path / "r" / "metrics.json").read_text())["weights"]["variants"]["q8"]["info"],
                   json.loads((tmp_path / "r" / "env.json").read_text())["weights"]["variants"]["q8"]):
        assert source["source"] == "gguf" and source["gguf"]["file"] == "tiny.Q8_0.gguf"
        assert source["gguf"]["file_type"] == "MOSTLY_Q8_0"
        assert source["tensor_types"] == {"attention": {"Q8_0": 16}, "mlp": {"Q8_0": 12}, "embeddings": {"Q8_0": 1},
                                          "other": {"F32": 9}}
        assert source["tensors_replaced"] == {"attention": 16, "mlp": 12, "embeddings": 1}


# ------------------------------------------------------------------------------------------- bad input


def _one_line_exit_2(result, *needles):
    """Exit status 2 and one error line on stderr (transformers' "Loading weights" bar aside)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines()
             if line.strip() and not line.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _run_cli(files, tmp_path, monkeypatch, weights, verb="run"):
    monkeypatch.setenv("KVEVAL_CACHE", str(Path(files["q8_0"]).parent / "cache"))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(run_config(tmp_path / "x", files["folder"], weights)))
    return CliRunner().invoke(app, [verb, str(path)])


def test_bad_input_gguf_file_missing(files, tmp_path, monkeypatch):
    missing = tmp_path / "nowhere.Q4_K_M.gguf"
    _one_line_exit_2(_run_cli(files, tmp_path, monkeypatch, {"q4": {"gguf": str(missing)}}),
                     "model.weights.q4.gguf", "does not exist", "nowhere.Q4_K_M.gguf")
    assert not (tmp_path / "x").exists(), "refused before anything is written"
    with pytest.raises(KvevalError, match="does not exist"):  # what kveval validate can say of it
        check_variant_files(parse_variants({"q4": {"gguf": str(missing)}}))
    _one_line_exit_2(_run_cli(files, tmp_path, monkeypatch, {"q4": {"gguf": str(missing)}}, verb="validate"),
                     "model.weights.q4.gguf", "does not exist")


def test_bad_input_not_a_gguf_file(files, tmp_path, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(60))
    _one_line_exit_2(_run_cli(files, tmp_path, monkeypatch, {"q4": {"gguf": str(fake)}}),
                     "model.weights.q4.gguf", "is not a GGUF file")
    assert not (tmp_path / "x").exists()
    cut = tmp_path / "cut.gguf"  # the magic, then the file cut short: the gguf package cannot parse it
    cut.write_bytes(files["q8_0"].read_bytes()[:300])
    with pytest.raises(KvevalError) as info:
        prepare(files["model"], variant(cut, "c"))
    assert str(info.value).startswith(f"model.weights.c: '{cut}' is not a GGUF file the gguf package can read (")
    assert "\n" not in str(info.value)


def test_bad_input_gguf_of_other_shapes(files, tmp_path, monkeypatch):
    _one_line_exit_2(_run_cli(files, tmp_path, monkeypatch, {"w": {"gguf": str(files["wider"])}}),
                     "model.weights.w: the GGUF file does not fit the source model: the file's "
                     "model.layers.0.mlp.gate_proj.weight is [96 x 64], the source's [128 x 64]")
    assert not (tmp_path / "x").exists()


def test_bad_input_gguf_of_other_head_counts_or_architecture(files):
    """The same shapes with 8 heads of 16 instead of 4 of 32 would put llama.cpp's Q/K rows back in the wrong
    order: refused; a Gemma3 source lacks nothing a Llama file has but has its own q/k norms: refused, naming the
    first and the two architectures."""
    with pytest.raises(KvevalError) as info:
        prepare(files["model"], variant(files["heads"], "h"))
    assert str(info.value) == ("model.weights.h: the GGUF file does not fit the source model: the file has "
                               "num_attention_heads 8, the source 4; give a GGUF file of the source model")
    with pytest.raises(KvevalError) as info:
        prepare(build_tiny_model("tiny-gemma3"), variant(files["q8_0"], "g"))
    assert str(info.value) == ("model.weights.g: the GGUF file does not fit the source model: the source's "
                               "model.layers.0.self_attn.q_norm.weight [32] is not in the file (the file is a llama "
                               "model, the source gemma3_text); give a GGUF file of the source model")


def test_bad_input_gguf_with_spec(files, tmp_path, monkeypatch):
    result = _run_cli(files, tmp_path, monkeypatch, {"q4": {"gguf": str(files["q8_0"]), "spec": "q4_0"}},
                      verb="validate")
    _one_line_exit_2(result, "model.weights.q4: give spec", "or gguf", "not both")
    for bad, needle in (({"gguf": str(files["q8_0"]), "modulse": ["mlp"]}, "did you mean 'modules'"),
                        ({"gguf": 3}, "expected the path of a .gguf file"),
                        ({"gguf": str(files["q8_0"]), "modules": ["mpl"]}, "did you mean 'mlp'")):
        with pytest.raises(KvevalError, match=needle):
            parse_variants({"v": bad})


def test_a_resumed_run_whose_gguf_file_changed_is_refused(files, tmp_path, monkeypatch):
    """The records of a GGUF variant belong to its file's content: a resume after the file was replaced (same
    path, other tensors) is one line, exit 2, nothing lost; --overwrite starts afresh on the new file."""
    monkeypatch.setenv("KVEVAL_CACHE", str(Path(files["q8_0"]).parent / "cache"))
    gguf = tmp_path / "model.gguf"
    shutil.copyfile(files["q8_0"], gguf)
    path = tmp_path / "c.yaml"
    raw = run_config(tmp_path / "r", files["folder"], {"g": {"gguf": str(gguf)}})
    raw["tasks"][0]["perplexity"]["max_tokens"] = 64
    path.write_text(yaml.safe_dump(raw))
    first = CliRunner().invoke(app, ["run", str(path), "--quiet"])
    assert first.exit_code == 0, first.output
    records = (tmp_path / "r" / "records.jsonl").read_bytes()
    used = json.loads((tmp_path / "r" / "scales_used.json").read_text())
    assert list(used) == ["weights/g"] and len(used["weights/g"]) == 32
    assert CliRunner().invoke(app, ["run", str(path), "--quiet"]).exit_code == 0  # same file: resumes
    shutil.copyfile(files["mixed"], gguf)  # the same path, other tensors
    refused = CliRunner().invoke(app, ["run", str(path), "--quiet"])  # the new file is converted first (its bars)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.exit_code == 2 and "Traceback" not in refused.output and len(errors) == 1, refused.output
    assert "model.weights.g: its GGUF file changed since this run's records were written" in errors[0]
    assert (tmp_path / "r" / "records.jsonl").read_bytes() == records
    again = CliRunner().invoke(app, ["run", str(path), "--quiet", "--overwrite"])
    assert again.exit_code == 0, again.output
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics["weights"]["variants"]["g"]["info"]["tensor_types"]["attention"] == {"Q4_0": 16}
