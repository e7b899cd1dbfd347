"""User text on kveval's console lines is printed as text, never parsed as rich markup (kveval.messages, the one
path of every error, usage error, warning and log line): ``[/]`` in a user's value raised rich's MarkupError (a
traceback, exit 1) and ``[x]`` vanished from the line. Each error path runs through the CLI with both in the value
and must print one ``error:`` line, exit status 2, the value shown literally; control characters in a value are
shown escaped, so that the error stays one line."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from rich.console import Console

from kveval.errors import KvevalError
from kveval.messages import one_line, print_error, print_warning

VALUES = ["[/]", "[x]", "a[/]b[bold]c"]


@pytest.fixture(params=VALUES, ids=["close-tag", "tag", "mixed"])
def value(request) -> str:
    return request.param


def test_an_unknown_command(h, value):
    h.assert_user_error(h.invoke(f"memory{value}"), f"No such command 'memory{value}'")


def test_an_unknown_option(h, value, tmp_path):
    h.assert_user_error(h.invoke("run", tmp_path / "c.yaml", f"--overwrit{value}"), f"--overwrit{value}")


def test_ls_grep(h, value):
    h.assert_user_error(h.invoke("ls", "--grep", value), f"nothing holds '{value}'")


def test_ls_of_an_unknown_list(h, value):
    h.assert_user_error(h.invoke("ls", f"presets{value}"), f"kveval ls presets{value}: not a list")


def test_memory_gpu(h, value):
    h.assert_user_error(h.invoke("memory", "--shape", "llama-7b-mha", "--gpu", value), f"--gpu {value}")


def test_a_missing_config(h, value, tmp_path):
    path = tmp_path / f"c{value}.yaml"
    h.assert_user_error(h.invoke("validate", path), str(path), "does not exist")


def test_a_missing_run_folder(h, value, tmp_path):
    h.assert_user_error(h.invoke("report", tmp_path / f"run{value}"), f"run{value}")


def test_a_prompt_files_checker(h, value, tmp_path):
    """The checker is echoed in the refusal: validate crashed on ``"[/]"``."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "2+2?", "answer": "4", "checker": value}) + "\n")
    raw = h.tiny_raw(tmp_path / "run", tasks=[{"generation": {"prompts": str(prompts), "max_new_tokens": 4}}])
    line = h.assert_user_error(h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw)), "unknown answer checker")
    assert repr(value) in line, line


def test_a_config_value(h, value, tmp_path):
    raw = h.tiny_raw(tmp_path / "run", kv=[f"int8{value}"])
    h.assert_user_error(h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw)), f"int8{value}")


def test_the_sweep_install_hint_keeps_its_extra(h, tmp_path, monkeypatch):
    """kveval's own hint ``pip install 'kveval[sweep]'`` printed as ``pip install 'kveval'``."""
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError
    one = h.write_config(tmp_path / "one.yaml", h.tiny_raw())
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"name": "s", "output": str(tmp_path / "sweep"), "runs": [{"config": str(one)}]}))
    h.assert_user_error(h.invoke("sweep", sweep), "pip install 'kveval[sweep]'")


def test_the_lm_eval_install_hint_keeps_its_extra(h, tmp_path, monkeypatch):
    import kveval.tasks.lm_eval.task as lm_task

    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # from lm_eval.tasks import ...: ImportError
    monkeypatch.setattr(lm_task, "_TASK_MANAGERS", {})
    with pytest.raises(KvevalError) as info:
        lm_task.task_manager(None, ["arc_easy"])
    console = Console(record=True, width=300)
    print_error(console, info.value)
    assert "pip install 'kveval[lmeval]'" in console.export_text()


def test_the_printers_show_text_literally_on_one_line():
    console = Console(record=True, width=300)
    print_error(console, "a [/] b [x] c\nd\re\x1b[31m")
    print_warning(console, "w [bold]x[/bold]")
    lines = console.export_text().splitlines()
    assert lines == ["error: a [/] b [x] c\\nd\\re\\x1b[31m", "warning: w [bold]x[/bold]"]
    assert one_line("tab\there\u2028") == "tab\\there\\u2028"


def test_progress_log_lines_are_text():
    from kveval.progress import Progress

    console = Console(record=True, width=300, force_terminal=False)
    Progress(console, quiet=True).log("calibration: reusing /tmp/scales[/]x.safetensors")
    assert console.export_text().strip() == "calibration: reusing /tmp/scales[/]x.safetensors"
