"""The session task: multi-turn conversations whose history stays in the quantized cache.

Each session (:mod:`kveval.tasks.session.sessions`) is decoded turn by turn (:mod:`kveval.tasks.session.conversation`):
the FP baseline through the FP model's ``DynamicCache``, each policy through its real ``QuantizedKVCache``, per
variant of the config:

- ``reuse`` (default): one cache for the whole session; each new user turn is prefilled onto it, so every earlier
  turn (the user's text and the model's own answers) is read back quantized, as an engine with prefix caching
  serves it;
- ``reprefill``: each turn prefills the whole history (the policy's own answers) into a fresh cache, as an engine
  without prefix caching does; its difference from ``reuse`` is what reusing the quantized history costs;
- ``fp_history``: the FP model's own conversation is the history (fed to the policy's cache exactly as ``reuse``
  would feed it: user turns as prefill chunks, the FP answers token by token), and the policy answers each turn
  on a branch of that cache: a control that separates the cache's error from a conversation that has already
  drifted. Its record also holds the KLD of the policy's next-token distributions from the FP model's along the
  FP answers (per turn: mean and max), both caches teacher-forced on the same tokens.

One unit and one record per (session, policy or baseline, variant), with every turn's answer ids, text, scores and
history depth; a session killed mid-way is decoded again from its start on resume. The metrics come from the
records alone (:mod:`kveval.tasks.session.aggregate`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from kveval.errors import KvevalError
from kveval.results.layout import BASELINE
from kveval.tasks.common.runner import Unit, Work, run_units
from kveval.tasks.session.aggregate import aggregate
from kveval.tasks.session.conversation import (
    Conversation,
    check_chat_template,
    first_turn_ids,
    kld,
    next_turn_ids,
)
from kveval.tasks.session.params import NAME, Params
from kveval.tasks.session.sessions import Session, builtin_sessions, load_sessions, score_turn

__all__ = ["NAME", "Params", "aggregate", "check", "run"]

#: the baseline's variant: the FP model's own session (the same in every variant)
FP = "fp"


def record_key(session: str, who: str, variant: str) -> str:
    """``session/<session>/<policy or baseline>/<variant>``."""
    return f"{NAME}/{session}/{who}/{variant}"


def session_set(ctx, params: Params) -> list[Session]:
    """The run's sessions: the builtin set (documents of the run's corpus sentences) or the JSONL file."""
    if params.sessions != "builtin":
        return load_sessions(params.sessions)
    key = "session_filler"
    if key not in ctx.cache:
        from kveval.data import load_text
        from kveval.tasks.common.prompts import split_sentences

        d = ctx.cfg.data
        ctx.cache[key] = split_sentences(load_text(d.source, split=d.split, text_field=d.text_field))
    return builtin_sessions(params.sessions_per_size, ctx.cache[key], params.context_sentences, seed=ctx.cfg.seed)


def check(ctx, params: Params) -> None:
    """Input errors before anything is written: a model without a chat template, a first turn (system prompt,
    document and question) plus the answers of every turn beyond the model's context."""
    from kveval.models import model_context_limit

    check_chat_template(ctx.tokenizer)
    limit = model_context_limit(ctx.model)
    for s in session_set(ctx, params):
        first = len(first_turn_ids(ctx.tokenizer, s))
        later = sum(len(next_turn_ids(ctx.tokenizer, s, t.user, None)) for t in s.turns[1:])
        need = first + later + len(s.turns) * params.max_new_tokens
        if need > limit:
            raise KvevalError(f"tasks: session '{s.id}' needs up to {need} tokens (its turns plus max_new_tokens "
                              f"{params.max_new_tokens} per answer), more than the model's context ({limit}); "
                              "shorten it or lower max_new_tokens")


def run(ctx, params: Params) -> dict:
    """Decode every (session, policy or baseline, variant) not yet recorded, baseline first (``fp_history`` reads
    its conversations), then aggregate every record."""
    from kveval.tasks.common.decoding import eos_token_ids

    sessions = session_set(ctx, params)
    by_id = {s.id: s for s in sessions}
    runs = [(BASELINE, FP)] + [(name, v) for name in ctx.policies for v in params.variants]
    units = [Unit(record_key(s.id, who, v), (s.id, who, v), steps=len(s.turns), amount=len(s.turns))
             for who, v in runs for s in sessions]
    eos = eos_token_ids(ctx.model, ctx.tokenizer)

    def evaluate(batch: list[Unit], _prepared) -> Iterator[dict]:
        for unit in batch:
            sid, who, variant = unit.item
            session = by_id[sid]
            policy = None if who == BASELINE else ctx.policies[who]
            where = f"session '{sid}' of {who} ({variant})"
            if variant == "fp_history":
                turns = _fp_history(ctx, params, session, policy, _fp_record(ctx, sid), eos, where)
            else:
                turns = _decode(ctx, params, session, policy, eos, where, reprefill=variant == "reprefill")
            yield {"key": unit.key, "task": NAME, "session": sid, "policy": who, "variant": variant,
                   "turns": turns}

    run_units(ctx, NAME, units, Work(label="session", noun="session runs", evaluate=evaluate, rate_unit="turn"))
    return aggregate(ctx.run.records(), sessions, list(ctx.policies), params)


def _fp_record(ctx, sid: str) -> dict:
    """The baseline's record of session ``sid`` (written before any policy's), its turns checked."""
    for r in ctx.run.records():
        if r.get("task") == NAME and r.get("session") == sid and r.get("policy") == BASELINE:
            turns = r.get("turns")
            if isinstance(turns, list) and all(isinstance(t, dict) and isinstance(t.get("fed"), list)
                                               and isinstance(t.get("tokens"), list) for t in turns):
                return r
    raise KvevalError(f"records.jsonl: no valid baseline record of session '{sid}' (the FP history fp_history "
                      f"reads); delete the line of key '{record_key(sid, BASELINE, FP)}' to decode it again")


def _ended(tokenizer, tokens: list[int], eos: set[int]) -> str | None:
    """The text of the end-of-sequence token an answer ended with, None when it ran out of tokens."""
    return tokenizer.decode([tokens[-1]]) if tokens and tokens[-1] in eos else None


def _turn_record(ctx, session: Session, j: int, fed: list[int], tokens: list[int], depth: int,
                 answers: list[str]) -> dict:
    """One turn's part of a record: the ids fed, the answer's ids and text, the history depth, the scores."""
    text = ctx.tokenizer.decode(tokens, skip_special_tokens=True)
    scores = score_turn(session.turns[j], text, session.suffix, answers)
    return {"turn": j, "kind": session.turns[j].kind, "depth": depth, "fed": fed, "tokens": tokens, "text": text,
            **scores}


def _decode(ctx, params: Params, session: Session, policy, eos: set[int], where: str, *,
            reprefill: bool) -> list[dict]:
    """The session through one cache (``reuse``; the baseline) or a fresh cache a turn (``reprefill``)."""
    tok = ctx.tokenizer
    conv = Conversation.start(ctx.model, policy, where=where)
    history: list[int] = []  # every id the model read or wrote before the current turn, in order
    out: list[dict] = []
    answers: list[str] = []
    last: list[int] = []  # the previous answer's last token: generated, not fed yet
    for j, turn in enumerate(session.turns):
        new = first_turn_ids(tok, session) if j == 0 else next_turn_ids(tok, session, turn.user,
                                                                      _ended(tok, out[-1]["tokens"], eos))
        fed = last + new
        depth = len(history) + len(last)
        if reprefill:
            conv = Conversation.start(ctx.model, policy, where=where)
            logits = conv.feed(history + fed, at=f", turn {j}")
        else:
            logits = conv.feed(fed, at=f", turn {j}")
        tokens = conv.greedy(logits, params.max_new_tokens, eos, at=f", turn {j}")
        rec = _turn_record(ctx, session, j, fed, tokens, depth, answers)
        out.append(rec)
        answers.append(rec["text"])
        history += fed + tokens[:-1]
        last = tokens[-1:]
    return out


def _fp_history(ctx, params: Params, session: Session, policy, fp: dict, eos: set[int], where: str) -> list[dict]:
    """The policy's answers with the FP model's conversation as the history, and its KLD along the FP answers:
    the FP cache and the policy's cache fed the same ids (each turn's new ids as one chunk, then the FP answer
    token by token); per turn the policy answers on a branch of its cache."""
    fp_conv = Conversation.start(ctx.model, None, where=where)
    conv = Conversation.start(ctx.model, policy, where=where)
    out: list[dict] = []
    fp_answers = [t["text"] for t in fp["turns"]]
    for j, fp_turn in enumerate(fp["turns"][: len(session.turns)]):
        fed, fp_tokens = [int(t) for t in fp_turn["fed"]], [int(t) for t in fp_turn["tokens"]]
        depth = len(conv.ids) + (1 if j else 0)  # the history before this turn's new ids, as _decode counts it
        at = f", turn {j}"
        lf, lp = fp_conv.feed(fed, at=at), conv.feed(fed, at=at)
        tokens = copy.deepcopy(conv).greedy(lp, params.max_new_tokens, eos, at=f"{at} (branch)")
        klds = [kld(lf, lp)]
        for t in fp_tokens[:-1]:  # the FP answer, token by token, into both caches
            lf, lp = fp_conv.feed([t], at=at), conv.feed([t], at=at)
            klds.append(kld(lf, lp))
        rec = _turn_record(ctx, session, j, fed, tokens, depth, fp_answers)
        rec["kld_mean"], rec["kld_max"] = sum(klds) / len(klds), max(klds)
        out.append(rec)
    return out
