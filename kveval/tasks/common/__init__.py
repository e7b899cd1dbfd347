"""What every task shares: the unit runner (``runner``: resume, batching, progress, appending) and the model calls
(``decoding``: greedy answers through the real cache and the ids they end at; ``teacher``: teacher-forced scoring
and the KLD along a path; ``lockstep``: samples, stop strings and the two-cache test oracle), token-exact prompts
and chat templates (``prompts``) and the NaN/inf refusals (``finite``). Not a task (:mod:`kveval.plugins`)."""
