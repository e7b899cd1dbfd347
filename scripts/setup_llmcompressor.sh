#!/usr/bin/env bash
# A separate virtual environment for llm-compressor, built once and cached outside the repository: llmcompressor
# 0.14.0.1 pins transformers 5.15-5.17 and compressed-tensors 0.19.0, which cannot share kveval's environment
# (transformers 5.24, compressed-tensors 0.20), and compressed-tensors' KV-cache hooks find no attention module
# under transformers 5.24 (the attention forward's `past_key_values` argument was renamed `cache`).
# tests/test_llmcompressor_parity.py runs llm-compressor's own oneshot in it (scripts/llmcompressor_calibrate.py).
#
#   bash scripts/setup_llmcompressor.sh        # prints the venv's python
#
# torch is the same pinned CPU build as kveval's (llmcompressor allows torch>=2.10,<=2.14), so no CUDA build is
# pulled; everything else comes from the package index at llmcompressor's own pins. A rerun with the stamp in
# place does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${KVEVAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kveval}"  # as kveval.paths.cache_root
LLMC_SPEC="${LLMC_SPEC:-llmcompressor==0.14.0.1}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
VENV="${LLMC_VENV:-$CACHE/venvs/${LLMC_SPEC//==/-}}"
STAMP="$VENV/.kveval-llmc-setup"
want="$(sha256sum scripts/setup_llmcompressor.sh | cut -d' ' -f1) $LLMC_SPEC $TORCH_SPEC"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import llmcompressor" 2>/dev/null; then
  echo "$VENV/bin/python"
  exit 0
fi
start=$(date +%s)
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
else
  pip_install "$TORCH_SPEC"
fi
pip_install "$LLMC_SPEC" "$TORCH_SPEC"
echo "$want" > "$STAMP"
echo "setup_llmcompressor: $VENV built in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
