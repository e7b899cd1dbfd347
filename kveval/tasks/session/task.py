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
  FP answers (per turn: mean and max), both caches teacher-forced on the same tokens. A session's baseline and
  its ``fp_history`` runs are decoded together (:mod:`kveval.tasks.session.follow`).

One unit and one record per (session, policy or baseline, variant), with every turn's answer ids, text, scores and
history depth; a session killed mid-way is decoded again from its start on resume (a session's baseline and
``fp_history`` records are written together, after its last turn). The metrics come from the
records alone (:mod:`kveval.tasks.session.aggregate`).
"""

from __future__ import annotations

from collections.abc import Iterator

from kveval.errors import KvevalError
from kveval.results.layout import BASELINE
from kveval.tasks.common.runner import Unit, Work, run_units
from kveval.tasks.session.aggregate import aggregate
from kveval.tasks.session.conversation import (
    Conversation,
    check_chat_template,
    turn_ids,
    turn_record,
)
from kveval.tasks.session.follow import follow_session
from kveval.tasks.session.params import NAME, Params
from kveval.tasks.session.sessions import Session, builtin_sessions, load_sessions

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
    return builtin_sessions(params.sessions_per_size, ctx.cache[key], params.context_sentences, seed=ctx.cfg.seed,
                            prefills=params.prefills)


def check(ctx, params: Params) -> None:
    """Input errors before anything is written: a model without a chat template, a first turn (system prompt,
    document and question) plus the answers of every turn beyond the model's context."""
    from kveval.models import model_context_limit

    check_chat_template(ctx.tokenizer)
    limit = model_context_limit(ctx.model)
    for s in session_set(ctx, params):
        first = len(turn_ids(ctx.tokenizer, s, 0, None, set()))
        later = sum(len(turn_ids(ctx.tokenizer, s, j, None, set())) for j in range(1, len(s.turns)))
        need = first + later + len(s.turns) * params.max_new_tokens
        if need > limit:
            raise KvevalError(f"tasks: session '{s.id}' needs up to {need} tokens (its turns plus max_new_tokens "
                              f"{params.max_new_tokens} per answer), more than the model's context ({limit}); "
                              "shorten it or lower max_new_tokens")


def run(ctx, params: Params) -> dict:
    """Decode every (session, policy or baseline, variant) not yet recorded, then aggregate every record. A
    session's baseline and its ``fp_history`` runs are one batch (:func:`follow_session`: the FP conversation
    decoded once, the policies' caches fed along it); ``reuse`` and ``reprefill`` run one at a time."""
    from kveval.tasks.common.decoding import eos_token_ids

    sessions = session_set(ctx, params)
    by_id = {s.id: s for s in sessions}
    follow = [name for name in ctx.policies if "fp_history" in params.variants]
    own = [(name, v) for name in ctx.policies for v in params.variants if v != "fp_history"]
    units = [Unit(record_key(s.id, who, v), (s.id, who, v), batch=("follow", s.id), steps=len(s.turns),
                  amount=len(s.turns))
             for s in sessions for who, v in [(BASELINE, FP)] + [(name, "fp_history") for name in follow]]
    units += [Unit(record_key(s.id, who, v), (s.id, who, v), steps=len(s.turns), amount=len(s.turns))
              for who, v in own for s in sessions]
    eos = eos_token_ids(ctx.model, ctx.tokenizer)

    def evaluate(batch: list[Unit], _prepared) -> Iterator[dict]:
        sid, who, variant = batch[0].item
        session = by_id[sid]
        if variant in (FP, "fp_history"):
            todo = [u for u in batch if u.item[1] != BASELINE]
            replay = None if len(todo) < len(batch) else _fp_record(ctx, sid)["turns"]
            fp_turns, turns = follow_session(ctx, session, {u.item[1]: ctx.policies[u.item[1]] for u in todo},
                                             replay, params.max_new_tokens, eos)
            if replay is None:
                yield _record(record_key(sid, BASELINE, FP), sid, BASELINE, FP, fp_turns)
            for u in todo:
                yield _record(u.key, sid, u.item[1], "fp_history", turns[u.item[1]])
            return
        turns = _decode(ctx, params, session, ctx.policies[who], eos, f"session '{sid}' of {who} ({variant})",
                        reprefill=variant == "reprefill")
        yield _record(batch[0].key, sid, who, variant, turns)

    run_units(ctx, NAME, units, Work(label="session", noun="session runs", evaluate=evaluate, rate_unit="turn",
                                     batch_size=lambda b: None if b else 1))
    return aggregate(ctx.run.records(), sessions, list(ctx.policies), params)


def _record(key: str, sid: str, who: str, variant: str, turns: list[dict]) -> dict:
    return {"key": key, "task": NAME, "session": sid, "policy": who, "variant": variant, "turns": turns}


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


def _decode(ctx, params: Params, session: Session, policy, eos: set[int], where: str, *,
            reprefill: bool) -> list[dict]:
    """The session through one cache (``reuse``) or a fresh cache a turn (``reprefill``)."""
    tok = ctx.tokenizer
    conv = Conversation.start(ctx.model, policy, where=where)
    history: list[int] = []  # every id the model read or wrote before the current turn, in order
    out: list[dict] = []
    answers: list[str] = []
    last: list[int] = []  # the previous answer's last token: generated, not fed yet
    for j in range(len(session.turns)):
        fed = last + turn_ids(tok, session, j, out[-1]["tokens"] if out else None, eos)
        depth = len(history) + len(last)
        if reprefill:
            conv = Conversation.start(ctx.model, policy, where=where)
            logits = conv.feed(history + fed, at=f", turn {j}")
        else:
            logits = conv.feed(fed, at=f", turn {j}")
        tokens = conv.greedy(logits, params.max_new_tokens, eos, at=f", turn {j}")
        rec = turn_record(tok, session, j, fed, tokens, depth, answers)
        out.append(rec)
        answers.append(rec["text"])
        history += fed + tokens[:-1]
        last = tokens[-1:]
    return out
