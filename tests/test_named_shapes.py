"""``kveval memory --shape``: every named shape bills, and three are checked against bytes computed by hand from
their published config values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kveval.commands.memory import memory_command
from kveval.memory import NAMED_SHAPES, Arch, fp16_bytes, kv_bytes


@pytest.mark.parametrize("name", list(NAMED_SHAPES))
def test_every_named_shape_bills(name):
    arch = Arch.named(name)
    entry = NAMED_SHAPES[name]
    assert entry["checked"] in ("config", "copies", "memory") and entry["source"]
    text = memory_command(shape=name, context=4096, kv="fp16,int8,int4_g64", gpu_memory="2TiB")
    assert name in text and "int4_g64" in text and "values from" in text
    bill = kv_bytes(arch, "int4_g64", 4096)
    assert 0 < bill.total < fp16_bytes(arch, 4096)
    assert arch.kv_layers and arch.params


def test_three_shapes_by_hand():
    L = 131072
    # Llama-3.1-8B: 32 layers x 8 KV heads x head_dim 128, K and V, 2 B: 131,072 B/token
    assert fp16_bytes(Arch.named("llama-3.1-8b"), L) == L * 2 * 32 * 8 * 128 * 2 == L * 131072
    # Gemma-3-27B: 62 layers, every 6th full (10 of them), the other 52 slide over 1024 tokens; 16 KV heads x 128
    gemma = Arch.named("gemma-3-27b")
    assert len(gemma.sliding_layers) == 52 and gemma.sliding_window == 1024
    assert fp16_bytes(gemma, L) == (10 * L + 52 * 1024) * 2 * 16 * 128 * 2 == 11_173_625_856
    # Qwen3-Next-80B-A3B: 12 full-attention layers x 2 KV heads x 256: 24,576 B/token; 36 Gated DeltaNet layers
    # hold conv (2 x 16 x 128 + 32 x 128) x 4 in bf16 and recurrent 32 x 128 x 128 in fp32 per sequence
    qnext = Arch.named("qwen3-next-80b-a3b")
    bill = kv_bytes(qnext, "fp16", L)
    assert bill.total == L * 12 * 2 * 2 * 256 * 2 == L * 24576
    assert bill.state == 36 * (8192 * 4 * 2 + 32 * 128 * 128 * 4) == 77_856_768
    # DeepSeek-V3 in vLLM: bf16 (512 + 64) x 2 = 1,152 B per token and layer; fp8_ds_mla's 656-byte entry
    ds = Arch.named("deepseek-v3")
    assert kv_bytes(ds, "fp16", L).total == L * 61 * 1152 == L * 70272
    assert kv_bytes(ds, "vllm_fp8_ds_mla", L).total == L * 61 * 656 == L * 40016


def test_memory_cli_prints_what_vllm_allocates():
    out = subprocess.run([sys.executable, "-m", "kveval", "memory", "--shape", "deepseek-v3", "--kv",
                          "fp16,vllm_fp8_ds_mla", "--context", "131072"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[1]: line.split()[3] for line in out.stdout.splitlines() if line.startswith("│")}
    assert rows == {"fp16": "70,272", "vllm_fp8_ds_mla": "40,016"}
    bad = subprocess.run([sys.executable, "-m", "kveval", "memory", "--shape", "deepseek-v4"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "unknown shape" in bad.stderr


def test_shapes_round_trip_through_their_json():
    """A run's ``memory.arch`` (``Arch.to_dict``) gives back the same shape: the report and the planner recompute
    bills from it (windows, layer kinds, MLA, state and RoPE facts included)."""
    from kveval.models.builtin import TINY_FAMILIES, tiny_model_config
    from kveval.results.read import _arch

    shapes = [Arch.named(n) for n in NAMED_SHAPES]
    shapes += [Arch.from_model_config(tiny_model_config(n), name=n) for n in TINY_FAMILIES]
    for arch in shapes:
        again = Arch.from_dict(arch.to_dict())
        assert again == arch, arch.name
        assert _arch({"memory": {"arch": arch.to_dict()}}, {}) == arch
