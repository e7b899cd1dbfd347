"""The lm_eval task's parameters (light: a config imports this, not the evaluator)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kveval.schema import MIN_TEMPERATURE, Strict

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

    @model_validator(mode="after")
    def _sampling(self):
        check_sampling_kwargs(self.gen_kwargs or {}, "gen_kwargs")
        return self


def _number(value: object) -> float | None:
    """A gen_kwargs value as a number (lm-eval passes ``--gen_kwargs`` values as text), None when it is not one."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def check_sampling_kwargs(kwargs: dict, where: str) -> None:
    """ValueError (pydantic's, or the caller's one line) for sampling that transformers' ``generate`` refuses
    only once the run is under way: ``do_sample`` true with a ``temperature`` that is not a number of at least
    :data:`kveval.schema.MIN_TEMPERATURE` (0 is refused by transformers; 5e-324 overflows the scaled logits), or
    a ``top_p`` outside (0, 1]."""
    if str(kwargs.get("do_sample", False)).lower() not in ("true", "1"):
        return
    if "temperature" in kwargs:
        t = _number(kwargs["temperature"])
        if t is None or not MIN_TEMPERATURE <= t <= 1e6:
            raise ValueError(f"{where}: do_sample: true samples at temperature {str(kwargs['temperature'])[:40]}, "
                             f"which must be a number of at least {MIN_TEMPERATURE:g} (a lower one divides the "
                             "logits past any float's range; for greedy decoding set do_sample: false)")
    if "top_p" in kwargs:
        p = _number(kwargs["top_p"])
        if p is None or not 0 < p <= 1:
            raise ValueError(f"{where}: do_sample: true keeps a nucleus of top_p {str(kwargs['top_p'])[:40]}, "
                             "which must be a number in (0, 1]")


def check_inputs(params: Params, *, allow_code: bool) -> None:
    """The config's input check (:mod:`kveval.tasks`' hook): an ``include_path`` that is a folder, holding no code
    unless ``allow_code`` (:func:`kveval.tasks.lm_eval.include.check_include_path`; no lm-eval import)."""
    from kveval.tasks.lm_eval.include import check_include_path

    check_include_path(params.include_path, allow_code=allow_code)
