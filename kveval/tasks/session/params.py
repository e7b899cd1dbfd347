"""The session task's parameters (light: a config imports this, not the evaluator)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kveval.schema import Strict

NAME = "session"
VARIANTS = ("reuse", "reprefill", "fp_history")


class Params(Strict):
    """Multi-turn sessions decoded turn by turn through the quantized cache (history reused as an engine with
    prefix caching reuses it): accuracy by turn and history depth, tool-call validity, instruction persistence."""

    sessions: str = "builtin"  # "builtin" (procedural sessions) or a JSONL file of sessions (docs/sessions.md)
    sessions_per_size: int = Field(4, gt=0, le=10_000)  # builtin: sessions of each document size
    context_sentences: list[int] = Field(default_factory=lambda: [0, 16, 64], min_length=1)  # builtin: document sizes (corpus sentences)
    prefills: bool = True  # builtin: open each answer with its turn's prefill; false: a chat model needing none
    variants: list[Literal["reuse", "reprefill", "fp_history"]] = Field(default_factory=lambda: ["reuse"], min_length=1)
    max_new_tokens: int = Field(48, gt=0, le=4096)  # per answer
    depth_buckets: list[int] = Field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
                                     min_length=1)  # upper edges (tokens of history before a turn)
    max_drop: float = Field(5.0, gt=0, le=100)  # accuracy points a policy may lose before it fails
    examples: int = Field(2, ge=0, le=100)  # per policy and variant: earliest failing turns shown in the report

    def input_files(self) -> dict[str, str]:
        """The files this task reads (:func:`kveval.config.input_files`: the run folder records their digests and
        refuses to resume on a changed one): the session file, unless ``builtin``."""
        return {} if self.sessions == "builtin" else {"sessions": self.sessions}

    @property
    def seq_len(self) -> int:
        """The memory bill's context: the deepest history bucket a session is scored at."""
        return max(self.depth_buckets)

    @property
    def context_needed(self) -> tuple[int, str]:
        """(tokens of context the config alone proves a run needs, the field): one answer. The buckets are where
        turns are counted, not a length a run needs; a session's own length (its turns through the chat template,
        its answers) is the task's check once the tokenizer is loaded."""
        return self.max_new_tokens, "max_new_tokens"


def check_inputs(params: Params, *, allow_code: bool) -> None:
    """The config's input check (``kveval validate`` and ``kveval run``): a session file kveval cannot use is one
    line naming the file and line; depth buckets must rise; variants once each."""
    from kveval.errors import KvevalError

    if any(b <= a for a, b in zip(params.depth_buckets, params.depth_buckets[1:])) or params.depth_buckets[0] < 1:
        raise KvevalError("tasks: session.depth_buckets must be rising token counts, each at least 1")
    if len(set(params.variants)) != len(params.variants):
        raise KvevalError("tasks: session.variants names a variant twice; name each once")
    if params.sessions != "builtin":
        from kveval.tasks.session.sessions import load_sessions

        load_sessions(params.sessions)
