"""Hostile lm-eval inputs: include folders that hold code (a config is pure data: `--allow-code` or nothing runs),
templates that reach into Python, null text fields, unknown task names through `kveval lm-eval`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "tasks" / "lm_eval"


def _data_task(folder: Path, name: str, rows: str, *, doc_to_text: str = "Q: {{q}}\\nA:") -> Path:
    """A pure-data lm-eval task (no Python): a JSONL file read by the datasets json builder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder.parent / f"{name}.jsonl"
    data.write_text(rows)
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"output_type: generate_until\ntest_split: test\ndoc_to_text: \"{doc_to_text}\"\ndoc_to_target: a\n"
        "generation_kwargs: {max_gen_toks: 2, until: ['\\n']}\nmetric_list: [{metric: exact_match}]\n"
    )
    return folder


def _code_task(folder: Path, planted: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "evil.yaml").write_text(
        "task: evil\ndataset_path: ''\ncustom_dataset: !function utils.ds\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: q\ndoc_to_choice: ['a', 'b']\ndoc_to_target: 0\n")
    (folder / "utils.py").write_text(f"open({str(planted)!r}, 'w').write('x')\ndef ds(**k):\n    raise SystemExit(0)\n")
    return folder


def _config(h, tmp_path, include: Path, tasks: list[str], **lm) -> Path:
    raw = h.tiny_raw(tmp_path / "out", tasks=[{"lm_eval": {"tasks": tasks, "include_path": str(include), "limit": 2,
                                                          **lm}}])
    return h.write_config(tmp_path / "c.yaml", raw)


def test_include_path_with_python_is_refused_at_run(h, tmp_path):
    planted = tmp_path / "PWNED"
    cfg = _config(h, tmp_path, _code_task(tmp_path / "inc", planted), ["evil"])
    h.assert_user_error(h.invoke("run", cfg), "holds code", "utils.py", "--allow-code")
    assert not planted.exists(), "code from the include folder ran"
    assert not (tmp_path / "out").exists()


def test_include_path_with_python_is_refused_by_validate(h, tmp_path):
    planted = tmp_path / "PWNED"
    cfg = _config(h, tmp_path, _code_task(tmp_path / "inc", planted), ["evil"])
    h.assert_user_error(h.invoke("validate", cfg), "holds code", "--allow-code")
    assert not planted.exists()


def test_function_tag_without_a_python_file_is_code(h, tmp_path):
    inc = _data_task(tmp_path / "inc", "t1", '{"q": "a", "a": "b"}\n')
    (inc / "t1.yaml").write_text((inc / "t1.yaml").read_text() + "process_docs: !function os.listdir\n")
    h.assert_user_error(h.invoke("validate", _config(h, tmp_path, inc, ["t1"])), "t1.yaml: !function")


def test_code_in_an_included_yaml_outside_the_folder(h, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "base.yaml").write_text("process_results: !function helpers.score\n")
    inc = _data_task(tmp_path / "inc", "t2", '{"q": "a", "a": "b"}\n')
    (inc / "t2.yaml").write_text(f"include: {outside / 'base.yaml'}\n" + (inc / "t2.yaml").read_text())
    h.assert_user_error(h.invoke("validate", _config(h, tmp_path, inc, ["t2"])), "base.yaml: !function")


def test_dataset_remote_code_is_code(h, tmp_path):
    inc = _data_task(tmp_path / "inc", "t3", '{"q": "a", "a": "b"}\n')
    text = (inc / "t3.yaml").read_text().replace("dataset_kwargs:\n", "dataset_kwargs:\n  trust_remote_code: true\n")
    (inc / "t3.yaml").write_text(text)
    h.assert_user_error(h.invoke("validate", _config(h, tmp_path, inc, ["t3"])), "trust_remote_code")


def test_include_path_that_is_the_whole_disk(h, tmp_path, monkeypatch):
    import kveval.tasks.lm_eval.include as task  # the include-path check's home

    inc = tmp_path / "big"
    inc.mkdir()
    for i in range(30):
        (inc / f"f{i}.txt").write_text("")
    monkeypatch.setattr(task, "MAX_INCLUDE_FILES", 20)
    h.assert_user_error(h.invoke("validate", _config(h, tmp_path, inc, ["x"])), "more than 20 files")


def test_the_shipped_example_folder_is_trusted_but_a_copy_is_not(h, tmp_path):
    from kveval.tasks.lm_eval.task import check_include_path

    assert check_include_path(str(SHIPPED), allow_code=False) == str(SHIPPED.resolve())
    copy = tmp_path / "lmeval_tasks"
    shutil.copytree(SHIPPED, copy)
    h.assert_user_error(h.invoke("validate", _config(h, tmp_path, copy, ["kveval_facts_mc"])), "utils.py")


def test_allow_code_runs_a_code_folder(h, tmp_path):
    copy = tmp_path / "lmeval_tasks"
    shutil.copytree(SHIPPED, copy)
    cfg = _config(h, tmp_path, copy, ["kveval_facts_mc"])
    result = h.invoke("run", cfg, "--allow-code", "--quiet")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "metrics.json").is_file()


def test_pure_data_folder_runs_without_the_flag(h, tmp_path):
    rows = "".join(f'{{"q": "What is {i} plus {i}?", "a": "{2 * i}"}}\n' for i in range(3))
    cfg = _config(h, tmp_path, _data_task(tmp_path / "inc", "sums", rows), ["sums"])
    result = h.invoke("run", cfg, "--quiet")
    assert result.exit_code == 0, result.output


def test_template_that_reaches_into_python_is_refused(h, tmp_path):
    inc = _data_task(tmp_path / "inc", "ssti", '{"q": "hi", "a": "x"}\n',
                     doc_to_text="{{ q.__class__.__mro__[1].__subclasses__() }}")
    h.assert_user_error(h.invoke("run", _config(h, tmp_path, inc, ["ssti"])), "reaches into Python",
                        "--allow-code")
    assert not (tmp_path / "out").exists()


def test_null_text_field_names_the_document(h, tmp_path):
    rows = '{"q": "hi", "a": "x"}\n{"q": null, "a": "y"}\n'
    cfg = _config(h, tmp_path, _data_task(tmp_path / "inc", "nulls", rows), ["nulls"])
    h.assert_user_error(h.invoke("run", cfg), "document 1", "line 2", "q: null")
    assert not (tmp_path / "out").exists()


def test_null_target_names_the_document(h, tmp_path):
    rows = '{"q": "hi", "a": "x"}\n{"q": "ho", "a": null}\n'
    cfg = _config(h, tmp_path, _data_task(tmp_path / "inc", "nullt", rows), ["nullt"])
    h.assert_user_error(h.invoke("run", cfg), "a: null", "doc_to_target")


def test_unknown_task_through_kveval_lm_eval(h, monkeypatch):
    from lm_eval.tasks import TaskManager

    class LocalOnly(TaskManager):
        """lm-eval's TaskManager without its ~15k builtin tasks (indexing them takes ~20 s)."""

        def __init__(self, *args, **kwargs):
            kwargs["include_defaults"] = False
            super().__init__(*args, **kwargs)

    monkeypatch.setattr("lm_eval.tasks.TaskManager", LocalOnly)
    result = h.invoke("lm-eval", "--kv", "int8", "--pretrained", "builtin:tiny-llama", "--", "--tasks",
                      "no_such_task_xyz", "--limit", "1")
    h.assert_user_error(result, "no_such_task_xyz")


def test_policy_file_with_duplicate_keys(tmp_path):
    from kveval.errors import KvevalError
    from kveval.tasks.lm_eval.bridge import resolve_policy

    (tmp_path / "p.yaml").write_text("key: int4_g64\nkey: int8\n")
    with pytest.raises(KvevalError, match="duplicate key 'key'"):
        resolve_policy(str(tmp_path / "p.yaml"))
