"""The RULER task's parameters (light: a config imports this, not the evaluator)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kveval.schema import Strict, Tokens
from kveval.tasks.ruler.prompts import FAMILIES

NAME = "ruler"
FAMILY_NAMES = tuple(FAMILIES)
FamilyName = Literal[FAMILY_NAMES]  # type: ignore[valid-type]
MAX_SEED = 2**32 - 1  # as the config's seed


class Params(Strict):
    """RULER-style synthetic long-context suite (needles, variable tracking, word extraction) over lengths."""

    families: list[FamilyName] = Field(default_factory=lambda: list(FAMILY_NAMES), min_length=1)
    lengths: list[Annotated[Tokens, Field(gt=0)]] = Field(default_factory=lambda: [4096, 8192], min_length=1)
    samples: int = Field(4, gt=0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # None: the config's seed
    depths: list[Annotated[float, Field(ge=0, le=1)]] | None = Field(None, min_length=1)
    max_new_tokens: int | None = Field(None, gt=0)  # None: RULER's budget per family
    max_drop: float = Field(5.0, ge=0)  # score points below the baseline a family may lose at any length
    batch_size: int = Field(8, gt=0)  # samples of one (family, length) generated per left-padded batch
    chat_template: bool = True
    plots: bool = True  # the report draws the heatmaps (kveval.report.task_figures), not the task

    @model_validator(mode="after")
    def _unique(self):
        self.check_unique("families", "lengths", "depths")
        return self

    @property
    def seq_len(self) -> int:
        """The longest context (the runner sizes the memory bill from it)."""
        return max(self.lengths)

    def budget(self, family: str) -> int:
        """The tokens generated for ``family``: ``max_new_tokens``, else RULER's."""
        return self.max_new_tokens or FAMILIES[family].tokens_to_generate

    def depth(self, sample: int) -> float | None:
        """Where sample ``sample`` puts the answer's needles (None: RULER's random depths)."""
        return None if self.depths is None else self.depths[sample % len(self.depths)]
