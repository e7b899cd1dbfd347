"""The sensitivity feature: the per-layer, per-K/V scan (``scan``: prefix reuse and the naive reference;
``task``: the evaluator) and the mixed-precision planner under a memory budget (``planner``)."""
