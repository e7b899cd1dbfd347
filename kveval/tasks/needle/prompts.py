"""Retrieval prompts: a needle sentence hidden at a token depth inside a haystack, at an exact token count.

Pure prompt construction (a tokenizer, no model)::

    spec = make_spec("passkey", trial_rng(seed=0, variant="passkey", context=2048, depth=0.5, trial=1))
    p = build_prompt(tok, spec, prompt_tokens=2040, depth=0.5, sentences=PASSKEY_FILLER, start=0)
    len(p.input_ids) == 2040                    # exactly; the haystack absorbs the rest of the budget
    p.input_ids[p.needle_start : p.needle_start + p.needle_len] == p.needle_ids
    p.answer_ids                                # the answer's tokens as they follow the prompt (" 71432")

Layout (chat template applied when the tokenizer has one)::

    [template prefix] instruction "\\n\\n" [haystack: filler sentences with the needle between two of them]
    "\\n\\n" question [template: end of user turn, start of assistant turn] answer_prefix | answer

The prompt ends with an answer prefix ("The pass key is"), as RULER does, so that the answer is the very next
tokens: generation is scored by exact match, and the same answer tokens are scored teacher-forced.

Depth: the needle goes at the sentence boundary of the filler nearest to ``depth * F`` where F is the number of
filler tokens (0: before the first filler sentence, 1: after the last one). The haystack is assembled in token
space (each sentence tokenized once, with a leading space), so the count is exact by construction and the needle
and the answer are never cut; only the first filler sentence may lose its beginning to hit the count (the
haystack reads as an excerpt), so every place the needle can go is a true sentence boundary.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kveval.errors import KvevalError
from kveval.tasks.common.prompts import MARKER, PASSKEY_FILLER, SentenceTokens, chat_parts, split_sentences
from kveval.tasks.common.prompts import encode as _encode

CITIES = (
    "Amsterdam", "Athens", "Bangkok", "Barcelona", "Berlin", "Bogota", "Boston", "Brussels", "Budapest", "Cairo",
    "Chicago", "Copenhagen", "Dublin", "Edinburgh", "Florence", "Geneva", "Hamburg", "Helsinki", "Istanbul",
    "Jakarta", "Kyoto", "Lagos", "Lima", "Lisbon", "London", "Madrid", "Manila", "Melbourne", "Montreal", "Mumbai",
    "Munich", "Nairobi", "Oslo", "Paris", "Prague", "Rome", "Santiago", "Seoul", "Stockholm", "Sydney", "Toronto",
    "Vienna", "Warsaw", "Zurich",
)


@dataclass(frozen=True)
class NeedleSpec:
    """One trial's texts: what is hidden (``needle``), what is asked, and the expected ``answer``."""

    variant: str
    instruction: str
    needle: str
    question: str
    answer_prefix: str
    answer: str


@dataclass(frozen=True)
class NeedlePrompt:
    """A built prompt. Token indices are into ``input_ids``; ``target`` is ``depth * filler_tokens`` (haystack
    coordinates), ``needle_start - haystack_start`` the boundary actually chosen."""

    input_ids: list[int]
    answer_ids: list[int]
    needle_ids: list[int]
    needle_start: int
    haystack_start: int
    haystack_len: int
    filler_tokens: int
    target: float

    @property
    def needle_len(self) -> int:
        return len(self.needle_ids)


def trial_rng(*, seed: int, variant: str, context: int, depth: float, trial: int) -> random.Random:
    """A generator of its own per (seed, variant, cell, trial): fresh values in every cell, the same on every
    rerun (string seeds are hashed with SHA-512 by ``random``, independent of PYTHONHASHSEED)."""
    return random.Random(f"kveval-needle|{seed}|{variant}|{context}|{depth!r}|{trial}")


def _passkey(rng: random.Random) -> NeedleSpec:
    key = str(rng.randint(10000, 99999))
    return NeedleSpec(
        variant="passkey",
        instruction=(
            "There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the important information there."
        ),
        needle=f"The pass key is {key}. Remember it. {key} is the pass key.",
        question="What is the pass key?",
        answer_prefix="The pass key is",
        answer=key,
    )


def _needle(rng: random.Random) -> NeedleSpec:
    city = rng.choice(CITIES)
    value = str(rng.randint(1000000, 9999999))
    return NeedleSpec(
        variant="needle",
        instruction=(
            "A special magic number is hidden inside the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards."
        ),
        needle=f"The special magic number for {city} is {value}.",
        question=f"What is the special magic number for {city} mentioned in the provided text?",
        answer_prefix=f"The special magic number for {city} mentioned in the provided text is",
        answer=value,
    )


VARIANTS = {"passkey": _passkey, "needle": _needle}
"""variant -> a function of a seeded ``random.Random`` giving the trial's ``NeedleSpec``."""


def make_spec(variant: str, rng: random.Random) -> NeedleSpec:
    if variant not in VARIANTS:
        raise KvevalError(f"unknown needle variant '{variant}' (variants: {', '.join(VARIANTS)})")
    return VARIANTS[variant](rng)


def template_parts(tokenizer, spec: NeedleSpec, *, chat_template: bool = True) -> tuple[list[int], list[int]]:
    """The ids before and after the haystack: ``(prefix_ids, suffix_ids)``; ``suffix_ids`` ends with the answer
    prefix, so that the answer follows directly (:func:`kveval.tasks.common.prompts.chat_parts`)."""
    user = f"{spec.instruction}\n\n{MARKER}\n\n{spec.question}"
    return chat_parts(tokenizer, user, spec.answer_prefix, chat_template=chat_template)


def build_prompt(
    tokenizer, spec: NeedleSpec, *, prompt_tokens: int, depth: float, sentences: SentenceTokens | list[str],
    start: int = 0, chat_template: bool = True,
) -> NeedlePrompt:
    """The prompt of exactly ``prompt_tokens`` ids with the needle at ``depth`` (0..1) of the haystack.

    Filler sentences are taken in order from ``start`` (cycling). Raises ``KvevalError`` when the instruction,
    question and needle alone do not fit.
    """
    if not 0.0 <= depth <= 1.0:
        raise KvevalError(f"needle depth must be within [0, 1], got {depth}")
    toks = sentences if isinstance(sentences, SentenceTokens) else SentenceTokens(tokenizer, sentences)
    prefix, suffix = template_parts(tokenizer, spec, chat_template=chat_template)
    needle = _encode(tokenizer, " " + spec.needle)
    answer = _encode(tokenizer, " " + spec.answer)
    fixed = len(prefix) + len(suffix) + len(needle)
    filler_budget = prompt_tokens - fixed
    if filler_budget < 0:
        raise KvevalError(
            f"a prompt of {prompt_tokens} tokens cannot hold the instruction, question and needle ({fixed} tokens); "
            "use longer context_lengths"
        )
    pieces: list[list[int]] = []
    total, i = 0, start
    while total < filler_budget:
        pieces.append(toks[i])
        total += len(pieces[-1])
        i += 1
    # cut the surplus from the front (the haystack opens mid-sentence, like an excerpt), so that every place the
    # needle can go, the end included, is a true sentence boundary
    excess = total - filler_budget
    filler = [t for piece in pieces for t in piece][excess:]
    bounds, end = [0], 0
    for piece in pieces:
        end += len(piece)
        if end - excess > 0:
            bounds.append(end - excess)
    target = depth * filler_budget
    cut = min(bounds, key=lambda b: (abs(b - target), b))
    haystack = filler[:cut] + needle + filler[cut:]
    ids = prefix + haystack + suffix
    assert len(ids) == prompt_tokens
    return NeedlePrompt(
        input_ids=ids, answer_ids=answer, needle_ids=needle, needle_start=len(prefix) + cut,
        haystack_start=len(prefix), haystack_len=len(haystack), filler_tokens=filler_budget, target=target,
    )


def _normalise(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def exact_match(generated: str, answer: str) -> bool:
    """Whether ``answer`` appears in ``generated``, anywhere in a sentence.

    Numbers: some run of digits in the text equals the answer (commas between digits ignored: "71,432"), so
    "The pass key is 71432." matches 71432 but "714320" does not. Text: case, punctuation and whitespace are
    normalised and the answer must appear as whole words.
    """
    answer = answer.strip()
    if answer.isdigit():
        digits = re.sub(r"(?<=\d),(?=\d)", "", generated)
        return answer in re.findall(r"\d+", digits)
    norm = _normalise(answer)
    return bool(norm) and f" {norm} " in f" {_normalise(generated)} "


# PASSKEY_FILLER, SentenceTokens, split_sentences: kveval.tasks.common.prompts (shared with the ruler task), named here too
__all__ = ["CITIES", "MARKER", "PASSKEY_FILLER", "VARIANTS", "NeedlePrompt", "NeedleSpec", "SentenceTokens",
           "build_prompt", "exact_match", "make_spec", "split_sentences", "template_parts", "trial_rng"]
