"""The hooks by which a task tells the config what concerns it (kveval/tasks/__init__.py): a parameter module's
``check_inputs``, called by :func:`kveval.config.check_inputs` for each entry of that task, and the class-level
declarations ``Params.OMITTED_AT_DEFAULT`` and ``Params.MEASURES_WEIGHT_VARIANTS``, read generically."""

from __future__ import annotations

import types

import pytest

from kveval.config import TASK_TYPES, check_inputs, validate
from kveval.errors import KvevalError
from kveval.tasks import TASKS

HOOKED = "needle"  # a task whose real parameter module has no hook of its own: the fake one lends it one


def _config(tmp_path, *tasks, **model) -> dict:
    return {"name": "t", "model": {"name": "builtin:tiny-llama", **model}, "kv": ["int8"], "tasks": list(tasks),
            "output": str(tmp_path / "out")}


@pytest.fixture
def hook_calls(monkeypatch) -> list[tuple]:
    """``HOOKED``'s parameter module replaced by a fake one whose ``check_inputs`` records its calls (and raises
    for ``trials: 7``)."""
    calls: list[tuple] = []

    def check(params, *, allow_code: bool) -> None:
        calls.append((params, allow_code))
        if params.trials == 7:
            raise KvevalError("tasks: needle.trials 7 is refused by the task's own check")

    fake = types.ModuleType("fake_params")
    fake.NAME, fake.Params, fake.check_inputs = HOOKED, TASK_TYPES[HOOKED], check
    real = TASKS.params_module
    monkeypatch.setattr(TASKS, "params_module", lambda name: fake if name == HOOKED else real(name))
    return calls


def test_check_inputs_calls_each_entrys_hook_with_the_run_opt_in(tmp_path, hook_calls):
    entries = [{HOOKED: {"context_lengths": [64]}}, {"perplexity": {"seq_len": 32}}, {HOOKED: {"trials": 3}}]
    cfg = validate(_config(tmp_path, *entries), allow_code=True)
    check_inputs(cfg)
    assert [(type(p), p.trials, allow) for p, allow in hook_calls] == [
        (TASK_TYPES[HOOKED], 2, True), (TASK_TYPES[HOOKED], 3, True)]  # once per entry of that task, in order


def test_a_hooks_error_is_one_line_after_the_config_name(tmp_path, hook_calls):
    cfg = validate(_config(tmp_path, {HOOKED: {"trials": 7}}))
    with pytest.raises(KvevalError) as err:
        check_inputs(cfg, "configs/x.yaml")
    assert str(err.value) == "configs/x.yaml: tasks: needle.trials 7 is refused by the task's own check"
    assert hook_calls[0][1] is False  # no --allow-code: the hook is told so


def test_a_task_without_a_hook_is_not_asked():
    module = TASKS.params_module("perplexity")
    assert not hasattr(module, "check_inputs")
    TASKS.check_inputs("perplexity", TASK_TYPES["perplexity"](), allow_code=False)  # nothing to call, no error


def test_the_lm_eval_hook_refuses_an_include_folder_with_code(tmp_path):
    """The one task with input checks today: its include folder must exist and hold no code without the opt-in."""
    module = TASKS.params_module("lm_eval")
    params = TASK_TYPES["lm_eval"](tasks=["t"], include_path=str(tmp_path))
    (tmp_path / "utils.py").write_text("x = 1\n")
    with pytest.raises(KvevalError, match="holds code that lm-eval would run"):
        module.check_inputs(params, allow_code=False)
    module.check_inputs(params, allow_code=True)
    with pytest.raises(KvevalError, match="is not a folder"):
        TASKS.check_inputs("lm_eval", TASK_TYPES["lm_eval"](tasks=["t"], include_path=str(tmp_path / "no")),
                           allow_code=True)


def test_omitted_at_default_is_read_from_each_tasks_params(tmp_path, monkeypatch):
    assert TASK_TYPES["perplexity"].OMITTED_AT_DEFAULT == {"start_token": 0, "batch_size": 1}
    declared = {name for name, cls in TASK_TYPES.items() if getattr(cls, "OMITTED_AT_DEFAULT", {})}
    assert declared == {"needle", "perplexity"}  # needle: max_drop, added after run folders were written
    assert TASK_TYPES["needle"].OMITTED_AT_DEFAULT == {"max_drop": 5.0}
    monkeypatch.setattr(TASK_TYPES[HOOKED], "OMITTED_AT_DEFAULT", {"trials": 2, "generate": True}, raising=False)
    entries = [{"perplexity": {"seq_len": 32}}, {"perplexity": {"seq_len": 32, "start_token": 5}},
               {HOOKED: {}}, {HOOKED: {"trials": 3, "generate": False}}]
    tasks = validate(_config(tmp_path, *entries)).resolved()["tasks"]
    assert "start_token" not in tasks[0]["perplexity"] and tasks[1]["perplexity"]["start_token"] == 5
    assert not {"trials", "generate"} & set(tasks[2][HOOKED])  # left out at the declared values
    assert (tasks[3][HOOKED]["trials"], tasks[3][HOOKED]["generate"]) == (3, False)


def test_the_weight_variants_rule_is_read_from_params(tmp_path, monkeypatch):
    assert [n for n, cls in TASK_TYPES.items() if getattr(cls, "MEASURES_WEIGHT_VARIANTS", False)] == ["perplexity"]
    raw = _config(tmp_path, {"perplexity": {"seq_len": 32}}, {HOOKED: {}}, weights=["int8_channel"])
    with pytest.raises(KvevalError, match=r"measured by the perplexity task only; tasks\[1\] \(needle\) would run"):
        validate(raw)
    monkeypatch.setattr(TASK_TYPES[HOOKED], "MEASURES_WEIGHT_VARIANTS", True, raising=False)
    assert validate(raw).model.weights  # both tasks measure the variants now
    monkeypatch.setattr(TASK_TYPES["perplexity"], "MEASURES_WEIGHT_VARIANTS", False)
    with pytest.raises(KvevalError, match=r"measured by the needle task only; tasks\[0\] \(perplexity\) would run"):
        validate(raw)
