"""The base of every config model: closed (unknown keys are errors), strict types, pure data."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=False)
