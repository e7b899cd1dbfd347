"""Shared fixtures. Tiny random models are cheap (milliseconds); the builtin model is loaded once per session."""

from __future__ import annotations

import os

# transformers' torch fallbacks of the linear-attention and Mamba kernels (Qwen3-Next, Falcon-H1, Granite-4) are
# wrapped in torch.compile, which on the CPU spends seconds compiling every new sequence length; the tests compare
# two kveval paths on the same model, so they run those fallbacks eagerly
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# `make test` runs two pytest-xdist workers on CI's two cores: one thread each (and in their subprocesses), since
# two workers of two torch threads each oversubscribe the cores (measured: no faster than one worker)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

import pytest  # noqa: E402

from kveval.models import load_model  # noqa: E402


@pytest.fixture
def native_answers(monkeypatch) -> list[bool]:
    """What every ``kveval.native.dequantize_int`` call of the test answered, in order (True: the native kernel
    wrote the values; False: the caller took the eager path)."""
    from kveval import native

    answers: list[bool] = []
    real = native.dequantize_int

    def spy(*args, **kwargs):
        answers.append(real(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(native, "dequantize_int", spy)
    return answers


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
