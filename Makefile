# The two commands of the README:
#   make demo   set up (if needed) and run the main job on the embedded model and corpus
#   make test   set up (if needed), run the linter and the type checker, then the test suite
VENV ?= .venv
export HF_HUB_DISABLE_TELEMETRY = 1

.PHONY: setup setup-all parity demo test test-fast lint clean

# the main job's install: torch, kveval, the embedded model (scripts/setup.sh lists the parts)
setup:
	@VENV=$(VENV) bash scripts/setup.sh main

# what the tests need on top: dev tools, lm-eval, Ray, the parity systems, llama-perplexity, llm-compressor
setup-all:
	@VENV=$(VENV) bash scripts/setup.sh all

# the real systems of the parity tests alone (compiles llama.cpp once)
parity:
	@VENV=$(VENV) bash scripts/setup.sh parity llama-perplexity

demo: setup
	$(VENV)/bin/kveval run configs/int4_g64.yaml

# two workers, one torch thread each (tests/conftest.py), whole test files per worker: 10.7 min here against 21
# min for one worker of two threads
test: setup-all lint
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

test-fast: setup-all
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m "not integration"

# the guards CI runs before the tests: ruff on everything, mypy on the typed core (files listed in pyproject.toml)
lint: setup-all
	$(VENV)/bin/ruff check kveval tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache
