"""The perplexity task: PPL, KL divergence and top-1 agreement against the full-precision model (``params``: its
parameters; ``task``: the evaluator)."""
