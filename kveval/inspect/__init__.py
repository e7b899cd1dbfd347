"""``kveval inspect``: from forward passes of the full-precision model alone, where a model's keys and values will
break a format, why, and what to choose instead (docs/inspect.md).

One concern a module, in the order they run:

- ``capture.py``: one window's forward pass, keeping each attention layer's queries, keys (post- and pre-RoPE),
  values, its full-precision output and the call's arguments, and the residual stream entering each layer.
- ``distributions.py``: pure statistics of the captured tensors (per layer, KV head and channel: absolute maxima,
  offsets, kurtosis, outlier channels, dominant tokens, the attention mass on the first tokens).
- ``variants.py``: the candidate policies and the changes a finding may suggest (asymmetric, smaller groups, a
  rotation, sink tokens, K8/V4), each a policy in config form.
- ``measure.py``: what a policy does to the captured tensors without another model pass: the reconstruction error
  of K and V, the error of the attention logits and of the attention output per layer and head, through the
  emulation's own attention call (its schedule: sinks and residual windows).
- ``findings.py``: the findings in words, each with its evidence and a runnable ``kveval run`` line.
- ``predict.py``: the predicted per-layer, per-K/V sensitivity (a scan's ``sensitivity`` section, marked as a
  prediction) and its rank correlation with a measured scan.
- ``document.py``: ``inspect.json``'s summary and the report section.
"""
