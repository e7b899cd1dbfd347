"""Calibrated (static) quantizer parameters as data: what a calibration produces and how a policy reads it back.

- ``ranges``: absmax / percentile / mse ranges per tensor, head and channel (pure tensor maths);
- ``codebooks``: KVQuant's per-layer non-uniform codebooks, fitted by Fisher-weighted k-means (pure maths);
- ``file``: the scales file (safetensors + a JSON header), ``load_scales`` and its checks against a model.

The calibration run that writes a scales file (corpus slice, K/V collection through the model) is
:mod:`kveval.calibration`; the quantizers that read one are :mod:`kveval.patch.quantizers`.
"""
