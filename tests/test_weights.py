"""Quantized weights beside a quantized KV cache (model.weights): the maths against hand-computed references, the
plumbing on tiny models (exact restore, none/none = the plain model), the interaction fields on crafted numbers,
the weight bytes in the capacity figures, bad input (one line, exit 2) and resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.errors import KvevalError
from kveval.memory import Arch
from kveval.memory.rows import policy_memory_fields
from kveval.models import build_tiny_model, byte_tokenizer
from kveval.patch import emulate
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec, fake_quantize, preset
from kveval.results import BASELINE
from kveval.tasks.perplexity.task import Params, aggregate
from kveval.weights import (
    WeightVariant,
    WindowSums,
    check_matrix,
    fake_quantize_weight,
    interaction_fields,
    matrix_nbytes,
    parse_variants,
)
from kveval.weights.apply import prepare

INT4_TOKEN_SYM = QuantSpec(format="int", bits=4, mapping="symmetric", granularity="token")


# ------------------------------------------------------------------------------------------- the maths by hand


def test_per_output_channel_by_hand():
    # rows are output channels: absmax 7 -> s = 7/7 = 1, absmax 14 -> s = 2 (both exact in fp16);
    # codes round(x / s), half to even: [7, -3.4, 2.5, 0.2] -> [7, -3, 2, 0]; [14, 3, -5, 1] / 2 -> [7, 2, -2, 0]
    w = torch.tensor([[7.0, -3.4, 2.5, 0.2], [14.0, 3.0, -5.0, 1.0]])
    got = fake_quantize_weight(w, INT4_TOKEN_SYM)
    assert got.tolist() == [[7.0, -3.0, 2.0, 0.0], [14.0, 4.0, -4.0, 0.0]]
    assert torch.equal(got, fake_quantize(w[None, None], INT4_TOKEN_SYM)[0, 0])  # the core, layout [1, 1, out, in]
    assert w.tolist()[0][1] == pytest.approx(-3.4)  # the input is not modified


def test_groups_along_the_input_dimension_by_hand():
    # int4 asymmetric, groups of 4 consecutive inputs of each row, float zero point m = min, s = (max - min) / 15:
    # [-5, 0, 2.5, 10]: m = -5, s = 1, codes [0, 5, 7.5 -> 8, 15] -> [-5, 0, 3, 10];
    # [0, 1, 2, 30]: m = 0, s = 2, x / s = [0, 0.5 -> 0, 1, 15] -> [0, 0, 2, 30];
    # [0, 15, 7.5, 3]: m = 0, s = 1 -> [0, 15, 8, 3]; [-3, 0, 0, 12]: m = -3, s = 1 -> itself
    spec = QuantSpec(format="int", bits=4, mapping="asymmetric", granularity="group", group_size=4)
    w = torch.tensor([[-5.0, 0, 2.5, 10, 0, 1, 2, 30], [0, 15, 7.5, 3, -3, 0, 0, 12]])
    assert fake_quantize_weight(w, spec).tolist() == [[-5, 0, 3, 10, 0, 0, 2, 30], [0, 15, 8, 3, -3, 0, 0, 12]]


def test_ggml_q4_0_blocks_are_weight_rows_by_hand():
    # q4_0: blocks of 32 inputs; d = (the value of largest magnitude) / -8, q = trunc(x / d + 8.5) clamped to 15,
    # x^ = (q - 8) d. Row 0: d = -8 / -8 = 1: -8 -> 0 -> -8; 1 -> 9 -> 1; 2.5 -> 11 -> 3; 3.6 -> 12 -> 4;
    # -0.4 -> 8 -> 0; 7 -> 15 -> 7. Row 1 = 2 * row 0: d = 2, the same codes.
    row = torch.tensor([-8.0, 1.0, 2.5, 3.6, -0.4, 7.0] + [0.0] * 26)
    got = fake_quantize_weight(torch.stack([row, 2 * row]), preset("q4_0"))
    assert got[:, :6].tolist() == [[-8, 1, 3, 4, 0, 7], [-16, 2, 6, 8, 0, 14]]
    assert got[:, 6:].abs().sum() == 0


def test_none_is_the_weight_itself():
    w = torch.randn(3, 8)
    assert fake_quantize_weight(w, QuantSpec(format="none")) is w


def test_matrix_bytes_by_hand():
    # int4 g64 asymmetric (fp16 scale + min), 576 x 576: 288 B of codes per row, 9 groups x 4 B per row
    assert matrix_nbytes(preset("int4_g64"), 576, 576) == {"codes": 576 * 288, "scales": 576 * 9 * 4,
                                                          "total": 576 * 288 + 576 * 36}
    # int8 per output channel: 1 B per weight + one fp16 scale per row
    spec = parse_variants("int8_channel")["int8_channel"].spec
    assert matrix_nbytes(spec, 192, 576) == {"codes": 192 * 576, "scales": 192 * 2, "total": 192 * 578}
    # q4_0: 18 B per block of 32 (16 B of nibbles + a fp16 d)
    assert matrix_nbytes(preset("q4_0"), 10, 64)["total"] == 10 * 2 * 18


def test_capacity_counts_quantized_weight_bytes():
    # one layer, one KV head, head_dim 4: an FP16 cache of 10 tokens is 2 * 10 * 4 * 2 = 160 B per sequence
    arch = Arch(layers=1, kv_heads=1, head_dim=4, params=1000)
    assert arch.model_bytes == 2000
    quant = arch.with_quantized_weights(800, 400)  # 800 parameters stored in 400 B, 200 left in FP16
    assert quant.model_bytes == 200 * 2 + 400 and quant.to_dict()["weight_bytes"] == 800
    assert "weight_bytes" not in arch.to_dict()
    assert policy_memory_fields(arch, "fp16", 10, 4000)["max_batch"] == (4000 - 2000) // 160 == 12
    assert policy_memory_fields(quant, "fp16", 10, 4000)["max_batch"] == (4000 - 800) // 160 == 20
    with pytest.raises(KvevalError):
        arch.with_quantized_weights(1001, 10)


# ------------------------------------------------------------------------------------------- on a tiny model


def _ids(n: int = 40) -> torch.Tensor:
    return torch.arange(n).remainder(200).add(4)[None]


def test_applied_weights_are_the_cores_numbers_and_are_restored(tiny_llama):
    model, _ = tiny_llama
    variant = parse_variants(["int8_channel"])["int8_channel"]
    prepared = prepare(model, variant)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data_ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    q = model.model.layers[1].self_attn.q_proj.weight
    want = fake_quantize(before["model.layers.1.self_attn.q_proj.weight"][None, None], variant.spec)[0, 0]
    with prepared.applied(model):
        assert torch.equal(q, want)
        assert torch.equal(model.model.embed_tokens.weight, before["model.embed_tokens.weight"])  # not asked
        assert torch.equal(model.model.norm.weight, before["model.norm.weight"])
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.data_ptr() == data_ptrs[n], n  # the very same tensors back
    info = prepared.info()
    # tiny-llama: hidden 64, 4 q heads / 2 kv heads of 32: q [128, 64], k, v [64, 64], o [64, 128],
    # gate, up [128, 64], down [64, 128]: 49,152 weights per layer, 4 layers
    assert info["matrices"] == 28 and info["params_quantized"] == 4 * 49_152
    assert info["modules_quantized"] == ["attention", "mlp"]
    rows = 4 * (128 + 64 + 64 + 64 + 128 + 128 + 64)  # output channels: one fp16 scale each
    assert info["quantized_bytes"] == {"codes": 4 * 49_152, "scales": 2 * rows, "total": 4 * 49_152 + 2 * rows}


def test_none_none_equals_the_plain_model_exactly(tiny_llama):
    model, _ = tiny_llama
    ids = _ids()
    prepared = prepare(model, WeightVariant("control", QuantSpec(format="none")))
    with torch.no_grad():
        plain = model(ids).logits
        with prepared.applied(model):
            alone = model(ids).logits
            with emulate(model, KVPolicy.preset("fp16")):
                both = model(ids).logits
    assert torch.equal(alone, plain) and torch.equal(both, plain)


def test_quantized_weights_move_the_logits_and_tied_embeddings_are_said():
    model = build_tiny_model("tiny-llama", seed=1)  # ties lm_head to the input embeddings
    ids = _ids()
    prepared = prepare(model, parse_variants({"w": {"spec": "int4_g32", "modules": ["lm_head"]}})["w"])
    emb = model.model.embed_tokens.weight
    original = emb.detach().clone()
    with torch.no_grad():
        plain = model(ids).logits
        with prepared.applied(model):
            assert model.lm_head.weight is emb  # one tensor, quantized once
            assert torch.equal(emb, fake_quantize_weight(original, preset("int4_g32")))
            moved = model(ids).logits
    assert torch.equal(emb, original)
    assert (moved - plain).abs().max() > 1e-4
    info = prepared.info()
    assert info["matrices"] == 1 and info["params_quantized"] == 260 * 64
    assert info["modules_quantized"] == ["lm_head", "embeddings"] and "tied" in info["notes"][0]


# ------------------------------------------------------------------------------------------- the interaction


def test_interaction_fields_on_crafted_numbers():
    # the module docstring's worked example: two windows of 10 tokens
    ref = WindowSums([10, 10], [10, 10], [0, 0])
    kv = WindowSums([10, 10], [11, 10], [0.1, 0.1])
    w = WindowSums([10, 10], [10, 12], [0.2, 0.2])
    both = WindowSums([10, 10], [12, 13], [0.5, 0.5])
    f = interaction_fields(ref, kv, w, both, n_resamples=0)
    d_kv, d_w, d_c = (100 * (math.exp(x) - 1) for x in (0.05, 0.1, 0.25))  # PPL_X / PPL_R = e^(ΔNLL mean)
    assert f["kv_delta_ppl_pct"] == pytest.approx(d_kv) and f["weights_delta_ppl_pct"] == pytest.approx(d_w)
    assert f["delta_ppl_pct_sum"] == pytest.approx(d_kv + d_w)
    assert f["delta_ppl_pct_excess"] == pytest.approx(d_c - d_kv - d_w) == pytest.approx(12.7583, abs=1e-4)
    assert (f["kv_kld_mean"], f["weights_kld_mean"], f["kld_sum"]) == pytest.approx((0.01, 0.02, 0.03))
    assert f["kld_excess"] == pytest.approx(0.02)
    assert f["kld_worse_than_sum"] is True and f["delta_ppl_worse_than_sum"] is True
    assert f["kld_excess_ci95"] == [f["kld_excess"]] * 2  # no resampling: the point twice
    assert f["kld_interaction"] == "superadditive"  # an interval [0.02, 0.02] lies above 0
    # less than the sum: the combination's KLD is 0.02 < 0.03
    better = interaction_fields(ref, kv, w, WindowSums([10, 10], [10, 11], [0.2, 0.2]), n_resamples=0)
    assert better["kld_excess"] == pytest.approx(-0.01) and better["kld_worse_than_sum"] is False
    assert better["kld_interaction"] == "subadditive"
    with pytest.raises(ValueError, match="other windows"):
        interaction_fields(ref, kv, w, WindowSums([10], [12], [0.5]))


def test_interaction_interval_by_resampling():
    # window 0 superadditive (+0.1 nats/token of KLD), window 1 subadditive (-0.1): the excess over both is 0,
    # and resampling the windows gives an interval around 0 -> "additive"
    ref = WindowSums([10, 10], [10, 10], [0, 0])
    kv = WindowSums([10, 10], [10, 10], [1.0, 1.0])
    w = WindowSums([10, 10], [10, 10], [1.0, 1.0])
    both = WindowSums([10, 10], [10, 10], [3.0, 1.0])
    f = interaction_fields(ref, kv, w, both, n_resamples=2000, seed=0)
    assert f["kld_excess"] == pytest.approx(0.0, abs=1e-12)
    lo, hi = f["kld_excess_ci95"]
    assert lo == pytest.approx(-0.1) and hi == pytest.approx(0.1)  # all windows 1, or all windows 0
    assert f["kld_interaction"] == "additive"


def _rec(window, policy, nll, kld, n=10, weights=None, **extra):
    rec = {"key": f"k/{window}/{weights}/{policy}", "task": "perplexity", "window": window, "policy": policy,
           "start": 0, "n_tokens": n, "nll_sum": nll, "kld_sum": kld, "agree_sum": n * 0.9,
           "bin_nll": [nll], "bin_kld": [kld], "bin_count": [n]}
    if weights is not None:
        rec["weights"] = weights
    rec.update(extra)
    return rec


def test_perplexity_aggregate_puts_the_interaction_in_metrics():
    """The records of the four models (crafted sums) give the metrics' weights section by hand."""
    records = []
    for i in (0, 1):
        records += [_rec(i, BASELINE, 10.0, 0.0), _rec(i, "int8", 11.0 - i, 0.1),
                    _rec(i, BASELINE, 10.0 + 2 * i, 0.2, weights="w4"),
                    _rec(i, "int8", 12.0 + i, 0.5, weights="w4", kld_vs_weights_sum=0.25, agree_vs_weights_sum=9.5)]
    params = Params(seq_len=16, position_bins=1, bootstrap=0, diagnostics=False)
    thr = validate({"name": "t", "kv": ["int8"], "tasks": ["perplexity"]}).threshold
    m = aggregate(records, ["int8"], params, seed=0, threshold=thr, weights=["w4"])
    assert m[BASELINE]["ppl"] == pytest.approx(math.e)
    v = m["weights"]["variants"]["w4"]
    assert v["alone"]["ppl"] == pytest.approx(math.exp(1.1)) and v["alone"]["kld_mean"] == pytest.approx(0.02)
    both = v["policies"]["int8"]
    assert both["ppl"] == pytest.approx(math.exp(1.25)) and both["kld_mean"] == pytest.approx(0.05)
    assert both["kv_kld_mean"] == pytest.approx(0.01) and both["weights_kld_mean"] == pytest.approx(0.02)
    assert both["kld_excess"] == pytest.approx(0.02) and both["delta_ppl_pct_excess"] == pytest.approx(12.7583, abs=1e-4)
    assert both["kv_on_weights_kld_mean"] == pytest.approx(0.025) and both["kv_on_weights_top1_agree"] == 0.95
    assert both["kv_on_weights_delta_ppl_pct"] == pytest.approx(100 * (math.exp(0.15) - 1))
    assert both["kv_delta_ppl_pct"] == pytest.approx(m["policies"]["int8"]["delta_ppl_pct"])  # the same records
    assert m["policies"]["int8"]["kld_mean"] == pytest.approx(0.01)  # variant records never mix into the policies


# ------------------------------------------------------------------------------------------- runs, bad input


def tiny_config(out: Path, weights, **extra) -> dict:
    return {"name": "tw", "model": {"name": "builtin:tiny-llama", "weights": weights}, "data": "builtin",
            "kv": ["int8", "int2_g32"], "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 256,
                                                                   "bootstrap": 100}}],
            "output": str(out), **extra}


def write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def _one_line_exit_2(result, *needles):
    """Exit status 2 and one error line on stderr (transformers' own "Loading weights" bar aside: these errors
    need the loaded model, and its loader draws a progress bar on stderr before kveval says anything)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines()
             if line.strip() and not line.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_resumed_run_gives_the_same_metrics(tmp_path):
    weights = ["int8_channel", {"w4": "int4_g32"}]
    full = run_experiment(validate(tiny_config(tmp_path / "full", weights)), quiet=True)
    lines = (tmp_path / "full" / "records.jsonl").read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]
    assert len(keys) == len(set(keys)) == 5 * 3 * 3  # 5 windows x (baseline + 2 policies) x (fp + 2 variants)
    assert "perplexity/w0/weights/w4/int8" in keys and "perplexity/w0/int8" in keys
    # an interrupted run: half of the records, no metrics; the rerun computes the rest
    out = tmp_path / "cut"
    run_experiment(validate(tiny_config(out, weights)), quiet=True)
    (out / "records.jsonl").write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    (out / "metrics.json").unlink()
    resumed = run_experiment(validate(tiny_config(out, weights)), quiet=True)
    assert json.loads(json.dumps(resumed)) == json.loads(json.dumps(full))
    on_disk = json.loads((out / "metrics.json").read_text())
    v = on_disk["weights"]["variants"]["w4"]
    assert v["info"]["spec"]["group_size"] == 32 and v["info"]["params_quantized"] == 4 * 49_152
    assert v["weight_bytes"] < v["weight_bytes_fp16"]
    assert v["policies"]["int8"]["max_batch"] >= on_disk["policies"]["int8"]["max_batch"]
    env = json.loads((out / "env.json").read_text())
    assert env["weights"]["variants"]["int8_channel"]["modules"] == ["attention", "mlp"]
    assert (out / "tables" / "weights_x_kv.csv").is_file() and (out / "plots" / "weights_x_kv.png").is_file()


def test_bad_input_unknown_weight_spec(tmp_path):
    path = write(tmp_path / "c.yaml", tiny_config(tmp_path / "x", ["int4_g46"]))
    _one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "model.weights", "int4_g46",
                     "did you mean 'int4_g64'")


def test_bad_input_group_size_does_not_divide_in_features(tmp_path):
    out = tmp_path / "x"
    path = write(tmp_path / "c.yaml", tiny_config(out, ["int4_g128"]))
    for verb in ("validate", "run"):  # known without loading the model: refused by both, before any write
        _one_line_exit_2(CliRunner().invoke(app, [verb, str(path)]), "model.weights.int4_g128",
                         "group_size 128 does not divide in_features 64")
    assert not out.exists(), "refused before anything is written"


def test_loaded_matrices_are_checked_too():
    """What validate cannot know (a hub model, a GGUF file), the run checks on the loaded matrices: each one,
    named, with the group sizes that would fit."""
    model = build_tiny_model("tiny-gemma3")
    with pytest.raises(KvevalError) as info:
        prepare(model, parse_variants("int4_g128")["int4_g128"])
    assert str(info.value) == ("model.weights.int4_g128: group_size 128 does not divide in_features 64 of "
                               "model.layers.0.self_attn.q_proj.weight [128 x 64]; group sizes that divide every "
                               "matrix here: 64, 32, 16")
    with pytest.raises(ValueError, match="group_size 32 does not divide in_features 48"):
        check_matrix(preset("q4_0"), 48)  # ggml blocks of 32 inputs


def test_bad_input_weights_on_a_model_without_linear_layers(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2-tiny"
    cfg = GPT2Config(vocab_size=260, n_embd=64, n_layer=2, n_head=2, n_positions=256, bos_token_id=1,
                     eos_token_id=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    raw = tiny_config(tmp_path / "x", ["int8_channel"])
    raw["model"]["name"] = str(folder)
    _one_line_exit_2(CliRunner().invoke(app, ["run", str(write(tmp_path / "c.yaml", raw))]),
                     "model.weights.int8_channel", "Conv1D", "torch.nn.Linear")
    assert not (tmp_path / "x").exists()


def test_bad_input_weights_with_another_task(tmp_path):
    raw = tiny_config(tmp_path / "x", ["int8_channel"])
    raw["tasks"].append("needle_quick")
    _one_line_exit_2(CliRunner().invoke(app, ["validate", str(write(tmp_path / "c.yaml", raw))]),
                     "perplexity task only", "needle")


def test_config_forms_and_resolved():
    base = {"name": "t", "kv": ["int8"], "tasks": ["perplexity"]}
    assert "weights" not in validate(base).resolved()["model"]  # runs from before weights existed resume
    assert "weights" not in validate({**base, "model": {"weights": "none"}}).resolved()["model"]
    cfg = validate({**base, "model": {"weights": ["int8_channel", {"w4": {"spec": "int4_g64", "modules": "mlp"}}]}})
    resolved = cfg.resolved()["model"]["weights"]
    assert list(resolved) == ["int8_channel", "w4"] and resolved["w4"]["modules"] == ["mlp"]
    assert resolved["w4"]["spec"] == preset("int4_g64").to_dict()
    again = validate({**base, "model": {"weights": resolved}})  # the resolved form reads back as itself
    assert again.resolved()["model"]["weights"] == resolved
    over = validate({**base, "model": "builtin:tiny-llama"}, overrides=["model.weights=q4_0"])
    assert over.model.weight_variants()["q4_0"].spec == preset("q4_0")
    for bad, needle in (({"fp": "int8"}, "reserved"), ({"w": {"spec": "int8", "modules": ["mpl"]}}, "'mlp'"),
                        ({"w": "int4_channel", "v": {"preset": "int4_g64", "granularity": "channel"}},
                         "K/V-cache granularity")):
        with pytest.raises(KvevalError, match=needle):
            validate({**base, "model": {"weights": bad}}, "c.yaml")


@pytest.mark.integration
def test_q4_1_on_the_builtin_checkpoint_gives_its_weights_back(builtin_model):
    """The builtin checkpoint is a Q4_1 GGUF, dequantized: kveval's q4_1 on its weight rows (blocks of 32 inputs
    of each output channel: the layout of ``kveval.weights.quantize``) finds the file's blocks and returns every
    matrix bit for bit, stored in 5 bits per weight (16 B of nibbles + fp16 d and m per 32), as the file does."""
    model, _ = builtin_model
    prepared = prepare(model, parse_variants("q4_1")["q4_1"])
    assert len(prepared.targets) == 30 * 7 and prepared.params_quantized == 106_168_320
    for t in prepared.targets:
        assert torch.equal(fake_quantize_weight(t.param.data, preset("q4_1")), t.param.data), t.name
    assert prepared.info()["bits_per_weight"] == 5.0
