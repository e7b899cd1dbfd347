"""A command whose extra is not installed is one line naming the install command, exit status 2 (issue 53:
`kveval lm-eval` without lm-evaluation-harness ended in a ModuleNotFoundError traceback, exit status 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: run kveval's CLI with a module made unimportable, as on a machine without the extra
WITHOUT = ("import runpy, sys; sys.modules[{module!r}] = None; sys.argv = ['kveval', *sys.argv[1:]]; "
           "runpy.run_module('kveval', run_name='__main__')")


def test_lm_eval_without_lm_evaluation_harness_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-c", WITHOUT.format(module="lm_eval"), "lm-eval", "--kv", "int8", "--",
                           "--tasks", "arc_easy", "--limit", "2"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "lm-evaluation-harness" in lines[0] and "pip install 'kveval[lmeval]'" in lines[0]
