"""What a run folder ``results/<run>/`` holds: the one definition of its file names and of the baseline's name.

``store`` writes these files while a run works, ``read`` loads them afterwards; reports, notebooks and ``kveval
plan`` read them only through :mod:`kveval.results`. Standard library only (task modules import this at start-up).

Schema (docs/design.md section 4; docs/results.md lists every field of ``metrics.json``):

* ``config.resolved.yaml`` (:data:`CONFIG_FILE`): the experiment config after defaults and overrides, every policy
  expanded to its full form (``kv.policies.NAME``), ``tasks`` as ``[{KIND: {param: value}}]``. A rerun whose
  resolved config differs is refused unless ``overwrite``. Written atomically.
* ``env.json`` (:data:`ENV_FILE`): ``python``, ``platform``, ``torch``, ``transformers``, ``kveval``,
  ``git_commit``, ``device``, ``cuda_device``, ``cpu`` (the CPU's model name), ``cpu_capability`` (the vector
  instruction set torch's CPU kernels use: ``AVX512``, ``AVX2``...), ``threads``, ``argv``, ``config_path``,
  ``command``, ``started``
  and ``finished`` (ISO 8601, UTC; ``finished`` null while the run works); ``weights`` (the reference and each
  variant's ``info``) for a run with ``model.weights``. Written atomically.
* ``records.jsonl`` (:data:`RECORDS_FILE`): one JSON object per unit of work (perplexity window x policy, needle
  trial x policy, scan window x cell, lm-eval task x policy), each with a unique ``key`` and its ``task``;
  appended and flushed as each completes, so a rerun skips the recorded keys (resume). A torn last line is
  ignored (:func:`kveval.fileio.read_jsonl` says what happens to a bad line in the middle).
* ``metrics.json`` (:data:`METRICS_FILE`): the aggregate, written atomically at the end of the run::

      {"run": NAME, "model": MODEL,
       "baseline": {FIELD: value},              # the full-precision reference (its name: BASELINE)
       "policies": {POLICY: {FIELD: value}},    # in the config's order
       "memory": {"arch": {...}, "context": N, "gpu_memory": ..., "deployment": {"context", "baseline", "policies"}},
       "sensitivity": {...}, "plan": {...},     # only after a scan / for a planned config
       "weights": {"reference": {...}, "variants": {VARIANT: {"info", "weight_bytes", "alone", "policies"}}},
                                                # only with model.weights (weights x KV cache)
       "tasks": {"tasks[i]": {"kind": KIND, "baseline": {...}, "policies": {...}}}}  # TASK_ENTRIES, see below

  Per policy: perplexity (``ppl``, ``delta_ppl_pct``, ``kld_mean``, ``kld_ci95``, ``top1_agree``,
  ``*_by_position``, ``layer_errors``, ``verdict``...), memory (``bytes_per_token``, ``compression_vs_fp16``,
  ``bits_per_element``, ``max_batch``), needle (``needle_accuracy``, ``needle_cells``...), ``lm_eval``. Per weight
  variant (``weights.variants.VARIANT``): ``info`` (spec, module groups, matrices, ``params_quantized``, stored
  bytes), ``alone`` (the weight effect, the fields of a policy) and per policy the combined effect with the
  interaction fields (``kv_*``, ``weights_*``, ``*_sum``, ``*_excess`` and ``*_excess_ci95``, ``*_interaction``,
  ``*_worse_than_sum``, ``kv_on_weights_*``; docs/results.md); their records carry ``weights: VARIANT`` and the
  key ``perplexity/w{i}/weights/{VARIANT}/{policy}``. Renaming a
  field is a breaking change. The first task entry of each kind reports at the top level; a later entry of the
  same kind (two perplexity tasks with different windows) reports its own fields under ``tasks`` (its label,
  ``tasks[i]``, also prefixes its record keys), so that two entries never share a field or a key.
* ``scales.safetensors`` (:data:`SCALES_FILE`): the calibration of ``scales: auto`` policies, reused on resume;
  ``scales_used.json`` (:data:`SCALES_USED_FILE`): ``{policy: sha256}`` of the ``scales: FILE`` files a run used.
* ``report.md``, ``report.html``, ``tables/*.csv`` (:data:`TABLES_DIR`), ``plots/*.png`` (:data:`PLOTS_DIR`):
  written by ``kveval.report`` from the files above (``kveval run`` calls it at the end), never by a task.
* ``.kveval-run.json`` (:data:`MARKER_FILE`): the marker that says kveval made this folder as a run folder, and
  the folder's resolved state: ``{"format": 1, "created": ISO 8601, "kveval": version, "tokens": {"sha256",
  "count"}}`` (``tokens``: the corpus token ids the records were computed on, absent until a task reads the
  corpus). ``--overwrite`` removes only a folder with this marker (or a run folder of an older kveval, which holds
  nothing but kveval's own files), and then only kveval's own files in it.
* ``.kveval.lock`` (:data:`LOCK_FILE`): exists while a kveval process writes the folder (``kveval run``, ``scan``,
  ``report``, ``calibrate --out`` into it); ``fcntl.flock`` on it is the folder's one-owner lock, its content
  names the holder (:mod:`kveval.results.lock`).

Where a run folder is: :func:`run_folder` (``output``, ``~`` expanded, else ``results/<name>``, the name one plain
path component).
"""

from __future__ import annotations

import os
from pathlib import Path

from kveval.errors import KvevalError

CONFIG_FILE = "config.resolved.yaml"
ENV_FILE = "env.json"
RECORDS_FILE = "records.jsonl"
METRICS_FILE = "metrics.json"
SCALES_FILE = "scales.safetensors"
SCALES_USED_FILE = "scales_used.json"
PLOTS_DIR = "plots"
TABLES_DIR = "tables"
REPORT_FILES = ("report.md", "report.html")
MARKER_FILE = ".kveval-run.json"
LOCK_FILE = ".kveval.lock"

#: Every name kveval itself writes in a run folder: what ``--overwrite`` may remove, and what a run folder of an
#: older kveval (made before :data:`MARKER_FILE`) may hold.
OWN_FILES = (CONFIG_FILE, ENV_FILE, RECORDS_FILE, METRICS_FILE, SCALES_FILE, SCALES_USED_FILE, *REPORT_FILES,
             TABLES_DIR, PLOTS_DIR, MARKER_FILE)

#: The folder where runs go when a config names no ``output``.
RESULTS_ROOT = "results"

#: The full-precision reference: its policy name in records.jsonl and its key in metrics.json.
BASELINE = "baseline"

#: The metrics.json section of the later task entries of a kind already in the config (a second perplexity task):
#: ``{"tasks[1]": {"kind": "perplexity", "baseline": {...}, "policies": {...}}}``; the first entry of each kind
#: keeps the top level (:func:`kveval.results.store.task_label`).
TASK_ENTRIES = "tasks"


def _bad_char(text: str) -> str | None:
    for ch in text:
        if ch == "\0" or ord(ch) < 32 or ord(ch) == 127:
            return repr(ch)
    return None


def check_run_name(name: str) -> str:
    """``name`` when it can name a run folder under ``results/``: one plain path component (no ``/`` or ``\\``,
    not ``.`` or ``..``, no control characters, not empty); else :class:`KvevalError` (one line)."""
    if not isinstance(name, str) or not name.strip():
        raise KvevalError("name: must not be empty; give the run a name such as int4_g64")
    bad = _bad_char(name)
    if bad:
        raise KvevalError(f"name: {name!r} holds the control character {bad}; use letters, digits, '-', '_' or '.'")
    if "/" in name or "\\" in name:
        raise KvevalError(f"name: {name!r} holds a path separator; a run name is one folder name under results/ "
                          "(set output: to choose another place)")
    if name.strip(".") == "":  # ".", ".." and the like: the results folder itself, or above it
        raise KvevalError(f"name: {name!r} is not a folder name; give the run a name such as int4_g64")
    return name


def run_folder(name: str, output: str | os.PathLike[str] | None = None) -> Path:
    """The run folder of a config: ``output`` with ``~`` expanded, else ``results/<name>``.

    Checks before anything is written, each failure a one-line :class:`KvevalError`: ``name`` is one plain path
    component (:func:`check_run_name`: no separators, not ``.``/``..``), so ``results/<name>`` stays inside
    ``results/``; ``output`` is not empty, has no control characters, and a leading ``~`` names a known home
    folder (never a literal ``./~``). ``output`` may point anywhere the user chooses (``../elsewhere``, an
    absolute path); whether the folder there may be written is the run's lock and ownership check
    (:mod:`kveval.results.lock`, :meth:`kveval.results.store.RunDir.check`).
    """
    check_run_name(name)
    if output is None:
        return Path(RESULTS_ROOT) / name
    text = os.fspath(output)
    if not text.strip():
        raise KvevalError("output: must not be empty; give a folder such as results/my_run, or leave it out")
    bad = _bad_char(text)
    if bad:
        raise KvevalError(f"output: {text!r} holds the control character {bad}; give a plain folder path")
    if text.startswith("~"):
        expanded = os.path.expanduser(text)
        if expanded.startswith("~"):
            raise KvevalError(f"output: {text!r}: no such user's home folder; give an absolute path or one "
                              "relative to the current folder")
        text = expanded
    return Path(text)


__all__ = ["BASELINE", "CONFIG_FILE", "ENV_FILE", "LOCK_FILE", "MARKER_FILE", "METRICS_FILE", "OWN_FILES",
           "PLOTS_DIR", "RECORDS_FILE", "REPORT_FILES", "RESULTS_ROOT", "SCALES_FILE", "SCALES_USED_FILE",
           "TABLES_DIR", "TASK_ENTRIES", "check_run_name", "run_folder"]
