"""The experiment config: a closed, typed schema (unknown keys are errors with a "did you mean").

A config is pure data (YAML); nothing in it is executed. Shape::

    name: int4_g64
    model: builtin:smollm2-135m          # or {name: ..., device: cpu|cuda|auto, dtype: float32|float64|...,
                                         #     weights: [int8_channel, int4_g64]}  (weight variants x KV policies)
                                         # big models: {name: ..., device_map: auto, max_memory: {0: 70GiB, cpu: 200GiB}}
    data: builtin                        # or {source: builtin|wikitext2|pg19|PATH, text_field: text}
    kv: [fp16, int4_g64]                 # preset names, or {policies: {NAME: POLICY}}, or one POLICY mapping
    tasks:
      - TASK: {seq_len: 512}             # a task of kveval/tasks/ with its parameters, or a task preset's name
    threshold: {delta_ppl_pct: 1.0}
    memory: {gpu_memory: 80GiB}          # max_batch in metrics.json is computed for this GPU size
    output: results/int4_g64             # default: results/<name>
    seed: 0

``load_config(path, overrides)`` returns an ``ExperimentConfig`` or raises ``KvevalError`` with one line such as
``configs/x.yaml: tasks[0].TASK.seq_lenn: unknown key; did you mean 'seq_len'?``.

- ``schema``: :class:`ExperimentConfig` and its parts, the closed pydantic models (the task entries built from the
  tasks' parameter classes);
- ``load``: reading the YAML, shorthands and task presets, ``-s path=value`` overrides, :func:`validate`,
  :func:`load_config`, one-line schema errors (:func:`schema_error_line`), ``--allow-code`` (:func:`code_allowed`);
- ``checks``: the inputs on this machine (:func:`check_inputs`, :func:`check_writable_path`), each task's own
  checks through its parameter module's hook (:mod:`kveval.tasks`).

No task is named here: what concerns one task is declared by that task (:mod:`kveval.tasks` describes the hooks).
"""

from kveval.config.checks import check_inputs, check_writable_path, input_files
from kveval.config.load import (
    ALLOW_CODE_HINT,
    MAX_CONFIG_BYTES,
    code_allowed,
    load_config,
    parse_overrides,
    schema_error_line,
    task_presets,
    validate,
)
from kveval.config.schema import (
    MAX_BOOTSTRAP,
    MAX_GPU_MEMORY,
    MAX_NAME_CHARS,
    MAX_SEED,
    MAX_TOKENS,
    TASK_TYPES,
    CalibrationConfig,
    DataConfig,
    ExperimentConfig,
    KVConfig,
    MemoryConfig,
    ModelConfig,
    TaskEntry,
    Threshold,
)

__all__ = ["ALLOW_CODE_HINT", "MAX_BOOTSTRAP", "MAX_CONFIG_BYTES", "MAX_GPU_MEMORY", "MAX_NAME_CHARS", "MAX_SEED",
           "MAX_TOKENS", "TASK_TYPES", "CalibrationConfig", "DataConfig", "ExperimentConfig", "KVConfig",
           "MemoryConfig", "ModelConfig", "TaskEntry", "Threshold", "check_inputs", "check_writable_path",
           "code_allowed", "input_files", "load_config", "parse_overrides", "schema_error_line", "task_presets", "validate"]
