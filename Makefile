# The two commands of the README:
#   make demo   set up (if needed) and run the main job on the embedded model and corpus
#   make test   set up (if needed), run the linter and the type checker, then the test suite
VENV ?= .venv
export HF_HUB_DISABLE_TELEMETRY = 1

.PHONY: setup demo test test-fast lint bench reference clean

setup:
	@VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(VENV)/bin/kveval run configs/int4_g64.yaml

# two workers, one torch thread each (tests/conftest.py), whole test files per worker: 10.7 min here against 21
# min for one worker of two threads
test: setup lint
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

test-fast: setup
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m "not integration"

# the guards CI runs before the tests: ruff on everything, mypy on the typed core (files listed in pyproject.toml)
lint: setup
	$(VENV)/bin/ruff check kveval tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache
