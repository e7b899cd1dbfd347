"""The calibration feature (``kveval calibrate``, ``scales: auto``): static K/V ranges from a corpus slice.

- ``ranges``: absmax / percentile / mse ranges per tensor, head and channel (pure tensor maths);
- ``scales_file``: the scales file (safetensors + a JSON header) and its checks against a model;
- ``collect``: hooks that collect every layer's keys (post- and pre-RoPE) and values through attention;
- ``calibrate``: the calibration run itself (slice of the corpus, windows, collection, ranges, file).
"""
