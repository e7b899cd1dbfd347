"""The lm-eval task: lm-evaluation-harness tasks under a KV policy (``bridge``: the lm-eval model class;
``task``: the evaluator)."""
