"""Datasets of the local lm-eval tasks: JSONL files next to this module (found from ``__file__``, so the folder
works from any working directory, offline, without the ``datasets`` cache)."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    lines = (HERE / name).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def facts_mc(**_kwargs) -> datasets.DatasetDict:
    """32 four-way multiple-choice questions: {question, choices, answer (index)}."""
    return _load("facts_mc.jsonl")


def qa_gen(**_kwargs) -> datasets.DatasetDict:
    """16 short-answer questions: {question, answer}."""
    return _load("qa_gen.jsonl")


def _normalised(text: str) -> str:
    """Lower case without punctuation or spaces (kveval_qa_gen's exact match: ignore_case, ignore_punctuation)."""
    return "".join(ch for ch in str(text).lower() if ch.isalnum())


def sampled_answers(doc: dict, results: list) -> dict:
    """Every sample of a repeated generation request scored against ``doc["answer"]``: ``results`` is
    ``[[sample_1, ..., sample_k]]`` (one request, its k repeats, filters that keep them all). ``pass@1``: the
    share of right samples; ``pass@k``: 1 if any is right; ``maj@k``: 1 if the most frequent answer is right
    (a tie goes to the answer seen first)."""
    samples = results[0] if results and isinstance(results[0], (list, tuple)) else results
    if not samples:
        raise ValueError("sampled_answers got no samples")
    answers = [_normalised(s) for s in samples]
    right = _normalised(doc["answer"])
    counts: dict[str, int] = {}
    for a in answers:
        counts[a] = counts.get(a, 0) + 1
    majority = max(counts, key=lambda a: (counts[a], -answers.index(a)))
    hits = sum(a == right for a in answers)
    return {"pass@1": hits / len(answers), "pass@k": float(hits > 0), "maj@k": float(majority == right)}
