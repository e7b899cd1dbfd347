"""Prompt pieces shared by the long-context tasks (``needle``, ``ruler``): text to token ids, the chat template
around a user message with a hole for the context, and prose sentences of a corpus as token ids.

Prompts are assembled in token space: every piece (a sentence, a needle, a list item) is tokenized once on its own
(with its leading space or newline) and the pieces' ids are concatenated, so a prompt's length in tokens is the sum
of its pieces' lengths, exactly, whatever the tokenizer; the model reads those ids.

Helpers of the task modules (the leading underscore keeps the task registry from taking this for a task); no model
code, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kveval.errors import KvevalError

MARKER = "<<<KVEVAL-HAYSTACK>>>"
"""Where the context goes in a user message (replaced by the context's token ids)."""

PASSKEY_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
"""The repeated "noise" haystack of the passkey test (and of RULER's ``noise`` haystack, as one paragraph)."""

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def split_sentences(text: str, *, min_chars: int = 20, max_chars: int = 300) -> list[str]:
    """Prose sentences of ``text``: whitespace collapsed, split after . ! ? before a capital; fragments shorter
    than ``min_chars`` or longer than ``max_chars`` (code, tables) are dropped."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        for s in _SENTENCE_END.split(flat):
            if min_chars <= len(s) <= max_chars and s[-1] in ".!?" and not s.startswith((">>>", "...")):
                out.append(s)
    return out


def encode(tokenizer, text: str) -> list[int]:
    """Ids of ``text``; special tokens written in the text (chat markup) are recognised, none are added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_parts(tokenizer, user: str, answer_prefix: str, *, chat_template: bool = True) -> tuple[list[int], list[int]]:
    """The ids before and after the context of a prompt: ``(prefix_ids, suffix_ids)``.

    ``user`` is the user message with :data:`MARKER` where the context goes. With the tokenizer's chat template
    (when it has one and ``chat_template``), the message is the user turn and ``answer_prefix`` opens the
    assistant turn; without, ``user + "\\n" + answer_prefix`` after the BOS token (when the tokenizer has one).
    ``suffix_ids`` ends with the answer prefix, so that the answer follows directly.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        text = text + answer_prefix
        if text.count(MARKER) != 1:
            raise KvevalError("the tokenizer's chat template altered the prompt; set chat_template: false")
        before, after = text.split(MARKER)
        return encode(tokenizer, before), encode(tokenizer, after)
    before, after = f"{user}\n{answer_prefix}".split(MARKER)
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token", None) else []
    return bos + encode(tokenizer, before), encode(tokenizer, after)


class SentenceTokens:
    """Token ids of each sentence (with a leading ``separator``, a space by default), computed on first use and
    kept; indices wrap around (``st[len(st)]`` is ``st[0]``)."""

    def __init__(self, tokenizer, sentences: Iterable[str], separator: str = " "):
        self.sentences = list(sentences)
        if not self.sentences:
            raise KvevalError("the haystack corpus has no usable sentences")
        self.tokenizer = tokenizer
        self.separator = separator
        self._ids: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.sentences)

    def __getitem__(self, i: int) -> list[int]:
        i %= len(self.sentences)
        if i not in self._ids:
            self._ids[i] = encode(self.tokenizer, self.separator + self.sentences[i])
        return self._ids[i]


__all__ = ["MARKER", "PASSKEY_FILLER", "SentenceTokens", "chat_parts", "encode", "split_sentences"]
