"""The serving engines kveval writes commands for, by name, and the check of a user's ``--engine``: light (no
torch), so that a command refuses an unknown engine before it imports anything heavy. The engines themselves (their
cache types, flags and syntax) are :data:`kveval.engines.tables.ENGINES`, keyed by these names."""

from __future__ import annotations

from kveval.errors import KvevalError, did_you_mean

ENGINE_NAMES = ("vllm", "llamacpp", "sglang", "trtllm", "transformers")


def check_engine_names(names: list[str] | None, option: str = "--engine") -> None:
    """One :class:`KvevalError` line for the first name that is not an engine, with the nearest one."""
    for name in names or []:
        if name not in ENGINE_NAMES:
            raise KvevalError(f"{option} {name}: unknown engine{did_you_mean(name, ENGINE_NAMES)} (one of "
                              f"{', '.join(ENGINE_NAMES)})")


__all__ = ["ENGINE_NAMES", "check_engine_names"]
