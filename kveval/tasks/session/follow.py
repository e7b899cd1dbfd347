"""The FP conversation and the policies that follow it: a session's baseline and every policy's ``fp_history``
variant, decoded together.

The FP model decodes the session greedily through its ``DynamicCache`` (or replays its recorded conversation when
the baseline is already recorded). Each policy's cache, its *trunk*, is fed the same ids in the same calls: a
turn's new ids as one prefill chunk, then the FP answer token by token; at every position of the FP answer the KL
divergence of the policy's next-token distribution from the FP model's is taken. The policy's own answer to the
turn (what ``fp_history`` scores) is its greedy decoding from the end of the turn's prefill: while its tokens equal
the FP answer's, they are the trunk's argmaxes (a branch would feed the same ids to the same cache state); at the
first token where they differ the trunk is forked (:meth:`Conversation.fork`) and the answer goes on on the fork.
So the FP conversation is decoded once for every policy, a policy that answers as the FP model does costs one
teacher-forced pass, and every answer is, token for token, the one a separate greedy decoding from a copy of the
trunk gives (``tests/test_session.py`` holds the two to each other).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kveval.tasks.session.conversation import Conversation, kld, turn_ids, turn_record
from kveval.tasks.session.sessions import Session


@dataclass
class Follower:
    """One policy's trunk and its answer to the current turn. ``turns``: the finished turns' records."""

    trunk: Conversation
    turns: list[dict] = field(default_factory=list)
    logits: torch.Tensor | None = None  # the trunk's last next-token logits [vocab]
    answer: list[int] = field(default_factory=list)
    branch: Conversation | None = None  # the fork the answer goes on on, once it left the FP answer
    done: bool = False  # the answer ended (end of sequence, or max_new_tokens)
    klds: list[float] = field(default_factory=list)

    def start_turn(self, fed: list[int], fp_logits: torch.Tensor, at: str) -> None:
        self.logits = self.trunk.feed(fed, at=at)
        self.answer, self.branch, self.done = [], None, False
        self.klds = [kld(fp_logits, self.logits)]

    def see(self, token: int, max_new_tokens: int, eos: set[int]) -> None:
        """The FP answer's next token is ``token``: the policy's own next token, while its answer is on the trunk."""
        if self.done or self.branch is not None:
            return
        assert self.logits is not None
        mine = int(self.logits.float().argmax())
        self.answer.append(mine)
        if mine in eos or len(self.answer) == max_new_tokens:
            self.done = True
        elif mine != token:
            self.branch = self.trunk.fork()

    def step(self, token: int, fp_logits: torch.Tensor, at: str) -> None:
        """Feed the FP answer's ``token`` to the trunk; the KLD at the next position."""
        self.logits = self.trunk.feed([token], at=at)
        self.klds.append(kld(fp_logits, self.logits))

    def finish_turn(self, max_new_tokens: int, eos: set[int], at: str) -> list[int]:
        """The policy's whole answer: what the trunk gave, then its own greedy tokens on the branch."""
        if not self.done:
            branch = self.branch or self.trunk.fork()
            logits = branch.feed(self.answer[-1:], at=f"{at} (branch)")
            self.answer += branch.greedy(logits, max_new_tokens - len(self.answer), eos, at=f"{at} (branch)")
        self.branch = None
        return self.answer


def follow_session(ctx, session: Session, policies: dict[str, object], fp_turns: list[dict] | None,
                   max_new_tokens: int, eos: set[int]) -> tuple[list[dict], dict[str, list[dict]]]:
    """The FP model's turns of ``session`` and, per policy of ``policies`` (name: policy), its ``fp_history``
    turns (each with ``kld_mean``/``kld_max`` along the FP answer). ``fp_turns``: the baseline's recorded turns to
    replay (their ``fed`` ids and ``tokens``), None to decode the FP conversation here."""
    tok, model = ctx.tokenizer, ctx.model
    fp = Conversation.start(model, None, where=f"session '{session.id}' of baseline (fp)")
    followers = {name: Follower(Conversation.start(model, p, where=f"session '{session.id}' of {name} (fp_history)"))
                 for name, p in policies.items()}
    out: list[dict] = []
    answers: list[str] = []
    n_turns = len(session.turns) if fp_turns is None else min(len(session.turns), len(fp_turns))
    for j in range(n_turns):
        at = f", turn {j}"
        if fp_turns is None:
            fed = (out[-1]["tokens"][-1:] if out else []) + turn_ids(tok, session, j, out[-1]["tokens"] if out
                                                                     else None, eos)
            recorded = None
        else:
            fed, recorded = [int(t) for t in fp_turns[j]["fed"]], [int(t) for t in fp_turns[j]["tokens"]]
        depth = len(fp.ids) + (1 if j else 0)  # the history before this turn's new ids
        lf = fp.feed(fed, at=at)
        for f in followers.values():
            f.start_turn(fed, lf, at)
        tokens: list[int] = []
        for step in range(max_new_tokens if recorded is None else len(recorded)):
            token = int(lf.float().argmax()) if recorded is None else recorded[step]
            tokens.append(token)
            for f in followers.values():
                f.see(token, max_new_tokens, eos)
            if (recorded is None and token in eos) or step == (max_new_tokens if recorded is None
                                                               else len(recorded)) - 1:
                break
            lf = fp.feed([token], at=f"{at} (step {step})")
            for f in followers.values():
                f.step(token, lf, at=f"{at} (step {step})")
        for f in followers.values():
            rec = turn_record(tok, session, j, fed, f.finish_turn(max_new_tokens, eos, at), depth, answers)
            rec["kld_mean"], rec["kld_max"] = sum(f.klds) / len(f.klds), max(f.klds)
            f.turns.append(rec)
        out.append(turn_record(tok, session, j, fed, tokens, depth, answers))
        answers.append(out[-1]["text"])
    return out, {name: f.turns for name, f in followers.items()}


__all__ = ["Follower", "follow_session"]
