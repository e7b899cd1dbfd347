"""The lm_eval task's parameters (light: a config imports this, not the evaluator)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kveval.schema import Strict

NAME = "lm_eval"


class Params(Strict):
    """lm-evaluation-harness tasks (log-likelihood under emulation, generation through the quantized cache)."""

    tasks: list[str] = Field(min_length=1)
    num_fewshot: int | None = Field(0, ge=0, le=1000)  # None: each task's own default
    limit: int | None = Field(None, gt=0)
    include_path: str | None = None
    batch_size: int = Field(1, gt=0, le=4096)
    prefill: Literal["none", "context"] = "none"
    # samples per generation request (lm-eval's task field `repeats`, set on every generation task; None: each
    # task's own); the task must score every sample (a majority vote, or its own process_results)
    repeats: int | None = Field(None, gt=0, le=1024)
    # lm-eval's --gen_kwargs: merged into every generation task's generation_kwargs (e.g. do_sample, temperature)
    gen_kwargs: dict[str, str | bool | int | float] | None = None


def check_inputs(params: Params, *, allow_code: bool) -> None:
    """The config's input check (:mod:`kveval.tasks`' hook): an ``include_path`` that is a folder, holding no code
    unless ``allow_code`` (:func:`kveval.tasks.lm_eval.include.check_include_path`; no lm-eval import)."""
    from kveval.tasks.lm_eval.include import check_include_path

    check_include_path(params.include_path, allow_code=allow_code)
