"""Big models across devices: ``model.device_map`` / ``model.max_memory`` through accelerate.

On this CPU-only machine the layers are spread over ``cpu`` and ``disk`` (accelerate's offload: the offloaded
layers' parameters are on the meta device and are brought in by hooks, layer by layer), which exercises the same
hooks and device moves as a map over several GPUs. The logits of a dispatched model equal the undispatched
model's bit for bit: plain, under ``emulate`` and through ``QuantizedKVCache`` (real token-by-token decoding),
for models dispatched after loading (tiny builtins, float64) and for checkpoints loaded straight onto their
devices (``from_pretrained(device_map=...)``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from kveval.config import check_inputs, validate
from kveval.errors import KvevalError
from kveval.models import Placement, load_model, model_info
from kveval.patch.cache import decode_logits
from kveval.patch.emulate import emulate
from kveval.policy import KVPolicy

#: every decoder layer of the tiny models placed by hand: two on the CPU, two on disk
CPU_DISK_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
                "lm_head": "cpu"}


def _ids(n: int = 40) -> torch.Tensor:
    return torch.randint(4, 260, (1, n), generator=torch.Generator().manual_seed(0))


def _offloaded(model) -> list[str]:
    return sorted({n.split(".")[2] for n, p in model.named_parameters() if p.device.type == "meta"})


def _same_logits(model, reference, policy: KVPolicy, ids: torch.Tensor) -> None:
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        with emulate(model, policy):
            emulated = model(ids).logits
        with emulate(reference, policy):
            emulated_ref = reference(ids).logits
    assert torch.equal(emulated, emulated_ref)
    assert not torch.equal(emulated, reference(ids).logits)  # the policy did something
    decoded = decode_logits(model, ids, policy)
    assert torch.equal(decoded, decode_logits(reference, ids, policy))
    return emulated, decoded


@pytest.mark.parametrize("name", ["builtin:tiny-llama", "builtin:tiny-gemma3"])
def test_cpu_and_disk_map_gives_the_undispatched_logits(name):
    """Emulation and the real cache on a model whose layers 1 and 3 live on disk: the same logits as on one device,
    and (float64) emulation equals token-by-token decoding as on an undispatched model."""
    reference, _ = load_model(name, dtype="float64")
    model, _ = load_model(name, dtype="float64", device_map=CPU_DISK_MAP)
    assert _offloaded(model) == ["1", "3"]
    assert model_info(model)["device"] == "dispatched: cpu 6, disk 2"
    policy = KVPolicy.from_config({"key": "int4_g32", "value": "int8", "residual": 8}, name="mixed")
    emulated, decoded = _same_logits(model, reference, policy, _ids())
    assert torch.allclose(emulated, decoded, atol=1e-9, rtol=0)


def test_max_memory_forces_disk_offload():
    """``device_map: auto`` with a CPU budget smaller than the model: accelerate sends what does not fit to disk."""
    reference, _ = load_model("builtin:tiny-llama")
    model, _ = load_model("builtin:tiny-llama", device_map="auto", max_memory={"cpu": "300KiB"})
    assert "disk" in set(model.hf_device_map.values()) and _offloaded(model)
    _same_logits(model, reference, KVPolicy.from_config("int4_g32", name="int4_g32"), _ids())


def test_checkpoint_loads_straight_onto_its_devices(tmp_path):
    """A checkpoint folder loads through ``from_pretrained(device_map=..., max_memory=...)`` (no full copy in CPU
    memory first), with the same logits under emulation and through the real cache."""
    tiny, tok = load_model("builtin:tiny-llama")
    tiny.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    reference, _ = load_model(str(tmp_path / "ckpt"))  # the same checkpoint on one device
    model, _ = load_model(str(tmp_path / "ckpt"), device_map=CPU_DISK_MAP)
    assert model.hf_device_map == CPU_DISK_MAP and _offloaded(model) == ["1", "3"]
    _same_logits(model, reference, KVPolicy.from_config("int4_g32", name="int4_g32"), _ids())
    auto, _ = load_model(str(tmp_path / "ckpt"), device_map="sequential", max_memory={"cpu": "300KiB"})
    assert "disk" in set(auto.hf_device_map.values())
    _same_logits(auto, reference, KVPolicy.from_config("int8", name="int8"), _ids())


def test_a_map_that_misses_modules_is_one_line():
    with pytest.raises(KvevalError, match="device_map cannot place it"):
        load_model("builtin:tiny-llama", device_map={"model.layers.0": "cpu"})


BASE = {"name": "t", "model": {"name": "builtin:tiny-llama"}, "kv": ["int8"],
        "tasks": [{"perplexity": {"seq_len": 32, "max_tokens": 96}}]}


@pytest.mark.parametrize(("model", "needle"), [
    ({"device_map": "autox"}, "model.device_map: unknown strategy 'autox'"),
    ({"device_map": {"model.layers.0": "gpu"}}, "unknown device 'gpu'"),
    ({"device_map": {}}, "non-empty"),
    ({"max_memory": {"cpu": "1GiB"}}, "max_memory needs device_map"),
    ({"device_map": "auto", "max_memory": {"cpu": "lots"}}, "model.max_memory: 'cpu': bad memory size"),
    ({"device_map": "auto", "max_memory": {"disk": "1GiB"}}, "'disk' has no limit"),
    ({"device_map": "auto", "device": "cpu"}, "device and device_map: give one"),
    ({"device_map": {"": "cpu"}, "max_memory": {"cpu": "1GiB"}}, "applies to a strategy"),
    ({"device_map": "auto", "weights": ["int8_channel"]}, "weights with device_map"),
])
def test_bad_placement_is_refused_by_the_schema(model, needle):
    raw = copy.deepcopy(BASE)
    raw["model"].update(model)
    with pytest.raises(KvevalError, match="^config: ") as info:
        validate(raw)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_gpu_that_is_not_there_is_refused_before_loading():
    raw = copy.deepcopy(BASE)
    raw["model"]["device_map"] = {"": "cuda:7"}
    with pytest.raises(KvevalError, match="name GPU 7"):
        check_inputs(validate(raw))


def test_resolved_config_round_trips_and_omits_unset_placement():
    """Unset, the fields stay out of config.resolved.yaml (older run folders resume); set, the resolved form
    validates again to itself (the sweep writes resolved configs)."""
    assert "device_map" not in validate(BASE).resolved()["model"]
    raw = copy.deepcopy(BASE)
    raw["model"].update({"device_map": "auto", "max_memory": {0: "20GiB", "cpu": "1GiB"}})
    resolved = validate(raw).resolved()
    assert "device" not in resolved["model"]
    assert validate(resolved).resolved() == resolved
    assert Placement.of(resolved["model"]["device_map"], resolved["model"]["max_memory"]).max_memory == {
        0: 20 * 2**30, "cpu": 2**30}


def test_a_run_on_a_dispatched_model_measures_what_one_device_does(tmp_path):
    """``kveval run`` end to end with layers on disk: the same metrics as the run on one device."""
    from kveval.commands.run import run_experiment

    raw = copy.deepcopy(BASE)
    raw["tasks"] = [{"perplexity": {"seq_len": 32, "max_tokens": 96, "bootstrap": 20, "noise_windows": 0}}]
    one = run_experiment(validate({**raw, "output": str(tmp_path / "one")}), quiet=True)
    raw["model"]["device_map"] = CPU_DISK_MAP
    spread = run_experiment(validate({**raw, "output": str(tmp_path / "spread")}), quiet=True)
    for key in ("ppl", "kld_mean", "top1_agree", "bits_per_element"):
        assert spread["policies"]["int8"][key] == one["policies"]["int8"][key], key
    assert spread["baseline"]["ppl"] == one["baseline"]["ppl"]
