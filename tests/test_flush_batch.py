"""The cache's batched flush (kveval/patch/cache/flush_batch.py): the tokens every layer quantizes in one call,
quantized together, give each layer exactly what it gets when it quantizes alone: the same logits, codes, scales,
read-back values and bytes, for every quantization preset, mixed per-layer specs, left-padded batches and a call
that stops before its last layer."""

from __future__ import annotations

import pytest
import torch

import kveval.patch.cache.layer as layer_module
from kveval.errors import KvevalError
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.patch.cache import LayerHoldings, QuantizedKVLayer
from kveval.patch.cache.flush_batch import FlushBatch
from kveval.policy import KVPolicy
from kveval.policy.presets import POLICY_PRESETS
from kveval.quant import preset_names

PROMPT, STEPS = 5, 6
#: KIVI-2's schedules on a window of 4 tokens (keys per channel in blocks of 4, values sliding_lag)
KIVI = {"key": {"preset": "int2_channel", "group_size": 4}, "value": "int2_g32", "residual": 4,
        "residual_mode": {"key": "block", "value": "sliding_lag"}}


def _decode(model, ids, policy, mask=None, read="buffered"):
    """(logits of a prompt call and STEPS single-token calls, the cache)."""
    cache = QuantizedKVCache(model, policy, read=read, max_length=ids.shape[1] + STEPS)
    kw = cache_kwargs(model, cache)
    extra = {} if mask is None else {"attention_mask": mask}
    out, step = [], ids
    with torch.no_grad():
        for _ in range(STEPS + 1):
            logits = model(step, use_cache=True, **kw, **extra).logits
            out.append(logits[:, -1])
            step = logits[:, -1:].argmax(-1)
            if mask is not None:
                extra["attention_mask"] = mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return torch.stack(out, 1), cache


def _stored(cache):
    """Every layer's pieces: (kind, rows, start, end, packed codes, scale, zero point, read-back values)."""
    out = []
    for layer in cache.layers:
        if not isinstance(layer, QuantizedKVLayer):
            continue
        holdings = LayerHoldings(layer)
        for kind in ("key", "value"):
            for run in holdings.chunks(kind):
                qt = run.piece.chunk.qt
                out.append((kind, run.piece.rows, run.piece.start, run.piece.end, run.piece.chunk.packed, qt.scale,
                            qt.zero_point, run.read()))
            out.append((kind, "held", holdings.held(kind)))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _both(model, ids, policy, monkeypatch, mask=None):
    """(together, one store at a time): the logits, what is stored and the bytes; and the number of stores of each
    quantize call made together."""
    import kveval.patch.cache.flush_batch as batch_module

    runs = []
    original = batch_module.quantize_together

    def counted(members, *args):
        runs.append(len(members))
        return original(members, *args)

    for module in (layer_module, batch_module):
        monkeypatch.setattr(module, "quantize_together", counted)
    logits, cache = _decode(model, ids, policy, mask)
    batched = (logits, _stored(cache), cache.nbytes())
    with monkeypatch.context() as m:
        m.setattr(layer_module, "together", lambda *a: False)
        m.setattr(layer_module, "deferrable", lambda *a: False)
        logits, cache = _decode(model, ids, policy, mask)
    return batched, (logits, _stored(cache), cache.nbytes()), runs


def _assert_same(batched, alone) -> None:
    """The logits, the stored pieces and the bytes of ``_both``'s two runs are equal."""
    assert _same(batched[0], alone[0]), "logits"
    assert _same(batched[1], alone[1]), "stored pieces"
    assert batched[2] == alone[2], "bytes"


def _presets():
    return [n for n in preset_names() if n != "none"]


@pytest.fixture(scope="module")
def wide_heads():
    """tiny-llama with heads 128 wide: every group size of the presets divides them."""
    from kveval.models.builtin import build_tiny_model

    return build_tiny_model("tiny-llama", head_dim=128)


@pytest.mark.parametrize("name", _presets())
def test_every_quantization_preset_stores_the_same_bits_batched(wide_heads, name, monkeypatch):
    model = wide_heads
    ids = torch.randint(4, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    try:
        policy = KVPolicy.from_config({"spec": name})
        batched, alone, runs = _both(model, ids, policy, monkeypatch)
    except KvevalError as exc:
        pytest.skip(f"{name} cannot act on its own here (static scales, per-channel blocks): {exc}")
    _assert_same(batched, alone)
    spec = policy.specs_for_layer(0, model.config.num_hidden_layers)[0]
    if spec.fmt.whole_tensor or spec.granularity == "channel" or spec.gran.static_only:
        assert not runs  # flushed at once, as before
    else:
        assert runs and max(runs) == 2  # a layer's keys and values: one call


@pytest.mark.parametrize("config, most", [
    ({"spec": "int4_g32", "layers": {"0": {"spec": "int8"}, "2": {"key": "int2_g32"}}}, 2),  # by spec
    (KIVI, 4),  # keys in blocks alone, values (sliding_lag) of the 4 layers at once
    ({"spec": "int4_g32", "sink_tokens": 2, "residual": 3}, 2),
])
def test_mixed_layers_a_window_and_left_padding(tiny_llama, monkeypatch, config, most):
    """Per-layer specs, KIVI, sinks and a window, in a left-padded batch whose rows flush different positions."""
    model, _ = tiny_llama
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(4, model.config.vocab_size, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    policy = KVPolicy.from_config(config)
    batched, alone, runs = _both(model, ids, policy, monkeypatch, mask)
    _assert_same(batched, alone)
    assert max(runs) == most


def test_the_lean_read_path_never_waits_for_the_end_of_the_call(tiny_llama, monkeypatch):
    """Its read buffer is gone when the call ends: KIVI's values flush at once, as before."""
    model, _ = tiny_llama
    calls = []
    monkeypatch.setattr(FlushBatch, "add", lambda self, *a: calls.append(a))
    ids = torch.ones(1, PROMPT, dtype=torch.long)
    _decode(model, ids, KVPolicy.from_config(KIVI), read="lean")
    assert calls == []
    _decode(model, ids, KVPolicy.from_config(KIVI), read="buffered")
    assert calls


def test_a_call_stopped_before_its_last_layer_is_settled_before_anything_reads(tiny_llama, monkeypatch):
    """A forward that raises at the last layer after the others have queued their values' flush: the queued tokens
    are quantized before ``nbytes`` or the holdings read the stores."""
    model, _ = tiny_llama
    ids = torch.randint(4, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(5))
    policy = KVPolicy.from_config(KIVI)
    cache = QuantizedKVCache(model, policy, read="buffered")
    last = cache.layers[-1]
    original = QuantizedKVLayer.update

    def fails(self, *args, **kwargs):
        if self is last:
            raise RuntimeError("stopped")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(QuantizedKVLayer, "update", fails)
    with torch.no_grad(), pytest.raises(RuntimeError, match="stopped"):
        model(ids, use_cache=True, **cache_kwargs(model, cache))
    flushes = cache.layers[0].setup.flushes
    assert len(flushes.queued) == model.config.num_hidden_layers - 1  # the values of layers 0..n-2
    first = cache.layers[0]
    assert first.stores["value"].pieces == []
    assert first.nbytes()["codes"] > 0 and not flushes.queued
    assert [(p.start, p.end) for p in first.stores["value"].pieces] == [(0, 4)]  # 8 tokens, window of 4


@pytest.mark.parametrize("name", sorted(POLICY_PRESETS))
def test_every_policy_preset_stores_the_same_bits_batched(wide_heads, name, monkeypatch):
    """The engine and paper presets: transforms, sinks, KIVI's and transformers' block schedules, HQQ's solver."""
    model = wide_heads
    ids = torch.randint(4, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(6))
    policy = KVPolicy.preset(name)
    if policy.needs_scales_file():
        pytest.skip(f"{name} needs calibrated scales (scales: auto)")
    try:
        batched, alone, _ = _both(model, ids, policy, monkeypatch)
    except KvevalError as exc:
        pytest.skip(f"{name} cannot act on tiny-llama: {exc}")
    _assert_same(batched, alone)


def test_a_layer_whose_flush_waits_runs_it_before_its_next_call_reads(tiny_llama, monkeypatch):
    """A model whose last layer's cache is never updated (KV shared across layers): the end-of-call trigger never
    fires, and each layer runs what waits before its next call reads; the logits are those of flushing at once."""
    model, _ = tiny_llama
    ids = torch.randint(4, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(7))
    policy = KVPolicy.from_config(KIVI)
    build = QuantizedKVCache.__init__

    def no_trigger(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.layers[0].setup.flushes.last = None

    with monkeypatch.context() as m:
        m.setattr(QuantizedKVCache, "__init__", no_trigger)
        waited, cache = _decode(model, ids, policy)
        assert cache.layers[0].setup.flushes.queued  # the last call's values still wait
    with monkeypatch.context() as m:
        m.setattr(layer_module, "deferrable", lambda *a: False)
        at_once, _ = _decode(model, ids, policy)
    assert torch.equal(waited, at_once)
