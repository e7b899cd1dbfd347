"""The ruler task: a RULER-style synthetic long-context suite (``prompts``: the families' prompt builders;
``scoring``: RULER's string-match scores; ``words``: the word lists; ``task``: the evaluator)."""
