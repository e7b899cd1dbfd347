"""The full-precision greedy accuracy of each builtin kind of the generation task (kveval/tasks/generation/prompts.py
states it): ``python scripts/generation_kind_accuracy.py [PROMPTS_PER_KIND] [SEED]``.

Each prompt alone (no padding) through builtin:smollm2-135m's chat template, greedy ``generate``, up to 64 new
tokens, the decoded answer (special tokens skipped, thinking stripped) checked with the kind's checker.
"""

from __future__ import annotations

import sys

import torch

from kveval.models import load_model
from kveval.tasks.generation.checkers import check_answer, strip_thinking
from kveval.tasks.generation.prompts import KINDS, builtin_prompts


def main() -> None:
    per_kind = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    model, tokenizer = load_model("builtin:smollm2-135m")
    passed = dict.fromkeys(KINDS, 0)
    for prompt in builtin_prompts(per_kind, [], seed):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        text = strip_thinking(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        passed[prompt.kind] += check_answer(text, prompt.answer or "", prompt.checker or "exact")
    for kind, n in passed.items():
        print(f"{kind}: {n}/{per_kind} = {100 * n / per_kind:.0f}%")


if __name__ == "__main__":
    main()
