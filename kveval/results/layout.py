"""What a run folder ``results/<run>/`` holds: the one definition of its file names and of the baseline's name.

``store`` writes these files while a run works, ``read`` loads them afterwards; reports, notebooks and ``kveval
plan`` read them only through :mod:`kveval.results`. Standard library only (task modules import this at start-up).

Schema (docs/design.md section 4; the README's "Results" section lists every field of ``metrics.json``):

* ``config.resolved.yaml`` (:data:`CONFIG_FILE`): the experiment config after defaults and overrides, every policy
  expanded to its full form (``kv.policies.NAME``), ``tasks`` as ``[{KIND: {param: value}}]``. A rerun whose
  resolved config differs is refused unless ``overwrite``. Written atomically.
* ``env.json`` (:data:`ENV_FILE`): ``python``, ``platform``, ``torch``, ``transformers``, ``kveval``,
  ``git_commit``, ``device``, ``cuda_device``, ``threads``, ``argv``, ``config_path``, ``command``, ``started``
  and ``finished`` (ISO 8601, UTC; ``finished`` null while the run works). Written atomically.
* ``records.jsonl`` (:data:`RECORDS_FILE`): one JSON object per unit of work (perplexity window x policy, needle
  trial x policy, scan window x cell, lm-eval task x policy), each with a unique ``key`` and its ``task``;
  appended and flushed as each completes, so a rerun skips the recorded keys (resume). A torn last line is
  ignored (:func:`kveval.fileio.read_jsonl` says what happens to a bad line in the middle).
* ``metrics.json`` (:data:`METRICS_FILE`): the aggregate, written atomically at the end of the run::

      {"run": NAME, "model": MODEL,
       "baseline": {FIELD: value},              # the full-precision reference (its name: BASELINE)
       "policies": {POLICY: {FIELD: value}},    # in the config's order
       "memory": {"arch": {...}, "context": N, "gpu_memory": ...},
       "sensitivity": {...}, "plan": {...}}     # only after a scan / for a planned config

  Per policy: perplexity (``ppl``, ``delta_ppl_pct``, ``kld_mean``, ``kld_ci95``, ``top1_agree``,
  ``*_by_position``, ``layer_errors``, ``verdict``...), memory (``bytes_per_token``, ``compression_vs_fp16``,
  ``bits_per_element``, ``max_batch``), needle (``needle_accuracy``, ``needle_cells``...), ``lm_eval``. Renaming a
  field is a breaking change.
* ``scales.safetensors`` (:data:`SCALES_FILE`): the calibration of ``scales: auto`` policies, reused on resume;
  ``scales_used.json`` (:data:`SCALES_USED_FILE`): ``{policy: sha256}`` of the ``scales: FILE`` files a run used.
* ``report.md``, ``report.html``, ``tables/*.csv`` (:data:`TABLES_DIR`), ``plots/*.png`` (:data:`PLOTS_DIR`):
  written by ``kveval.report`` from the files above (``kveval run`` calls it at the end), never by a task.
"""

from __future__ import annotations

CONFIG_FILE = "config.resolved.yaml"
ENV_FILE = "env.json"
RECORDS_FILE = "records.jsonl"
METRICS_FILE = "metrics.json"
SCALES_FILE = "scales.safetensors"
SCALES_USED_FILE = "scales_used.json"
PLOTS_DIR = "plots"
TABLES_DIR = "tables"

#: The full-precision reference: its policy name in records.jsonl and its key in metrics.json.
BASELINE = "baseline"

__all__ = ["BASELINE", "CONFIG_FILE", "ENV_FILE", "METRICS_FILE", "PLOTS_DIR", "RECORDS_FILE", "SCALES_FILE",
           "SCALES_USED_FILE", "TABLES_DIR"]
