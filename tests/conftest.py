"""Shared fixtures. Tiny random models are cheap (milliseconds); the builtin model is loaded once per session."""

from __future__ import annotations

import pytest

from kveval.models import load_model


@pytest.fixture(scope="session")
def tiny_llama():
    """(model, tokenizer): builtin:tiny-llama, float32, seed 0."""
    return load_model("builtin:tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama64():
    """(model, tokenizer): builtin:tiny-llama, float64, seed 0 (same weights as tiny_llama, cast)."""
    return load_model("builtin:tiny-llama", dtype="float64")


@pytest.fixture(scope="session")
def tiny_gemma3():
    """(model, tokenizer): builtin:tiny-gemma3 (sliding-window layers 0 and 2), float32, seed 0."""
    return load_model("builtin:tiny-gemma3")


@pytest.fixture(scope="session")
def tiny_gemma3_64():
    """(model, tokenizer): builtin:tiny-gemma3, float64, seed 0."""
    return load_model("builtin:tiny-gemma3", dtype="float64")


@pytest.fixture(scope="session")
def builtin_model():
    """(model, tokenizer): builtin:smollm2-135m in float32 from the user's kveval cache (converted on first use).

    Shared: tests must not modify it (patches must restore it on exit).
    """
    return load_model("builtin:smollm2-135m")


@pytest.fixture(scope="session")
def builtin_model64():
    """(model, tokenizer): builtin:smollm2-135m cast to float64 (for exact equivalence checks)."""
    return load_model("builtin:smollm2-135m", dtype="float64")
