"""A failing command's stderr is its one error line, with no progress bar or library warning before it, when
stderr is not a terminal (kveval.cli.quiet_libraries_unless_terminal): real processes, as a user's shell or CI runs
them, failing after the model is loaded (the weights' loading and a GGUF conversion draw progress bars) and inside
lm-eval (which logs warnings and draws bars)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kveval.models import build_tiny_model, byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kveval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def short_corpus_config(tmp_path: Path, model: str, **extra) -> Path:
    """A config that fails after its model is loaded: the corpus is shorter than one window."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("just a few words here\n")
    raw = {"name": "short", "model": model, "data": str(corpus), "kv": ["int8"],
           "tasks": [{"perplexity": {"seq_len": 512}}], "output": str(tmp_path / "run"), **extra}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_failure_after_loading_a_folder_model_is_one_line(tmp_path):
    folder = tmp_path / "tiny"
    build_tiny_model("tiny-llama").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    one_line(run_cli(["run", str(short_corpus_config(tmp_path, str(folder)))]), "fewer than one window")


def test_lm_eval_warnings_and_bars_stay_off_stderr(tmp_path):
    """An lm-eval task that fails on its documents (a null field): lm-eval has logged warnings and drawn bars by
    then; stderr holds the one line."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "broken.jsonl"
    data.write_text('{"q": "What is 1 + 1?", "a": "2"}\n{"q": null, "a": "3"}\n')
    (tasks / "broken.yaml").write_text(
        f"task: kveval_broken\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: generate_until\ntest_split: test\ndoc_to_text: \"Q: {{q}}\\nA:\"\ndoc_to_target: a\n"
        "generation_kwargs: {max_gen_toks: 2, until: ['\\n']}\nmetric_list: [{metric: exact_match}]\n")
    raw = {"name": "lm", "model": "builtin:tiny-llama", "kv": ["int8"], "output": str(tmp_path / "run"),
           "tasks": [{"lm_eval": {"tasks": ["kveval_broken"], "include_path": str(tasks)}}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    one_line(run_cli(["run", str(path)], env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}), "q: null")


@pytest.mark.integration
def test_a_failure_after_a_gguf_conversion_is_one_line(tmp_path):
    """A fresh cache: the builtin model's GGUF is converted (transformers draws a bar over its tensors), then the
    run fails on its corpus; stderr is kveval's own line about the conversion and the error line."""
    proc = run_cli(["run", str(short_corpus_config(tmp_path, "builtin:smollm2-135m"))],
                   env={"KVEVAL_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and "fewer than one window" in lines[-1], proc.stderr
    assert all(line.startswith("kveval: converting") for line in lines[:-1]) and len(lines) <= 2, proc.stderr


def test_quieting_after_a_bare_huggingface_hub_import():
    """A caller that imported huggingface_hub without its utils submodule (its lazy ``__getattr__`` has no
    ``utils`` then): quieting the libraries must still work. Before, it raised AttributeError, so a bad-input
    command run through typer's CliRunner exited 1 with that error instead of 2 with its one line."""
    code = ("import io, sys, huggingface_hub\n"
            "assert 'huggingface_hub.utils' not in sys.modules\n"
            "from kveval.cli import quiet_libraries_unless_terminal\n"
            "print(quiet_libraries_unless_terminal(io.StringIO()))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
