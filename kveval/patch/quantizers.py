"""What quantizes one layer's keys and values: the spec, calibrated parameters from the policy's scales file, and
the layer's side of the policy's K/V transforms (``kveval.transforms``: pre-RoPE keys, rotations, ...). Shared by
``emulate`` and ``QuantizedKVCache``: both paths apply exactly the same transforms and quantizer to the same tensor
through the methods below (``fake`` in emulation; ``quantize`` + ``read_back`` in the cache; ``full_precision``
for tokens never quantized; ``query`` and ``output`` around the attention call in both, and ``attention`` in
place of it when a transform replaces the attention computation).

Shapes: K/V ``x [batch, kv_heads, T, head_dim]``, queries ``[batch, heads, T, head_dim]``, attention outputs
``[batch, heads, T, head_dim]``; ``rope = (cos, sin)`` ``[batch, T, head_dim]`` of the tensor's positions, needed
only when ``needs_rope`` (else None).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kveval.errors import KvevalError
from kveval.policy import AUTO_SCALES, KVPolicy
from kveval.quant import QParams, QuantSpec, fake_quantize, quantize
from kveval.quant.primitives import QuantizedTensor, quantize_packed
from kveval.transforms import TransformChain
from kveval.transforms.base import Kind

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TensorQuantizer:
    """One layer's K or V quantizer: ``spec`` plus fixed ``qparams`` (calibrated) or None (statistics), and
    ``transforms``, this tensor's chain (``key_in``/``value_in`` before quantization, ``*_out`` on read).

    With a ``none`` spec nothing is quantized: the tensor only goes through the transforms that keep it in their
    domain (``TransformChain.to_attention``), i.e. through none at all for pre-RoPE keys."""

    spec: QuantSpec
    qparams: QParams | None = None
    transforms: TransformChain = field(default_factory=lambda: TransformChain("key"))

    @property
    def is_none(self) -> bool:
        return self.spec.is_none

    @property
    def needs_rope(self) -> bool:
        """Whether the transform calls that run for this tensor (its query/output hooks included) need ``rope``;
        with a ``none`` spec only the domain transforms and the hooks run."""
        chain = self.transforms
        if not self.spec.is_none:
            return chain.needs_rope
        return any(t.needs_rope for t in (*chain.domain, *chain.hook_transforms))

    @property
    def reads_back_stored(self) -> bool:
        """Whether attention reads the dequantized storage as it is (no transform acts on this tensor)."""
        return not self.transforms.transforms

    @property
    def reads_transformed(self) -> bool:
        """Whether full-precision tokens must be moved into a transform's domain before attention reads them."""
        return bool(self.transforms.domain)

    @property
    def hooks_attention(self) -> bool:
        """Whether a query hook (keys), an output hook (values) or an attention hook (values) acts around or in
        place of the attention call."""
        return self.transforms.has_query_hook or self.transforms.has_output_hook or self.replaces_attention

    @property
    def replaces_attention(self) -> bool:
        """Whether a transform of this (value) chain computes the attention itself (``attention``)."""
        return self.transforms.attention_transform is not None

    def fake(self, x: torch.Tensor, channel_block: int | None, rope: Rope | None = None) -> torch.Tensor:
        """x̂ of x ``[batch, kv_heads, T, head_dim]`` as attention reads it: transforms in, fake quantization,
        transforms out. ``rope``: ``(cos, sin)`` ``[batch, T, head_dim]`` of x's positions when ``needs_rope``."""
        if self.spec.is_none:
            return self.transforms.to_attention(x, rope)
        xs = self.transforms.forward(x, rope)
        xq = fake_quantize(xs, self.spec, channel_block=channel_block, qparams=self.qparams)
        return self.transforms.backward(xq, rope)

    def quantize(self, x: torch.Tensor, channel_block: int | None, rope: Rope | None = None) -> QuantizedTensor:
        """The stored form of x (after the transforms' ``*_in``: pre-RoPE keys with ``pre_rope``)."""
        return quantize(self.transforms.forward(x, rope), self.spec, self.qparams, channel_block=channel_block)

    def quantize_packed(self, x: torch.Tensor,
                        decode: bool) -> tuple[QuantizedTensor, torch.Tensor, torch.Tensor | None] | None:
        """``quantize``, the codes packed and ``read_back`` in one fused pass (`kveval.quant.primitives.
        quantize_packed`: the same bits) where no transform acts on this tensor and its statistics are its own
        (no calibrated parameters); None otherwise, and where the format has no fused path."""
        if self.transforms.transforms or self.qparams is not None:
            return None
        return quantize_packed(x, self.spec, decode=decode)

    def read_back(self, xq: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """What attention reads from dequantized storage ``xq`` (the transforms' ``*_out``, in reverse order)."""
        return self.transforms.backward(xq, rope)

    def full_precision(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """A token kept in full precision (sinks, residual window, FP prefill) as attention reads it: x itself
        unless a transform keeps this tensor in its domain."""
        return self.transforms.to_attention(x, rope)

    def query(self, q: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """The query ``[batch, heads, T, head_dim]`` before the dot product (key quantizers' query hooks)."""
        return self.transforms.query(q, rope)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  key_positions: torch.Tensor, scaling: float, rope: Rope | None = None) -> torch.Tensor:
        """The attention computed by the value chain's attention hook (``replaces_attention``): q ``[batch, heads,
        Tq, head_dim]`` after the query hooks, k/v ``[batch, kv_heads, Tk, head_dim]`` as attention reads them,
        ``allowed`` bool broadcastable to ``[batch, heads, Tq, Tk]``, ``key_positions`` int64 ``[Tk]``; returns
        ``[batch, heads, Tq, head_dim]`` (before the output hooks)."""
        return self.transforms.attention(q, k, v, allowed, key_positions, scaling, rope)

    def output(self, o: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """The attention output in transformers' layout ``[batch, T, heads, head_dim]`` after the value
        quantizer's output hooks (which see ``[batch, heads, T, head_dim]``); ``o`` itself without hooks."""
        if not self.transforms.has_output_hook:
            return o
        return self.transforms.output(o.transpose(1, 2), rope).transpose(1, 2).contiguous()


def policy_scales(policy: KVPolicy, model):
    """The policy's loaded scales file (checked against the model), or None when no spec needs one."""
    if not policy.needs_scales_file():
        return None
    if policy.scales == AUTO_SCALES:
        raise KvevalError(
            f"policy '{policy.name}': scales: auto is calibrated by kveval run; outside a run pass a scales file path"
        )
    from kveval.models import model_info
    from kveval.scales.file import load_scales

    sf = load_scales(policy.scales)
    info = model_info(model)
    sf.check_model(info["name"], info["num_layers"], info["num_kv_heads"], info["head_dim"])
    return sf


def model_type_of(model) -> str | None:
    """The text model's ``config.model_type`` (None when the model has no config)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None)


def layer_quantizers(policy: KVPolicy, layer: int, num_layers: int, scales=None,
                     device: torch.device | str | None = None,
                     model_type: str | None = None,
                     sliding_layers: tuple[int, ...] | None = None) -> tuple[TensorQuantizer, TensorQuantizer]:
    """(key, value) quantizers of one layer under ``policy``; ``scales`` from ``policy_scales``; calibrated
    parameters are moved to ``device`` (the model's). The scales file's kind follows the stored domain
    (``key_pre_rope`` with pre_rope); a transform whose stored domain no scales describe is a KvevalError.
    ``model_type`` (``model_type_of(model)``): transforms that do not apply to it (``KVTransform.applies_to``,
    e.g. ``gguf_order`` on a Qwen model) are left out. ``sliding_layers``: the model's sliding-window layers
    (``Arch.sliding_layers``), for a policy with ``skip_sliding``."""
    key_spec, value_spec = policy.specs_for_layer(layer, num_layers, sliding_layers)
    sequence = tuple(t for t in policy.transform_sequence() if t.applies_to(model_type))
    out = []
    kinds: tuple[tuple[Kind, QuantSpec], ...] = (("key", key_spec), ("value", value_spec))
    for kind, spec in kinds:
        chain = TransformChain.of(sequence, kind, layer)
        qp = None
        if scales is not None and policy.uses_static(spec):
            stored = chain.scales_kind()
            if stored is None:
                names = " > ".join(t.describe() for t in chain.transforms)
                raise KvevalError(f"policy '{policy.name}': calibrated scales ({spec.describe()}) are not available "
                                  f"for {kind}s stored after the transforms {names}; use a dynamic spec")
            qp = scales.qparams(layer, stored, spec)
            if device is not None:
                qp = qp.to(device)  # scale, zero point and a calibrated codebook (nuq)
        out.append(TensorQuantizer(spec, qp, chain))
    return out[0], out[1]
