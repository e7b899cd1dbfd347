"""Evaluators, one per file, registered here by task name.

Each module exposes ``run(ctx, params) -> metrics`` and optionally ``check(ctx, params)``, which raises
``KvevalError`` for bad input before the results folder is touched.
"""

from kveval.tasks import perplexity

TASKS = {"perplexity": perplexity}
