"""Calibrated (static) quantizer parameters as data: what a calibration produces and how a policy reads it back.

- ``ranges``: absmax / percentile / mse ranges per tensor, head and channel (pure tensor maths);
- ``codebooks``: KVQuant's per-layer non-uniform codebooks, fitted by Fisher-weighted k-means (pure maths);
- ``ema``: llm-compressor's moving-average min/max observer (``calibration.method: minmax_ema``, pure maths);
- ``file``: the scales file (safetensors + a JSON header), ``load_scales`` and its checks against a model;
- ``checkpoint``: the KV scales a checkpoint ships (compressed-tensors ``kv_cache_scheme``, ModelOpt
  ``kv_cache_quant_algo``), read as each engine loads them behind the scales file's interface; beside it
  ``kv_scheme`` (the declared scheme, read from the checkpoint's config), ``checkpoint_tensors`` (finding and
  reading the scale tensors in its safetensors shards), ``engine_loading`` (how each engine loads them) and
  ``compressed_tensors_export`` (the compressed-tensors config and tensors written back).

The calibration run that writes a scales file (corpus slice, K/V collection through the model) is
:mod:`kveval.calibration`; the quantizers that read one are :mod:`kveval.patch.quantizers`.
"""
