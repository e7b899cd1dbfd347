"""What quantizes one layer's keys and values: the spec, calibrated parameters from the policy's scales file, and
whether keys are quantized before RoPE. Shared by ``emulate`` and ``QuantizedKVCache`` so that both paths apply
exactly the same quantizer to the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.errors import KvevalError
from kveval.policy import AUTO_SCALES, KVPolicy
from kveval.quant import QParams, QuantSpec, fake_quantize, quantize
from kveval.quant.primitives import QuantizedTensor
from kveval.rope import rotate, unrotate


@dataclass(frozen=True)
class TensorQuantizer:
    """One layer's K or V quantizer: ``spec`` plus fixed ``qparams`` (calibrated) or None (statistics), and
    ``pre_rope`` (keys: quantize ``unrotate(k)`` and read back ``rotate(k̂)``)."""

    spec: QuantSpec
    qparams: QParams | None = None
    pre_rope: bool = False

    @property
    def is_none(self) -> bool:
        return self.spec.is_none

    def fake(self, x: torch.Tensor, channel_block: int | None, rope=None) -> torch.Tensor:
        """x̂ of x ``[batch, kv_heads, T, head_dim]``; ``rope = (cos, sin)`` ``[batch, T, head_dim]`` when pre_rope."""
        if self.spec.is_none:
            return x
        if self.pre_rope:
            cos, sin = rope
            xq = fake_quantize(unrotate(x, cos, sin), self.spec, channel_block=channel_block, qparams=self.qparams)
            return rotate(xq, cos, sin)
        return fake_quantize(x, self.spec, channel_block=channel_block, qparams=self.qparams)

    def quantize(self, x: torch.Tensor, channel_block: int | None, rope=None) -> QuantizedTensor:
        """The stored form of x (pre-RoPE keys when ``pre_rope``)."""
        if self.pre_rope and not self.spec.is_none:
            x = unrotate(x, *rope)
        return quantize(x, self.spec, self.qparams, channel_block=channel_block)

    def read_back(self, xq: torch.Tensor, rope=None) -> torch.Tensor:
        """What attention sees from dequantized storage ``xq`` (rotated again when ``pre_rope``)."""
        return rotate(xq, *rope) if self.pre_rope and not self.spec.is_none else xq


def policy_scales(policy: KVPolicy, model):
    """The policy's loaded scales file (checked against the model), or None when no spec needs one."""
    if not policy.needs_scales_file():
        return None
    if policy.scales == AUTO_SCALES:
        raise KvevalError(
            f"policy '{policy.name}': scales: auto is calibrated by kveval run; outside a run pass a scales file path"
        )
    from kveval.calibration.scales_file import load_scales
    from kveval.models import model_info

    sf = load_scales(policy.scales)
    info = model_info(model)
    sf.check_model(info["name"], info["num_layers"], info["num_kv_heads"], info["head_dim"])
    return sf


def layer_quantizers(policy: KVPolicy, layer: int, num_layers: int, scales=None,
                     device: torch.device | str | None = None) -> tuple[TensorQuantizer, TensorQuantizer]:
    """(key, value) quantizers of one layer under ``policy``; ``scales`` from ``policy_scales``; calibrated
    parameters are moved to ``device`` (the model's)."""
    key_spec, value_spec = policy.specs_for_layer(layer, num_layers)
    out = []
    for kind, spec in (("key", key_spec), ("value", value_spec)):
        pre = policy.pre_rope and kind == "key" and not spec.is_none
        qp = None
        if scales is not None and policy.uses_static(spec):
            qp = scales.qparams(layer, "key_pre_rope" if pre else kind, spec)
            if device is not None:
                qp = QParams(qp.scale.to(device), None if qp.zero_point is None else qp.zero_point.to(device))
        out.append(TensorQuantizer(spec, qp, pre))
    return out[0], out[1]
