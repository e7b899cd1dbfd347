"""The generation task's parameters (light: a config imports this, not the evaluator)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kveval.schema import MIN_TEMPERATURE, Strict

NAME = "generation"
#: the longest generation a config may ask for (tokens)
MAX_NEW_TOKENS = 32768


class Params(Strict):
    """The model's own long generations through the quantized cache: divergence from the FP model, KLD along the
    trajectory, degenerate decoding, accuracy and pass@k."""

    prompts: str = "builtin"  # "builtin" (procedural tasks with checkable answers + corpus continuations) or a JSONL file
    tasks_per_kind: int = Field(8, gt=0, le=10_000)  # builtin: prompts of each procedural task kind
    continuations: int = Field(8, ge=0, le=10_000)  # builtin: open-ended corpus continuations (fidelity only)
    continuation_tokens: int = Field(128, gt=0, le=MAX_NEW_TOKENS)  # builtin: corpus tokens of a continuation prompt
    max_new_tokens: int = Field(512, gt=0, le=MAX_NEW_TOKENS)
    samples: int | None = Field(None, gt=0, le=1024)  # seeded samples per prompt with an answer, for pass@k (None: greedy only)
    temperature: float = Field(0.7, ge=MIN_TEMPERATURE, le=10)  # the floor keeps the scaled logits finite
    top_p: float = Field(0.95, gt=0, le=1)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)  # stop strings beside EOS
    chat_template: bool = True  # the model's chat template when it has one
    thinking: bool = False  # reasoning models: the template's thinking mode (<think> kept for fidelity, not scored)
    batch_size: int = Field(8, gt=0, le=4096)
    kld_bins: int = Field(8, gt=0, le=1000)  # decode-step bins of the KLD curves
    max_drop: float = Field(5.0, gt=0, le=100)  # accuracy points a policy may lose before it fails
    examples: int = Field(3, ge=0, le=100)  # worst examples shown side by side in the report
    plots: bool = True  # the report draws the curves (kveval/tasks/generation/reporting.py), not the task

    def input_files(self) -> dict[str, str]:
        """The files this task reads (:func:`kveval.config.input_files`: the run folder records their digests and
        refuses to resume on a changed one): the prompt file, unless ``builtin``."""
        if self.prompts == "builtin":
            return {}
        from kveval.tasks.generation.prompts import resolve_prompts_path

        return {"prompts": resolve_prompts_path(self.prompts)}

    @property
    def seq_len(self) -> int:
        """The longest context of the run's generations (the memory bill's context): a continuation prompt plus
        its generation (a JSONL or chat prompt may be longer; the task checks those against the model's)."""
        return self.continuation_tokens + self.max_new_tokens

    @property
    def context_needed(self) -> tuple[int, str]:
        """(tokens of context the config alone proves a run needs, the fields that add up to them): what
        ``kveval validate`` checks against the model's context. A continuation prompt plus its generation when
        there are continuations, else the generation alone: a prompt file never uses continuation_tokens (its
        prompts' and the chat template's tokens are the task's check, once the tokenizer is loaded)."""
        if self._continues:
            return self.continuation_tokens + self.max_new_tokens, "continuation_tokens + max_new_tokens"
        return self.max_new_tokens, "max_new_tokens"

    @property
    def _continues(self) -> bool:
        return self.prompts == "builtin" and self.continuations > 0


def check_inputs(params: Params, *, allow_code: bool) -> None:
    """The config's input check (:mod:`kveval.tasks`' hook, so that ``kveval validate`` refuses it too): a prompt
    file kveval cannot use (:func:`kveval.tasks.generation.prompts.load_jsonl`'s one line), and samples asked of
    a prompt file without answers (the samples serve pass@k). No model is loaded; the model-dependent checks
    (context length, chat template) are the task's ``check``."""
    from kveval.errors import KvevalError
    from kveval.tasks.generation.prompts import load_jsonl

    if params.prompts == "builtin":
        return
    prompts = load_jsonl(params.prompts)
    if params.samples and all(p.answer is None for p in prompts):
        raise KvevalError(f"tasks: generation.samples draws samples for pass@k on prompts with an answer, and none "
                          f"in {params.prompts} has one; give answers, or drop samples")
