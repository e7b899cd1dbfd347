"""The calibration feature (``kveval calibrate``, ``scales: auto``): static K/V ranges from a corpus slice, written
as a scales file (:mod:`kveval.scales`).

- ``collect``: hooks that collect every layer's keys (post- and pre-RoPE) and values through attention;
- ``calibrate``: the calibration run itself (slice of the corpus, windows, collection, ranges, file);
- ``checks``: what a run checks of its policies' scales before its first forward pass, ``scales: auto``, and the
  checkpoint scales engine presets take by default (``scales: checkpoint``);
- ``export``: the checkpoint folder ``kveval calibrate --export compressed-tensors DIR`` writes.
"""
