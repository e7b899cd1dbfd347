"""Files that hang: a FIFO (or another special file) where kveval reads a user's file is refused before it is
opened (kveval.fileio.open_regular / check_regular, the one way kveval opens such a file), in one line, instead of
blocking forever in open(); and an answer regex of a prompt file runs under a time bound. Each command runs in a
subprocess with a timeout, so that a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_stderr_one_line import one_line  # the one-line error check of every reliability test

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")


def kveval(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``kveval ARGS`` in a subprocess; a command still running after TIMEOUT_S fails the test (it hung)."""
    try:
        return subprocess.run([sys.executable, "-m", "kveval", *map(str, args)], cwd=cwd or ROOT, capture_output=True,
                              text=True, timeout=TIMEOUT_S,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"kveval {' '.join(map(str, args))} hung (still running after {TIMEOUT_S} s)")


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def config(tmp_path: Path, **extra) -> Path:
    raw = {"name": "tiny", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8"],
           "tasks": [{"perplexity": {"seq_len": 32, "max_tokens": 96, "bootstrap": 20, "noise_windows": 0}}],
           "output": str(tmp_path / "run"), **extra}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_validate_on_a_fifo_config(tmp_path):
    one_line(kveval("validate", fifo(tmp_path / "c.yaml")), "config file", "not a regular file")


def test_run_on_a_fifo_config(tmp_path):
    one_line(kveval("run", fifo(tmp_path / "c.yaml")), "config file", "not a regular file")


def test_sweep_on_a_fifo_sweep_file(tmp_path):
    one_line(kveval("sweep", fifo(tmp_path / "s.yaml")), "sweep file", "not a regular file")


def test_a_sweep_naming_a_fifo_config(tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"name": "s", "runs": [{"config": str(fifo(tmp_path / "one.yaml"))}]}))
    one_line(kveval("sweep", sweep, "--dry-run"), "one.yaml", "not a regular file")


def test_a_fifo_plan_file(tmp_path):
    one_line(kveval("deploy", fifo(tmp_path / "p.plan.json")), "p.plan.json")


def test_a_fifo_corpus(tmp_path):
    one_line(kveval("validate", config(tmp_path, data=str(fifo(tmp_path / "corpus.txt")))), "corpus.txt")


def test_a_fifo_policy_file_of_lm_eval(tmp_path):
    """``kveval lm-eval --kv FILE``'s policy file (read once lm-eval builds the model)."""
    code = ("import sys\nfrom kveval.tasks.lm_eval.bridge import resolve_policy\nfrom kveval.errors import KvevalError\n"
            "try:\n    resolve_policy(sys.argv[1])\nexcept KvevalError as exc:\n    print(exc)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(fifo(tmp_path / "policy.yaml"))], cwd=ROOT,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the policy file's FIFO was opened")
    assert "policy file" in proc.stdout and "not a regular file" in proc.stdout, (proc.stdout, proc.stderr)


def test_a_fifo_in_an_include_folder(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    fifo(tasks / "t.yaml")
    path = config(tmp_path, tasks=[{"lm_eval": {"tasks": ["t"], "include_path": str(tasks)}}])
    one_line(kveval("validate", path), "include_path", "t.yaml", "not a regular file")


def test_a_model_folder_whose_config_json_is_a_fifo(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    fifo(folder / "config.json")
    (folder / "model.safetensors").write_bytes(b"")
    one_line(kveval("validate", config(tmp_path, model=str(folder))), "config.json")


def test_a_fifo_prompt_file(tmp_path):
    path = config(tmp_path, tasks=[{"generation": {"prompts": str(fifo(tmp_path / "p.jsonl"))}}])
    one_line(kveval("validate", path), "p.jsonl", "not a regular file")


def test_the_reading_helper_refuses_without_opening(tmp_path):
    from kveval.fileio import NOT_REGULAR, open_regular, read_regular_bytes

    path = fifo(tmp_path / "f")
    with pytest.raises(OSError, match="not a regular file") as info:
        open_regular(path)  # a blocking open() would never return: no writer
    assert info.value.strerror == NOT_REGULAR
    with pytest.raises(IsADirectoryError):
        read_regular_bytes(tmp_path)
    (tmp_path / "ok").write_bytes(b"data")
    assert read_regular_bytes(tmp_path / "ok") == b"data"


# --------------------------------------------------------------------------------------- answer regexes


_BOUND = """
import time
from kveval.errors import KvevalError
from kveval.tasks.generation.checkers import check_answer
t = time.perf_counter()
try:
    print(check_answer({{output!r}}, {{pattern!r}}, "regex", prompt="q-7"))
except KvevalError as exc:
    print("refused:", exc)
print(time.perf_counter() - t)
"""


def _check_in_subprocess(output: str, pattern: str) -> tuple[str, float]:
    code = _BOUND.replace("{{output!r}}", repr(output)).replace("{{pattern!r}}", repr(pattern))
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the search of {pattern!r} never returned")
    assert proc.returncode == 0, proc.stderr
    verdict, seconds = proc.stdout.strip().splitlines()
    return verdict, float(seconds)


def test_the_issues_regex_returns_on_a_96_character_output():
    """``(?s)(.+)+(?!)`` compiled and then never returned on a 96-character output."""
    verdict, seconds = _check_in_subprocess("x" * 96, r"(?s)(.+)+(?!)")
    assert verdict == "False" and seconds < 10


def test_a_regex_that_backtracks_without_end_is_one_line_naming_the_prompt():
    from kveval.tasks.generation.checkers import REGEX_TIMEOUT_S

    verdict, seconds = _check_in_subprocess("a" * 96 + "b", r"(a|aa)+$")
    assert verdict.startswith("refused: generation prompt 'q-7': its answer regex '(a|aa)+$' took longer than"), verdict
    assert seconds < REGEX_TIMEOUT_S + 10


def test_validate_refuses_a_pathological_answer_regex(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "say a", "answer": "(a|aa)+$", "checker": "regex", "id": "slow"}) + "\n")
    path = config(tmp_path, tasks=[{"generation": {"prompts": str(prompts), "max_new_tokens": 8}}])
    one_line(kveval("validate", path), f"{prompts}:1:", "(a|aa)+$", "takes longer than")


def test_an_ordinary_regex_still_checks():
    from kveval.tasks.generation.checkers import check_answer, check_checker

    check_checker("regex", r"(?i)\bparis\b")
    assert check_answer("It is Paris.", r"(?i)\bparis\b", "regex")
    assert not check_answer("It is Rome.", r"(?i)\bparis\b", "regex")
