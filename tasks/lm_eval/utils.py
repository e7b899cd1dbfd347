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
