"""What a task gets from the run, one type per phase: :class:`CheckContext` (``ctx`` in ``check(ctx, params)``,
before the results folder is opened) and :class:`TaskContext` (``ctx`` in ``run(ctx, params)``: the same, with the
open folder and the entry's records). No field changes type between the phases.

The run (``kveval.commands.run``) builds the check context once it has loaded the model, and one task context per
task entry (:meth:`CheckContext.for_entry`). What a task may read of
the experiment config is :class:`RunSettings`: the config (``kveval.config.ExperimentConfig``) satisfies it, and
a task never imports the config's schema, which sits above the tasks (the schema is built from their ``Params``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
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


@dataclass(kw_only=True)
class CheckContext:
    """What a task's ``check(ctx, params)`` gets, before the results folder is opened: the config, the loaded model
    and data, and a way to report progress.

    ``cfg``: the experiment config (:class:`RunSettings`). ``info``: :func:`kveval.models.model_info` of the model.
    ``cache``: what tasks keep between entries of one run (the corpus tokens under ``"tokens"``, tokenized
    haystacks). ``weights``: ``model.weights``'s variants, ``{VARIANT: kveval.weights.apply.PreparedVariant}``
    checked against the model (empty: the checkpoint alone). A test or a notebook builds one by hand
    (``CheckContext(cfg=..., model=..., ...)``; a task reads only the fields it needs).
    """

    cfg: RunSettings
    model: torch.nn.Module
    tokenizer: Any
    policies: dict[str, KVPolicy]
    info: dict[str, Any]
    progress: Progress
    console: Any = None
    cache: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, Any] = field(default_factory=dict)

    def tokens(self) -> torch.Tensor:
        """The corpus as token ids ``[n_tokens]`` (loaded once, cached on disk per tokenizer and corpus)."""
        if "tokens" not in self.cache:
            from kveval.data import load_tokens

            d = self.cfg.data
            self.cache["tokens"] = load_tokens(d.source, self.tokenizer, split=d.split, text_field=d.text_field)
            self._loaded_tokens(self.cache["tokens"])
        return self.cache["tokens"]

    def _loaded_tokens(self, tokens: torch.Tensor) -> None:
        """Called once when the corpus is first loaded (nothing to record before the folder is open)."""

    def for_entry(self, folder: RunDir, records: TaskRecords) -> TaskContext:
        """The context of one task entry's ``run``, once ``folder`` is open: the same config, model, policies and
        cache (shared, not copied), with the folder and the entry's view of its records."""
        shared = {f.name: getattr(self, f.name) for f in fields(CheckContext)}
        return TaskContext(**shared, folder=folder, run=records)


@dataclass(kw_only=True)
class TaskContext(CheckContext):
    """What a task's ``run(ctx, params)`` gets: a :class:`CheckContext` with the open results folder.

    ``folder``: the run folder (:class:`kveval.results.RunDir`); ``run``: that folder as this task entry sees it
    (:class:`kveval.results.TaskRecords`: ``done_keys``, ``append``, ``records``, ``path``). Tokens loaded now are
    checked against the tokens the folder's records were computed on.
    """

    folder: RunDir
    run: TaskRecords

    def _loaded_tokens(self, tokens: torch.Tensor) -> None:
        from kveval.results.store import tokens_digest

        self.folder.record_tokens(tokens_digest(tokens))


__all__ = ["CheckContext", "DataSettings", "ModelSettings", "RunSettings", "TaskContext"]
