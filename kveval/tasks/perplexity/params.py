"""The perplexity task's parameters (light: a config imports this, not the evaluator)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from kveval.schema import Strict, Tokens

NAME = "perplexity"


class Params(Strict):
    """Perplexity, KL divergence and top-1 agreement against the full-precision model."""

    #: left out of the resolved config at these values (added later: older run folders resume; kveval.tasks)
    OMITTED_AT_DEFAULT: ClassVar[dict[str, Any]] = {"start_token": 0, "batch_size": 1}
    #: every window is scored under every weight variant x KV policy (the one task that measures model.weights)
    MEASURES_WEIGHT_VARIANTS: ClassVar[bool] = True

    seq_len: Tokens = Field(512, gt=1)
    stride: Tokens | None = Field(None, gt=0)
    max_tokens: Tokens | None = Field(4096, gt=0)
    start_token: Tokens = Field(0, ge=0)
    prefill_tokens: Tokens = Field(0, ge=0)
    position_bins: int = Field(8, gt=0)
    bootstrap: int = Field(1000, ge=0)
    diagnostics: bool = True
    noise_windows: int = Field(0, ge=0)
    batch_size: int = Field(1, gt=0)

    @model_validator(mode="after")
    def _default_bins_fit(self):
        """The default ``position_bins`` (8) for a window shorter than 8 tokens: one bin per position (asking for
        more bins than positions is still refused, by the config)."""
        if "position_bins" not in self.model_fields_set and self.position_bins > self.seq_len:
            object.__setattr__(self, "position_bins", self.seq_len)
        return self

    @model_validator(mode="after")
    def _stride_fits(self):
        if self.stride is not None and self.stride > self.seq_len:
            raise ValueError(f"stride {self.stride} is larger than seq_len {self.seq_len}")
        if self.prefill_tokens >= self.seq_len:
            raise ValueError(f"prefill_tokens {self.prefill_tokens} must be smaller than seq_len {self.seq_len}")
        return self
