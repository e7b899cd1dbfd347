"""A session decoded turn by turn through one cache, as a serving engine with prefix caching runs it.

Token space: the first turn's ids are the chat template over the system prompt and the first user message
(:func:`first_turn_ids`); each later turn appends the template's text between an assistant answer and the next
user message's generation prompt (:func:`next_turn_ids`), after the previous answer's last generated token (the
model generated it but no step has fed it to the cache yet). The history a turn reads is therefore exactly the
tokens the model read and wrote before it, every earlier answer as the model generated it.

:class:`Conversation` holds one cache (the FP model's ``DynamicCache``, or a policy's real ``QuantizedKVCache``)
and the ids it holds: :meth:`~Conversation.feed` appends ids in one forward call (a turn's new tokens are one
prefill chunk onto the history, treated as the policy's preset says its engine treats a prefill), and
:meth:`~Conversation.greedy` decodes an answer one token a step. :meth:`~Conversation.fork` branches it (its own
copy of the cache, the model shared): the ``fp_history`` variant decodes the policy's answer on a branch and feeds
the FP model's answer to the trunk (:mod:`kveval.tasks.session.follow`).

NaN or infinity in the logits stops the run with one line naming the session and turn
(:mod:`kveval.tasks.common.finite`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from kveval.errors import KvevalError
from kveval.tasks.common.finite import check_finite_logits, finite_quantizer_inputs, quantized_by
from kveval.tasks.common.prompts import encode
from kveval.tasks.common.teacher import accepts, log_probs
from kveval.tasks.session.sessions import DOCUMENT, Session, score_turn

#: what stands for an answer while the template is rendered (replaced by the model's own tokens)
_ANSWER = "<<<KVEVAL-ANSWER>>>"


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _system(session: Session) -> list[dict]:
    return [{"role": "system", "content": session.system}] if session.system else []


def first_user_text(session: Session) -> str:
    """The first user message: the document in place of the marker, or before the text when there is none."""
    user = session.turns[0].user
    if DOCUMENT in user:
        return user.replace(DOCUMENT, session.context)
    return f"{session.context}\n\n{user}" if session.context else user


def first_turn_ids(tokenizer, session: Session) -> list[int]:
    """The ids of the system prompt and the first user turn, ending with the assistant's generation prompt."""
    messages = [*_system(session), {"role": "user", "content": first_user_text(session)}]
    return encode(tokenizer, _render(tokenizer, messages, generation_prompt=True))


def next_turn_ids(tokenizer, session: Session, user: str, ended_at_eos: str | None) -> list[int]:
    """The ids after an answer and up to the next answer: the template's end of the assistant turn (less the
    end-of-sequence text the model already generated, ``ended_at_eos``) and the user turn ``user`` with the
    generation prompt. Rendered around a placeholder answer, so any chat template gives its own separators."""
    messages = [*_system(session), {"role": "user", "content": "x"}, {"role": "assistant", "content": _ANSWER},
                {"role": "user", "content": user}]
    text = _render(tokenizer, messages, generation_prompt=True)
    if text.count(_ANSWER) != 1:
        raise KvevalError("session: the tokenizer's chat template altered an assistant answer; sessions need a "
                          "template that keeps the assistant's text as it is")
    after = text.split(_ANSWER, 1)[1]
    if ended_at_eos and after.startswith(ended_at_eos):
        after = after[len(ended_at_eos):]
    return encode(tokenizer, after)


def check_chat_template(tokenizer) -> None:
    """A model without a chat template is refused in one line (a session is a chat)."""
    if not getattr(tokenizer, "chat_template", None):
        raise KvevalError("tasks: session needs a chat model: this tokenizer has no chat template; use an instruct "
                          "model (the builtin SmolLM2-135M-Instruct has one)")


@dataclass
class Conversation:
    """One cache and the ids it holds (``ids``: every token fed so far, in order)."""

    model: torch.nn.Module
    cache: object
    policy: object = None
    where: str = "a session"
    ids: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, model, policy=None, *, where: str = "a session") -> Conversation:
        """An empty conversation: the FP model's ``DynamicCache`` (``policy=None``) or the policy's real cache."""
        from transformers import DynamicCache

        from kveval.patch import QuantizedKVCache

        cache = DynamicCache(config=model.config) if policy is None else QuantizedKVCache(model, policy,
                                                                                         read="buffered")
        return cls(model, cache, policy, where)

    def feed(self, ids: list[int], *, at: str = "") -> torch.Tensor:
        """Feed ``ids`` in one forward call; the logits of the last position ``[vocab]`` (checked finite)."""
        from kveval.patch import cache_kwargs

        model = self.model
        start = len(self.ids)
        x = torch.tensor([ids], device=model.device)
        kwargs = dict(cache_kwargs(model, self.cache), use_cache=True)
        if accepts(model, "logits_to_keep"):
            kwargs["logits_to_keep"] = 1
        if accepts(model, "position_ids"):
            kwargs["position_ids"] = torch.arange(start, start + len(ids), device=model.device)[None]
        who = quantized_by(self.policy)
        where = f"{self.where}{at}"
        with finite_quantizer_inputs(where, who or "the full-precision model"), torch.no_grad():
            logits = model(x, **kwargs).logits[0, -1]
        check_finite_logits(logits[None], where=where, dtype=model.dtype, quantized_by=who)
        self.ids.extend(ids)
        return logits

    def fork(self) -> Conversation:
        """A branch of this conversation: its own copy of the cache and ids (the model shared, never copied)."""
        cache = copy.deepcopy(self.cache) if self.policy is None else self.cache.fork(self.model)
        return Conversation(self.model, cache, self.policy, self.where, list(self.ids))

    def greedy(self, logits: torch.Tensor, max_new_tokens: int, eos_ids: set[int], *, at: str = "") -> list[int]:
        """Greedy tokens from ``logits`` (the last fed position's): up to and including the first end-of-sequence
        id, at most ``max_new_tokens``. Every token but the last is fed (the last is the next turn's first)."""
        tokens: list[int] = []
        for step in range(max_new_tokens):
            token = int(logits.float().argmax())
            tokens.append(token)
            if token in eos_ids or step == max_new_tokens - 1:
                break
            logits = self.feed([token], at=f"{at} (step {step})")
        return tokens


def ended_at_eos(tokenizer, tokens: list[int], eos: set[int]) -> str | None:
    """The text of the end-of-sequence token an answer ended with, None when it ran out of tokens."""
    return tokenizer.decode([tokens[-1]]) if tokens and tokens[-1] in eos else None


def turn_ids(tokenizer, session: Session, j: int, previous: list[int] | None, eos: set[int]) -> list[int]:
    """The new ids of turn ``j``: the first turn's (:func:`first_turn_ids`), or those after the previous answer's
    tokens ``previous`` (:func:`next_turn_ids`), then the turn's answer prefix."""
    turn = session.turns[j]
    ids = first_turn_ids(tokenizer, session) if j == 0 else next_turn_ids(
        tokenizer, session, turn.user, ended_at_eos(tokenizer, previous or [], eos))
    return ids + (encode(tokenizer, turn.prefix) if turn.prefix else [])


def turn_record(tokenizer, session: Session, j: int, fed: list[int], tokens: list[int], depth: int,
                answers: list[str]) -> dict:
    """One turn's part of a record: the ids fed (the turn's prefix last), the generated ids and their text, the
    history depth (the ids before ``fed``'s new ones), the scores (``answers``: the conversation's earlier
    generated texts, for ``own_number``)."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    scores = score_turn(session.turns[j], text, answers, suffix=session.suffix, sentences=session.sentences)
    return {"turn": j, "kind": session.turns[j].kind, "depth": depth, "fed": fed, "tokens": tokens, "text": text,
            **scores}


def kld(fp_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(P_fp || P) in nats of two next-token logits ``[vocab]`` (float64 sum of float32 log-softmaxes)."""
    a, b = log_probs(fp_logits), log_probs(logits)
    return float((a.exp() * (a - b)).sum())


__all__ = ["Conversation", "check_chat_template", "ended_at_eos", "first_turn_ids", "first_user_text", "kld",
           "next_turn_ids", "turn_ids", "turn_record"]
