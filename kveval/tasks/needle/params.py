"""The needle task's parameters (light: a config imports this, not the evaluator)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from kveval.schema import Strict, Tokens

NAME = "needle"


class Params(Strict):
    """Needle-in-a-haystack / passkey retrieval over context length × depth."""

    variant: Literal["passkey", "needle"] = "passkey"
    context_lengths: list[Annotated[Tokens, Field(gt=0)]] = Field(default_factory=lambda: [1024, 2048], min_length=1)
    depths: list[Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=lambda: [0.0, 0.5, 1.0], min_length=1)
    trials: int = Field(2, gt=0)
    max_new_tokens: int = Field(8, gt=0)
    generate: bool = True
    batch_size: int = Field(8, gt=0)  # trials of one context length generated per left-padded batch
    chat_template: bool = True
    plots: bool = True  # the report draws the heatmaps (kveval.report.task_figures), not the task
    max_drop: float = Field(5.0, gt=0, le=100)  # accuracy points below the baseline a context may lose (effective length)

    #: added after run folders were written: left out of the resolved config at its default, so they resume
    OMITTED_AT_DEFAULT: ClassVar[dict[str, Any]] = {"max_drop": 5.0}

    @model_validator(mode="after")
    def _unique(self):
        self.check_unique("context_lengths", "depths")
        return self

    @property
    def seq_len(self) -> int:
        """The longest context (the runner sizes the memory bill from it)."""
        return max(self.context_lengths)
