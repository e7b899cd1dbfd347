"""KV scales written back as a checkpoint ships them, in the compressed-tensors form that llm-compressor writes and
vLLM loads (``kveval calibrate --export compressed-tensors DIR``, :mod:`kveval.calibration.export`).

What is written (:func:`kv_cache_config`, :func:`scale_tensor_names`): a compressed-tensors
``quantization_config`` with ``kv_cache_scheme`` (built and serialized by compressed-tensors' own
``QuantizationConfig``, ``format: dense``, ``quantization_status: compressed``, ``config_groups: {}``: what
llm-compressor writes for a KV-only scheme and what vLLM loads) and the scale tensors' names and shapes. The
scales are FP8 E4M3, ``absmax / 448`` (:func:`fp8_scale`), one ``[1]`` per layer (``strategy: tensor``) or
``[num_kv_heads, 1, 1]`` (``attn_head``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kveval.errors import KvevalError
from kveval.scales.checkpoint_tensors import SCALE_NAMES
from kveval.scales.kv_scheme import STRATEGIES


def kv_cache_config(strategy: str = "tensor") -> dict:
    """config.json's ``quantization_config`` for FP8 E4M3 KV scales beside unquantized weights, built and
    serialized by compressed-tensors (``QuantizationConfig(...).model_dump()``; vLLM needs ``config_groups``
    present, even empty, to pass its head counts to the attn_head loader)."""
    if strategy not in STRATEGIES:
        raise KvevalError(f"KV scale strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    try:
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    except ImportError:
        raise KvevalError("writing a compressed-tensors checkpoint needs compressed-tensors "
                          "(pip install 'compressed-tensors==0.20.1')") from None
    qc = QuantizationConfig(config_groups={}, format="dense", quantization_status="compressed",
                            kv_cache_scheme=QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                                             dynamic=False, strategy=strategy))
    body = qc.model_dump(exclude={"quant_method"})
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {}, **body}


def scale_tensor_names(layer: int, prefix: str = "model.layers") -> dict[str, str]:
    """kind -> the compressed-tensors tensor name of one layer's scale (``model.layers.N.self_attn.k_scale``)."""
    return {kind: f"{prefix}.{layer}.self_attn.{SCALE_NAMES[kind]}" for kind in ("key", "value")}


def fp8_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The FP8 E4M3 scale of a range: ``absmax / 448`` in float32 (kveval's calibrated per-tensor/head scale,
    ``kveval.quant.qparams_from_range`` of the ``fp8_e4m3`` spec; 0 where absmax is 0 is kept as the smallest
    normal float32, since vLLM divides by it)."""
    s = absmax.float() / 448.0
    return torch.where(s > 0, s, torch.tensor(torch.finfo(torch.float32).tiny))


@dataclass
class ScalesOut:
    """What ``kveval calibrate --export compressed-tensors DIR`` wrote."""

    folder: str
    strategy: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def summary(self) -> str:
        vals = torch.cat([t.flatten() for t in self.tensors.values()]) if self.tensors else torch.zeros(1)
        return (f"{self.folder}: compressed-tensors kv_cache_scheme {self.strategy}, {len(self.tensors)} scale "
                f"tensors ({float(vals.min()):.4g} to {float(vals.max()):.4g})")


__all__ = ["ScalesOut", "fp8_scale", "kv_cache_config", "scale_tensor_names"]
