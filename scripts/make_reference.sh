#!/usr/bin/env bash
# Regenerate the README's reference run: configs/int4_g64.yaml on the builtin model, into results/reference/,
# with its report (report.md, report.html, tables/*.csv, plots/*.png at 100 dpi).
#
#   scripts/make_reference.sh            # about 1.5 min on 2 CPU cores once the builtin model is cached
#
# The run is redone from scratch (--overwrite, and the old folder removed so that resume cannot reuse it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
KVEVAL="${KVEVAL:-.venv/bin/kveval}"
OUT=results/reference

rm -rf "$OUT"
"$KVEVAL" run configs/int4_g64.yaml --set "output=$OUT" --overwrite --quiet
# kveval run writes the report itself; writing it again here keeps this script correct on its own
"$PY" -c "import sys; from kveval.commands.report import report_command; print(report_command([sys.argv[1]]))" "$OUT"
du -sh "$OUT"/report.html "$OUT"/plots "$OUT"/tables
