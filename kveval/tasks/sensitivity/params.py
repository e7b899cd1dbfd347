"""The sensitivity task's parameters (light: a config imports this, not the evaluator)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kveval.quant import preset
from kveval.schema import Strict, Tokens

NAME = "sensitivity"


class Params(Strict):
    """Per-layer, per-K/V sensitivity scan (``kveval scan``)."""

    specs: list[str] = Field(default_factory=lambda: ["int4_g64", "int2_g32"], min_length=1)
    tensors: list[Literal["key", "value"]] = Field(default_factory=lambda: ["key", "value"], min_length=1)
    layers: str | int = "all"
    seq_len: Tokens = Field(256, gt=1)
    max_tokens: Tokens | None = Field(512, gt=0)
    naive: bool = False
    plots: bool = True  # the report draws the heatmap and the ranking (kveval.report.task_figures), not the task

    @field_validator("specs")
    @classmethod
    def _known_specs(cls, value):
        for name in value:
            preset(name)  # ValueError with a "did you mean"
        if len(set(value)) != len(value):
            raise ValueError("specs are listed twice")
        return value
