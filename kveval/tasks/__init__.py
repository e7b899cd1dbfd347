"""Evaluators, one per file. Each exposes ``run(ctx, params) -> metrics`` and is registered here by task name."""

from kveval.tasks import perplexity

TASKS = {"perplexity": perplexity.run}
