"""docs/extending.md's worked examples run as written.

The doc marks its examples with a fenced block whose info string carries a title (```python title=format-example).
Each test executes the blocks it needs as modules (under the import paths the doc gives them, in ``sys.modules``
for the test only), registers what they define, checks it on a tiny model, and unregisters it afterwards, so the
rest of the suite never sees the example format, transform or presets.
"""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from pydantic import ValidationError
from rich.console import Console
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import POLICY_PRESETS, KVPolicy
from kveval.progress import Progress
from kveval.quant import QuantSpec, dequantize, fake_quantize, preset, quantize
from kveval.quant.formats import format_names, register_format, unregister_format
from kveval.quant.presets import PRESETS
from kveval.results import RunDir
from kveval.transforms import TransformContext, transform_names
from kveval.transforms import registry as transform_registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
FENCE = re.compile(r"^```(\w+) title=([\w-]+)\n(.*?)^```$", re.M | re.S)
TITLES = {  # title -> (language, module path the doc gives the block, or None for a fragment)
    "format-example": ("python", "kveval.quant.formats.int_pow2"),
    "format-test-example": ("python", "tests_quant_test_quant_int_pow2"),
    "transform-example": ("python", "kveval.transforms.dct"),
    "transform-test-example": ("python", "tests_test_transform_dct"),
    "quantspec-preset-example": ("python", None),
    "policy-preset-example": ("python", None),
    "task-params-example": ("python", "kveval.tasks.divergence.params"),
    "task-example": ("python", "kveval.tasks.divergence.task"),
    "task-reporting-example": ("python", "kveval.tasks.divergence.reporting"),
    "task-test-example": ("python", "tests_test_divergence"),
    "task-preset-example": ("yaml", None),
    "model-check-example": ("python", "docs_model_check"),
}
FORMAT, TRANSFORM = "int_pow2", "dct"


def blocks() -> dict[str, str]:
    """title -> code of every titled fenced block of the doc."""
    found: dict[str, str] = {}
    for lang, title, code in FENCE.findall(DOC.read_text()):
        assert title not in found, f"two blocks titled {title!r}"
        assert TITLES.get(title, (lang,))[0] == lang, title
        found[title] = code
    return found


BLOCKS = blocks()


def load(title: str, monkeypatch) -> types.ModuleType:
    """Execute one block as the module the doc names (visible in sys.modules until the test ends)."""
    name = TITLES[title][1]
    module = types.ModuleType(name)
    module.__file__ = f"{DOC}#{title}"
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(BLOCKS[title], module.__file__, "exec"), module.__dict__)
    return module


def table_entry(title: str, **names) -> tuple[str, tuple]:
    """The one ``name: value`` entry of a preset-table fragment."""
    entry = eval("{" + BLOCKS[title] + "}", dict(names))
    assert len(entry) == 1
    return next(iter(entry.items()))


@pytest.fixture
def fmt(monkeypatch):
    """The example format, registered for one test."""
    module = load("format-example", monkeypatch)
    register_format(module.FORMATS[0])
    try:
        yield module
    finally:
        unregister_format(FORMAT)
    assert FORMAT not in format_names()


@pytest.fixture
def transform(monkeypatch):
    """The example transform, registered (by its @register) for one test."""
    assert TRANSFORM not in transform_names()
    try:
        yield load("transform-example", monkeypatch)
    finally:
        transform_registry._REGISTRY.pop(TRANSFORM, None)
    assert TRANSFORM not in transform_names()


def test_the_doc_has_every_example():
    assert sorted(BLOCKS) == sorted(TITLES)


# ------------------------------------------------------------------------------------------------------ the format
def test_format_quantizes_a_crafted_tensor_to_hand_computed_values(fmt):
    # token rows, 3 bits (top 3): absmax/3 = 1/3 -> s = 0.5 (the next power of two); 3.0/3 = 1 -> s = 1 exactly;
    # 0.9/3 = 0.3 -> s = 0.5, x/s = [1.8, -1.4, -0.6, 0.2] -> q = [2, -1, -1, 0]; all zero -> s = 0
    x = torch.tensor([[0.5, -1.0, 0.25, 0.75], [3.0, -0.4, 1.1, 0.0], [0.9, -0.7, -0.3, 0.1], [0.0] * 4],
                     dtype=torch.float64).reshape(1, 1, 4, 4)
    spec = QuantSpec(format=FORMAT, bits=3)
    qt = quantize(x, spec)
    assert qt.codes.dtype == torch.int8
    assert qt.codes.flatten().tolist() == [1, -2, 0, 2, 3, 0, 1, 0, 2, -1, -1, 0, 0, 0, 0, 0]
    assert qt.scale.dtype == torch.float16 and qt.scale.flatten().tolist() == [0.5, 1.0, 0.5, 0.0]
    xhat = dequantize(qt)
    assert xhat.flatten().tolist() == [0.5, -1.0, 0.0, 1.0, 3.0, 0.0, 1.0, 0.0, 1.0, -0.5, -0.5, 0.0] + [0.0] * 4
    assert not torch.signbit(xhat[xhat == 0]).any()
    assert torch.equal(fake_quantize(x, spec), xhat)
    assert spec.fmt.pack(qt.codes, spec)[0, 0, 0].tolist() == [5 | 2 << 3 | (4 & 3) << 6, 4 >> 2 | 6 << 1]
    # 8 bits, groups of 2: [3, -100] -> 100/127 -> s = 1; [0.001, 0] -> 0.001/127 -> s = 2^-16 (exact in fp16)
    spec8 = QuantSpec(format=FORMAT, bits=8, granularity="group", group_size=2)
    qt8 = quantize(torch.tensor([3.0, -100.0, 0.001, 0.0]).reshape(1, 1, 1, 4), spec8)
    assert qt8.scale.flatten().tolist() == [1.0, 2.0**-16] and qt8.codes.flatten().tolist() == [3, -100, 66, 0]
    # the spec's questions, answered by the format
    g32 = QuantSpec(format=FORMAT, bits=3, granularity="group", group_size=32)
    assert g32.describe() == "int3-pow2 sym g32 (fp16 scales)" and g32.bits_per_element(128) == 3.5
    assert not g32.calibratable
    for bad, match in [({"bits": 1}, "must be in 2..8"), ({"mapping": "asymmetric"}, "must be 'symmetric'"),
                       ({"granularity": "tensor", "static_scale": 1.0}, "not taken by format")]:
        with pytest.raises(ValueError, match=match):
            QuantSpec(format=FORMAT, **{"bits": 3, **bad})


def test_format_reference_test_of_the_doc_passes(fmt, monkeypatch):
    module = load("format-test-example", monkeypatch)
    module.test_int_pow2_by_hand()


POW2_POLICY = {"key": {"format": FORMAT, "bits": 3, "granularity": "group", "group_size": 16},
               "value": {"format": FORMAT, "bits": 4}, "residual": 3, "sink_tokens": 1}


def test_format_emulation_equals_real_cache_decoding_float64(fmt, tiny_llama64):
    model, _ = tiny_llama64
    ids = ids_for(model, 24)
    policy = KVPolicy.from_config(POW2_POLICY)
    emulated = emulated_logits(model, ids, policy)
    with torch.no_grad():
        assert (emulated - model(ids).logits).abs().max() > 1e-6, "the policy must change something"
    torch.testing.assert_close(emulated, decoded_logits(model, ids, policy)[0], rtol=0, atol=1e-9)


@torch.no_grad()
def test_format_cache_bytes_equal_the_memory_bill(fmt, tiny_llama64):
    """A 7-token prefill, then single tokens: the real cache holds exactly what the bill counts (float64: 8 bytes
    per full-precision element)."""
    model, _ = tiny_llama64
    arch = Arch.from_model(model)
    policy = KVPolicy.from_config(POW2_POLICY)
    ids = ids_for(model, 12, seed=1)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    for t in range(7, 13):
        model(ids[:, :7] if t == 7 else ids[:, t - 1 : t], use_cache=True, **kw)
        bill = kv_bytes(arch, policy, t, 1, fp_bytes=8)
        measured = cache.nbytes()
        assert {k: measured[k] for k in ("codes", "scales", "residual", "total")} == {
            "codes": bill.codes, "scales": bill.scales, "residual": bill.residual, "total": bill.total}, t
    assert measured["codes"] > 0


# ----------------------------------------------------------------------------------------------------- the presets
def test_preset_entries(fmt, monkeypatch):
    name, (spec, desc) = table_entry("quantspec-preset-example", QuantSpec=QuantSpec)
    monkeypatch.setitem(PRESETS, name, (spec, desc))
    assert preset(name).fmt.name == FORMAT and "\n" not in desc
    both = KVPolicy.preset(name)
    assert both.key == both.value == spec
    name, (cfg, desc) = table_entry("policy-preset-example")
    monkeypatch.setitem(POLICY_PRESETS, name, (cfg, desc))
    policy = KVPolicy.preset(name)
    assert policy.key == policy.value == spec and (policy.sink_tokens, policy.residual) == (4, 128)
    assert "transforms" not in policy.to_config() and "\n" not in desc


# --------------------------------------------------------------------------------------------------- the transform
def test_transform_hooks_by_hand(transform):
    assert transform_registry._REGISTRY[TRANSFORM] is transform.Dct  # registered by the block's @register
    # n = 4: C[k, i] = a_k cos(pi (2i + 1) k / 8), a_0 = 1/2, a_k = 1/sqrt(2)
    c = transform.dct_matrix(4)
    cos = [[math.cos(math.pi * (2 * i + 1) * k / 8) for i in range(4)] for k in range(4)]
    expected = torch.tensor(cos, dtype=torch.float64) / math.sqrt(2)
    expected[0] = 0.5
    torch.testing.assert_close(c, expected, rtol=0, atol=1e-15)
    ctx = TransformContext(layer=0, head_dim=4)
    x = torch.tensor([0.0, 0.0, 0.0, 2.0], dtype=torch.float64).reshape(1, 1, 1, 4)  # one outlier channel
    stored = transform.Dct().key_in(x, ctx)
    torch.testing.assert_close(stored.flatten(), 2 * expected[:, 3], rtol=0, atol=1e-15)  # spread over all four
    assert stored.abs().min() > 0.5
    torch.testing.assert_close(transform.Dct().output(stored, ctx), x, rtol=0, atol=1e-15)
    policy = KVPolicy.from_config({"spec": "int8", "transforms": [TRANSFORM]})
    assert policy.to_config()["transforms"] == [TRANSFORM]
    with pytest.raises(KvevalError, match="must come before 'pre_rope'"):
        KVPolicy.from_config({"spec": "int8", "pre_rope": True, "transforms": [TRANSFORM]})


def test_transform_with_format_none_leaves_the_logits_unchanged(transform, tiny_llama64):
    model, _ = tiny_llama64
    ids = ids_for(model, 24)
    with torch.no_grad():
        baseline = model(ids).logits
    policy = KVPolicy.from_config({"spec": "none", "residual": 4, "sink_tokens": 2, "transforms": [TRANSFORM]})
    torch.testing.assert_close(emulated_logits(model, ids, policy), baseline, rtol=0, atol=1e-10)
    torch.testing.assert_close(decoded_logits(model, ids, policy)[0], baseline, rtol=0, atol=1e-10)


def test_transform_and_format_together_emulation_equals_real_cache(fmt, transform, tiny_llama64):
    model, _ = tiny_llama64
    ids = ids_for(model, 24)
    rotated = KVPolicy.from_config({**POW2_POLICY, "transforms": [TRANSFORM]})
    emulated = emulated_logits(model, ids, rotated)
    torch.testing.assert_close(emulated, decoded_logits(model, ids, rotated)[0], rtol=0, atol=1e-9)
    plain = emulated_logits(model, ids, KVPolicy.from_config(POW2_POLICY))
    assert (emulated - plain).abs().max() > 1e-6, "the rotation must change the quantized result"


def test_transform_reference_tests_of_the_doc_pass(transform, tiny_llama64, monkeypatch):
    module = load("transform-test-example", monkeypatch)
    module.test_dct_by_hand()
    module.test_dct_with_format_none_leaves_the_logits_unchanged(tiny_llama64)


# -------------------------------------------------------------------------------------------------------- the task
def load_task_package(monkeypatch) -> types.ModuleType:
    """The doc's task package (``kveval.tasks.divergence``: params, task, reporting), its task module returned."""
    package = types.ModuleType("kveval.tasks.divergence")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, package.__name__, package)
    load("task-params-example", monkeypatch)
    task = load("task-example", monkeypatch)
    load("task-reporting-example", monkeypatch)
    return task


def test_task_module_params_preset_and_run(tiny_llama, tmp_path, monkeypatch):
    task = load_task_package(monkeypatch)
    assert task.NAME == "divergence"
    assert task.Params().seq_len == 256 + 32
    for bad in ({"prompts": 0}, {"prompt_tokens": "64"}, {"new_token": 4}):
        with pytest.raises(ValidationError):
            task.Params(**bad)
    preset_cfg = yaml.safe_load(BLOCKS["task-preset-example"])
    assert list(preset_cfg) == [task.NAME]
    assert task.Params(**preset_cfg[task.NAME]) == task.Params(prompts=4, prompt_tokens=256, new_tokens=32)

    model, tokenizer = tiny_llama
    tokens = ids_for(model, 40)[0]
    policies = {"fp16": KVPolicy.preset("fp16"), "int2_g32": KVPolicy.preset("int2_g32")}
    progress = Progress(Console(quiet=True), quiet=True)
    ctx = SimpleNamespace(model=model, tokenizer=tokenizer, tokens=lambda: tokens, cache={}, policies=policies,
                          run=RunDir.open(tmp_path / "run", {}), progress=progress)
    params = task.Params(prompts=2, prompt_tokens=16, new_tokens=5)
    task.check(ctx, params)
    with pytest.raises(KvevalError, match="fewer than prompts x prompt_tokens = 48"):
        task.check(ctx, task.Params(prompts=3, prompt_tokens=16))
    metrics = task.run(ctx, params)
    assert metrics["policies"]["fp16"] == {"divergence_first": 5.0, "divergence_identical": 1.0}
    assert 0 <= metrics["policies"]["int2_g32"]["divergence_first"] <= 5
    records = ctx.run.records()
    assert len(records) == 2 * 3 and all(len(r["ids"]) == 5 for r in records)
    assert task.run(ctx, params) == metrics and len(ctx.run.records()) == 6, "a rerun resumes"

    load("task-test-example", monkeypatch).test_aggregate_by_hand()


# ---------------------------------------------------------------------------------------------------- model family
def test_model_check_of_the_doc_passes(monkeypatch):
    load("model-check-example", monkeypatch)
