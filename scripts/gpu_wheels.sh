#!/usr/bin/env bash
# Download here, into .gpu_wheels/ (ignored by git; carried to the GPU machine), the wheels kveval needs on the lent
# GPU machine that its image lacks: the machine has Python 3.12 with torch 2.11, transformers 5.17 (inside kveval's
# bound), typer, rich, pandas, matplotlib, xxhash and pyarrow, but no pydantic, gguf or compressed-tensors, and no
# network (docs/gpu.md); typing-extensions too, at the version pydantic-core needs. Also kveval itself as a wheel (its task definitions are installed under kveval).
#
#   bash scripts/gpu_wheels.sh          # then: the device tool's run with carry [".gpu_wheels"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
DEST=.gpu_wheels
rm -rf "$DEST"
mkdir -p "$DEST"
# the machine's Python and platform, whatever this one is
"$PY" -m pip download --disable-pip-version-check -q --dest "$DEST" --only-binary=:all: --no-deps \
  --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  "pydantic>=2.6,<3" "pydantic-core" "annotated-types" "typing-inspection" "gguf>=0.10" \
  "compressed-tensors==0.20.1" "loguru" "typing-extensions>=4.14"
"$PY" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation --wheel-dir "$DEST" .
ls -1 "$DEST"
du -sh "$DEST"
