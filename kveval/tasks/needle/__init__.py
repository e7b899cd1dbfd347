"""The needle task: passkey / needle-in-a-haystack retrieval (``prompts``: the prompt builder; ``task``: the
evaluator)."""
