#!/usr/bin/env bash
# The GPU check (docs/gpu.md): run on the lent GPU machine, from the repository root, with .gpu_wheels carried
# (scripts/gpu_wheels.sh made it here). Installs those wheels into a target folder (the machine's own packages stay
# as they are), then runs bench/gpu_check.py, writing gpu_check.json and gpu_check.md into $OUT.
#
#   device run:  bash scripts/gpu_check.sh                 (carry: .gpu_wheels; about 5 minutes on an H200)
#   here (CI):   OUT=/tmp/x bash scripts/gpu_check.sh --small    (the CPU dry run; no wheels needed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-results/gpu_check}"
TARGET="${TARGET:-/tmp/kveval-gpu-site}"
WHEELS="${GPU_WHEELS:-.gpu_wheels}"  # GPU_WHEELS=none: use the Python's own packages (the dry run here)
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps --target "$TARGET" "$WHEELS"/*.whl
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT"
PYTHONUNBUFFERED=1 "$PY" bench/gpu_check.py --out "$OUT" "$@"
