"""kveval's task definitions, as data you may edit: installed with kveval as the package ``kveval.task_definitions``
(``pyproject.toml`` maps it to this folder), so an installed kveval has them too. Nothing here is kveval's code.

- ``presets/*.yaml``: task presets, ready-made parameter sets a config names (``tasks: [ppl_quick]``); one file a
  preset, ``{TASK: {parameter: value}}``; ``kveval ls`` lists them.
- ``lm_eval/``: local lm-evaluation-harness tasks (``configs/lm_eval.yaml``, ``include_path: tasks/lm_eval``): 32
  multiple-choice facts and 16 short-answer questions as JSONL beside their task YAMLs, loaded by ``utils.py``
  (lm-eval's ``!function``), offline.
- ``generation/``: example prompt files of the generation task (``prompts: tasks/generation/word_problems.jsonl``:
  12 word problems answered in ``\\boxed{}``).

The evaluators are Python, in the package ``kveval/tasks/`` (one folder per task; docs/extending.md).
"""

from pathlib import Path

#: this folder, wherever kveval is installed
DEFINITIONS_DIR = Path(__file__).resolve().parent
PRESETS_DIR = DEFINITIONS_DIR / "presets"
LM_EVAL_DIR = DEFINITIONS_DIR / "lm_eval"
