"""kveval memory --gpu: the decode roofline (bytes one step reads, the bandwidth-bound tokens/s ceiling, its ratio
to FP16, the batch from which the cache outweighs the weights), against the arithmetic done by hand."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kveval.cli import app
from kveval.errors import KvevalError
from kveval.memory import Arch
from kveval.memory.roofline import GPUS, decode_roofline, parse_gpu

WEIGHTS = 8_030_261_248 * 2  # Llama-3.1-8B in bf16
FP16_SEQ_32K = 32 * 8 * 128 * 2 * 2 * 32768  # layers x kv heads x head_dim x (K, V) x 2 bytes x tokens


def test_fp16_at_32k_by_hand():
    row = decode_roofline(Arch.named("llama-3.1-8b"), "fp16", 32768, 16, "h100")
    step = WEIGHTS + 16 * FP16_SEQ_32K
    assert row["step_bytes"] == step
    assert row["tokens_per_s"] == pytest.approx(16 * 3.35e12 / step)
    assert row["speedup_vs_fp16"] == 1.0
    assert row["cache_dominates_batch"] == math.ceil(WEIGHTS / FP16_SEQ_32K) == 4
    assert row["fits"] is False  # 79 GiB of weights and caches: more than the 80 GB, activations aside


def test_int8_scales_are_read_too_and_the_gain_grows_with_the_batch():
    arch = Arch.named("llama-3.1-8b")
    int8_seq = 32 * 8 * 2 * 32768 * (128 + 2)  # int8 codes + one fp16 scale per token and head
    rows = [decode_roofline(arch, "int8", 32768, b, GPUS["h100"]) for b in (1, 16, 64)]
    assert rows[1]["step_bytes"] == WEIGHTS + 16 * int8_seq
    speedups = [r["speedup_vs_fp16"] for r in rows]
    assert 1.0 < speedups[0] < speedups[1] < speedups[2] < 2.0  # never past the 1.97x of the bytes alone
    assert speedups[2] == pytest.approx((WEIGHTS + 64 * FP16_SEQ_32K) / (WEIGHTS + 64 * int8_seq))


def test_gpus_and_bandwidths():
    assert parse_gpu("H200").bandwidth == 4.8e12 and parse_gpu("h200").memory == 141 * 10**9
    assert parse_gpu("2000GB/s").bandwidth == 2e12 and parse_gpu("2000GB/s").memory is None
    for bad in ("b200", "3.35TB", "-1TB/s", "0TB/s"):
        with pytest.raises(KvevalError, match="--gpu"):
            parse_gpu(bad)
    with pytest.raises(KvevalError, match="weight bytes"):
        decode_roofline(Arch(layers=2, kv_heads=2, head_dim=64), "int8", 1024, 1, "h100")


def test_the_command_says_it_is_a_bound_and_marks_batches_that_do_not_fit():
    result = CliRunner().invoke(app, ["memory", "--shape", "llama-3.1-8b", "--context", "32k", "--batch", "16",
                                      "--kv", "fp16,int8", "--gpu", "h100"])
    assert result.exit_code == 0, result.output
    assert "a bound, not a measurement" in result.output and "datasheet" in result.output
    fp16 = next(line for line in result.output.splitlines() if "fp16" in line and "x " in line and "GiB" in line)
    assert "(does not fit)" in fp16
    doc = json.loads(CliRunner().invoke(app, ["memory", "--shape", "llama-3.1-8b", "--gpu", "a100",
                                              "--json"]).output)
    assert doc["gpu"]["bandwidth_bytes_per_s"] == 2.039e12 and "roofline" in doc["gpu"]["model"]
    assert all("tokens_per_s" in r["decode"] for r in doc["rows"])
    assert doc["rows"][0]["max_batch"] is not None  # the named GPU's memory sizes the batch


def test_a_bad_gpu_is_one_line():
    result = CliRunner().invoke(app, ["memory", "--shape", "llama-3.1-8b", "--gpu", "b200"])
    assert result.exit_code == 2 and "h200, h100, a100, l40s, rtx4090" in result.stderr


def test_several_batches_are_each_batch_alone_side_by_side():
    """`--batch 1,16,64` (the README's line): each batch's JSON document is the one `--batch B` gives; the text has
    the totals per batch and one roofline row per batch and policy, the ratios of the single-batch tables."""
    args = ["memory", "--shape", "llama-3.1-8b", "--context", "32768", "--gpu", "h100", "--kv", "fp16,int8,int4_g64"]
    many = json.loads(CliRunner().invoke(app, [*args, "--batch", "1,16,64", "--json"]).output)
    assert many["batches"] == [1, 16, 64]
    for b, doc in zip(many["batches"], many["by_batch"]):
        assert doc == json.loads(CliRunner().invoke(app, [*args, "--batch", str(b), "--json"]).output)
    text = CliRunner().invoke(app, [*args, "--batch", "1,16,64"]).output
    assert "context 32,768, batch 1 / 16 / 64, FP16 cache 4.00 GiB / 64.00 GiB / 256.00 GiB" in text
    assert "4.00 GiB / 64.00 GiB / 256.00 GiB" in next(line for line in text.splitlines() if "│ fp16 " in line)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines()
            if line.startswith("│") and "x │" in line]
    assert [(r[0], r[1], r[4]) for r in rows] == [
        ("1", "fp16", "1.00x"), ("1", "int8", "1.12x"), ("1", "int4_g64", "1.18x"),
        ("16", "fp16", "1.00x"), ("16", "int8", "1.66x"), ("16", "int4_g64", "2.40x"),
        ("64", "fp16", "1.00x"), ("64", "int8", "1.87x"), ("64", "int4_g64", "3.12x")]
    # int4_g64 at batch 64 by hand: weights 8,030,261,248 params x 2 bytes + 64 x 32,768 x 36,864 bytes per token
    weights = many["by_batch"][2]["arch"]["params"] * 2
    assert many["by_batch"][2]["rows"][2]["decode"]["step_bytes"] == weights + 64 * 32768 * 36864


@pytest.mark.parametrize("batch", ["1,,64", "1,0", "16,x", ","])
def test_a_bad_batch_list_is_one_line(batch):
    result = CliRunner().invoke(app, ["memory", "--shape", "llama-3.1-8b", "--batch", batch])
    assert result.exit_code == 2 and result.stderr.startswith("error: --batch ") and "Traceback" not in result.output


def test_the_readmes_roofline_block_is_what_the_command_prints():
    """The README shows `$ kveval memory ...` with the end of its output: every line it shows is in the output."""
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("$ kveval memory ", 1)[1].split("```", 1)[0].splitlines()
    command, shown = block[0], [line for line in block[1:] if line.strip() and line != "..."]
    result = CliRunner().invoke(app, ["memory", *shlex.split(command)])
    assert result.exit_code == 0, result.output
    printed = result.output.splitlines()
    assert len(shown) >= 10 and all(line in printed for line in shown), [s for s in shown if s not in printed]
