"""What a task gets from the run: :class:`TaskContext` (``ctx`` in ``check(ctx, params)`` and ``run(ctx, params)``).

The run (``kveval.commands.run``) builds it once it has loaded the model; a test or a notebook can build one by
hand (``TaskContext(cfg=..., model=..., ...)``; a task reads only the fields it needs). What a task may read of
the experiment config is :class:`RunSettings`: the config (``kveval.config.ExperimentConfig``) satisfies it, and
a task never imports the config's schema, which sits above the tasks (the schema is built from their ``Params``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kveval.policy import KVPolicy
from kveval.progress import Progress

if TYPE_CHECKING:
    from kveval.results import RunDir, TaskRecords


class DataSettings(Protocol):
    """The corpus: ``source`` (builtin, wikitext2, pg19, a file), ``text_field``, ``split``."""

    @property
    def source(self) -> str: ...
    @property
    def text_field(self) -> str: ...
    @property
    def split(self) -> str | None: ...


class ModelSettings(Protocol):
    """The model as the config names it: ``name`` and ``dtype``."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...


class RunSettings(Protocol):
    """The parts of the experiment config a task reads: the run's ``name`` and ``seed``, ``data``, ``model``,
    ``threshold`` (``delta_ppl_pct``, ``kld``), ``memory`` (``context``, ``gpu_memory``), ``calibration`` and
    whether the command line allowed code (``allow_code``)."""

    @property
    def name(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def data(self) -> DataSettings: ...
    @property
    def model(self) -> ModelSettings: ...
    @property
    def threshold(self) -> Any: ...
    @property
    def memory(self) -> Any: ...
    @property
    def calibration(self) -> Any: ...
    @property
    def allow_code(self) -> bool: ...


@dataclass
class TaskContext:
    """What a task gets: the config, the loaded model and data, the run folder, and a way to report progress.

    ``cfg``: the experiment config (:class:`RunSettings`). ``run``: inside a task's ``run``, the folder as that task
    entry sees it (:class:`kveval.results.TaskRecords`: ``done_keys``, ``append``, ``records``, ``path``);
    elsewhere the :class:`kveval.results.RunDir` itself, None before the folder is opened (task checks).
    ``info``: :func:`kveval.models.model_info` of the model. ``cache``: what tasks keep between entries of one run
    (the corpus tokens under ``"tokens"``, tokenized haystacks). ``weights``: ``model.weights``'s variants,
    ``{VARIANT: kveval.weights.apply.PreparedVariant}`` checked against the model (empty: the checkpoint alone).
    """

    cfg: RunSettings
    model: torch.nn.Module
    tokenizer: Any
    policies: dict[str, KVPolicy]
    info: dict[str, Any]
    progress: Progress
    run: RunDir | TaskRecords | None = None
    console: Any = None
    cache: dict[str, Any] = field(default_factory=dict)
    folder: RunDir | None = None
    weights: dict[str, Any] = field(default_factory=dict)

    def tokens(self) -> torch.Tensor:
        """The corpus as token ids ``[n_tokens]`` (loaded once, cached on disk per tokenizer and corpus). Loaded
        after the run folder is open, they are checked against the tokens its records were computed on."""
        if "tokens" not in self.cache:
            from kveval.data import load_tokens
            from kveval.results.store import tokens_digest

            d = self.cfg.data
            self.cache["tokens"] = load_tokens(d.source, self.tokenizer, split=d.split, text_field=d.text_field)
            if self.folder is not None:
                self.folder.record_tokens(tokens_digest(self.cache["tokens"]))
        return self.cache["tokens"]


__all__ = ["DataSettings", "ModelSettings", "RunSettings", "TaskContext"]
