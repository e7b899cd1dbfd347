"""Needle cost per cell: greedy generation through the real cache vs the teacher-forced score, same process.

Also prints what each trial scored, so it doubles as a quick look at retrieval on the builtin model::

    .venv/bin/python bench/bench_needle.py [--contexts 1024,2048,4096] [--depths 0,0.5,1] [--trials 1]
                                           [--policies int2_g32] [--variant passkey] [--max-new-tokens 8]

Per cell: median seconds of ``score_answer`` (one forward over prompt + answer, under ``emulate`` for a policy)
and of ``generate_answers`` (one prompt: prefill + ``max_new_tokens`` decode steps through ``QuantizedKVCache``; plain
``generate`` for the baseline), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kveval.models import load_model
from kveval.policy import KVPolicy
from kveval.tasks.common.decoding import generate_answers
from kveval.tasks.common.teacher import score_answer
from kveval.tasks.needle.prompts import PASSKEY_FILLER, SentenceTokens, exact_match, split_sentences
from kveval.tasks.needle.task import Params, trial_prompt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--depths", default="0,0.5,1")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--policies", default="int2_g32")
    ap.add_argument("--variant", default="passkey", choices=["passkey", "needle"])
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    contexts = [int(x) for x in args.contexts.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    params = Params(variant=args.variant, context_lengths=contexts, depths=depths, trials=args.trials,
                    max_new_tokens=args.max_new_tokens)
    if args.variant == "passkey":
        sents = SentenceTokens(tok, PASSKEY_FILLER)
    else:
        from kveval.data import load_text

        sents = SentenceTokens(tok, split_sentences(load_text("builtin")))
    policies = {"baseline": None, **{n: KVPolicy.preset(n) for n in args.policies.split(",") if n}}
    print(f"{args.model}, {args.variant}, {torch.get_num_threads()} threads, max_new_tokens {args.max_new_tokens}")
    print(f"{'policy':10s} {'context':>7s} {'depth':>5s} {'exact':>6s} {'logprob':>8s} {'tok_acc':>7s} "
          f"{'score s':>8s} {'gen s':>7s} {'gen/score':>9s}  generated")
    summary: dict[str, dict[str, list]] = {n: {"em": [], "lp": [], "ratio": []} for n in policies}
    # warm-up (first calls allocate)
    _, p = trial_prompt(tok, params, sents, seed=0, context=min(contexts), depth=0.5, trial=99)
    score_answer(model, p.input_ids, p.answer_ids)
    for context in contexts:
        for depth in depths:
            rows: dict[str, dict[str, list]] = {n: {"em": [], "lp": [], "acc": [], "ts": [], "tg": [], "txt": []}
                                                for n in policies}
            for trial in range(args.trials):
                spec, p = trial_prompt(tok, params, sents, seed=0, context=context, depth=depth, trial=trial)
                for name, policy in policies.items():
                    t0 = time.perf_counter()
                    s = score_answer(model, p.input_ids, p.answer_ids, policy)
                    t1 = time.perf_counter()
                    text = generate_answers(model, tok, [p.input_ids], args.max_new_tokens, policy, batch_size=1)[0]
                    t2 = time.perf_counter()
                    r = rows[name]
                    r["em"].append(int(exact_match(text, spec.answer)))
                    r["lp"].append(s["answer_logprob"])
                    r["acc"].append(s["answer_token_acc"])
                    r["ts"].append(t1 - t0)
                    r["tg"].append(t2 - t1)
                    r["txt"].append(text.strip()[:24])
            for name, r in rows.items():
                ts, tg = statistics.median(r["ts"]), statistics.median(r["tg"])
                em, lp = statistics.mean(r["em"]), statistics.mean(r["lp"])
                summary[name]["em"] += r["em"]
                summary[name]["lp"] += r["lp"]
                summary[name]["ratio"].append(tg / ts)
                print(f"{name:10s} {context:7d} {depth:5.2f} {em:6.2f} {lp:8.3f} {statistics.mean(r['acc']):7.2f} "
                      f"{ts:8.2f} {tg:7.2f} {tg / ts:9.2f}  {r['txt']}", flush=True)
    print()
    for name, s in summary.items():
        print(f"{name:10s} exact match {statistics.mean(s['em']):.2f}  answer log-prob/token {statistics.mean(s['lp']):.3f}"
              f"  generation/score time, median over cells {statistics.median(s['ratio']):.2f}")


if __name__ == "__main__":
    main()
