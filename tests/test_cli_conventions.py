"""The command line follows the conventions of the tools its users know (issue #43): ``-h`` beside ``--help``,
``--version``, and ``-o/--output`` on every command that writes a results folder."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from kveval.cli import app


@pytest.mark.parametrize("args", [["-h"], ["run", "-h"], ["memory", "-h"], ["validate", "-h"]])
def test_short_help(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and "Usage:" in result.output
    assert result.output == CliRunner().invoke(app, [*args[:-1], "--help"]).output


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    result = CliRunner().invoke(app, [flag])
    assert result.exit_code == 0 and result.output.strip() == f"kveval {version('kveval')}"


def test_no_arguments_still_print_the_help():
    result = CliRunner().invoke(app, [])
    assert "Usage:" in result.output and "run" in result.output


@pytest.mark.parametrize("name", ["elsewhere", "yes", "123", "a b"])
def test_output_option_sets_the_results_folder(tmp_path, monkeypatch, name):
    """``-o`` is ``-s output=...`` with the path kept a name (``yes`` and ``123`` are not YAML's bool and int), and
    it wins over an ``-s output=`` before it."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"name": "c", "model": "builtin:tiny-llama", "kv": ["int8"], "tasks": ["ppl_quick"]}))
    for args in (["-o", name], ["--output", name], ["-s", "output=other", "-o", name]):
        result = CliRunner().invoke(app, ["validate", str(config), *args])
        assert result.exit_code == 0, result.output
        assert result.output.rstrip().endswith(f"output {name})"), result.output


@pytest.mark.parametrize("command", ["run", "scan", "validate", "sweep"])
@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_output_is_refused_not_the_current_folder(tmp_path, monkeypatch, command, empty):
    """`-o "$OUT"` with OUT unset was `-o ""`, which Path makes "." : the run wrote its files into the folder the
    user stood in. One line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    body = {"name": "c", "model": "builtin:tiny-llama", "kv": ["int8"], "tasks": ["ppl_quick"]}
    if command == "sweep":
        body = {"name": "s", "grid": {"models": ["builtin:tiny-llama"], "policies": ["int8"]},
                "base": {"tasks": ["ppl_quick"]}}
    config.write_text(json.dumps(body))
    result = CliRunner().invoke(app, [command, str(config), "-o", empty])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == ["error: -o: an empty folder name (an unset shell variable?); give the "
                                          "results folder, e.g. -o results/mine"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_run_and_scan_take_the_output_option():
    for command in ("run", "scan", "validate"):
        assert "--output" in CliRunner().invoke(app, [command, "--help"]).output


def test_deploy_refuses_an_unknown_engine_before_importing_torch():
    """``kveval deploy --engine vlm`` is one line with a suggestion, before anything heavy is imported (it took
    8.8 s when the check came after loading the target; 0.23 s now, measured in the note of issue #43)."""
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from kveval.cli import app; "
            "r = CliRunner().invoke(app, ['deploy', 'configs/int4_g64.yaml', '--engine', 'vlm']); "
            "print(r.exit_code, 'torch' in sys.modules); print(r.stderr.strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1])).stdout.splitlines()
    assert out[0] == "2 False", out
    assert out[1].startswith("error: --engine vlm: unknown engine; did you mean 'vllm'?") and len(out) == 2


def test_the_light_engine_names_are_the_engines():
    from kveval.engines.names import ENGINE_NAMES
    from kveval.engines.tables import ENGINES

    assert tuple(ENGINES) == ENGINE_NAMES


@pytest.mark.parametrize("override, words", [
    ("model.nme=x", "error: -s model.nme=x: model.nme: unknown key; did you mean 'name'?"),
    ("tasks.0.perplexity.seq_lenn=3", "error: -s tasks.0.perplexity.seq_lenn=3: tasks[0].perplexity.seq_lenn: "
                                      "unknown key; did you mean 'seq_len'?"),
    ("seed=abc", "error: -s seed=abc: seed: Input should be a valid integer"),
])
def test_a_typo_in_an_override_names_the_override_not_the_file(tmp_path, override, words):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"name": "c", "model": "builtin:tiny-llama", "kv": ["int8"], "tasks": ["ppl_quick"]}))
    result = CliRunner().invoke(app, ["validate", str(config), "-s", override])
    assert result.exit_code == 2 and result.stderr.strip().startswith(words), result.stderr
    config.write_text(json.dumps({"name": "c", "model": "builtin:tiny-llama", "kv": ["int8"], "tasks": ["ppl_quick"],
                                  "seedd": 1}))  # the file's own typo still names the file
    result = CliRunner().invoke(app, ["validate", str(config), "-s", "seed=1"])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {config}: seedd: unknown key")


@pytest.mark.parametrize("text, want", [("4096", 4096), (4096, 4096), ("32k", 32768), ("32K", 32768),
                                        ("128Ki", 131072), ("1M", 2**20), ("1mi", 2**20), ("1.5k", 1536),
                                        (" 8 k ", 8192)])
def test_counts_by_hand(text, want):
    from kveval.units import parse_count

    assert parse_count(text) == want


@pytest.mark.parametrize("text, words", [("32x", "is not a count"), ("1.5", "not a whole number"),
                                         ("0", "at least 1"), ("-4", "at least 1"), ("1e30", "too large"),
                                         ("32GB", "is not a count"), (True, "bad")])
def test_bad_counts_are_one_line(text, words):
    from kveval.errors import KvevalError
    from kveval.units import parse_count

    with pytest.raises(KvevalError, match=words):
        parse_count(text, "--context")


def test_memory_takes_counts_with_units():
    base = ["memory", "--shape", "llama-7b-gqa4", "--kv", "int4_g64"]
    with_unit = CliRunner().invoke(app, [*base, "--context", "32k", "--batch", "1k"])
    exact = CliRunner().invoke(app, [*base, "--context", "32768", "--batch", "1024"])
    assert with_unit.exit_code == 0 and with_unit.output == exact.output and "32,768" in exact.output
    bad = CliRunner().invoke(app, [*base, "--context", "32x"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: --context 32x is not a count")
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, line", [
    (["presets"], "error: kveval: No such command 'presets' (kveval -h lists them)"),
    (["valdate", "x.yaml"], "error: kveval: No such command 'valdate'; did you mean 'validate'? (kveval -h lists them)"),
    (["run", "configs/int4_g64.yaml", "--overwrit"],
     "error: kveval run: No such option: --overwrit (Possible options: --no-overwrite, --overwrite)"),
    (["run"], "error: kveval run: Missing argument 'CONFIG'."),
    (["memory", "--contxt", "3"], "error: kveval memory: No such option: --contxt (Possible options: --context)"),
])
def test_usage_errors_are_one_line_in_kveval_style(args, line):
    """Unknown commands and options, missing arguments: one line on stderr (no boxed panel), the nearest name,
    exit status 2."""
    result = CliRunner().invoke(app, args, prog_name="kveval")
    assert result.exit_code == 2
    assert result.stderr.strip() == line, result.stderr


def test_ls_lists_one_kind_and_filters():
    runner = CliRunner()
    everything = runner.invoke(app, ["ls"], env={"COLUMNS": "300"})
    shapes = runner.invoke(app, ["ls", "shapes"], env={"COLUMNS": "300"})
    assert everything.exit_code == 0 and shapes.exit_code == 0
    assert "Named shapes" in everything.output and "KV policy presets" in everything.output
    # without a kind: the kinds and their counts (issue 53: 570 lines at 80 columns)
    counts = {line.split()[0]: int(line.split()[1]) for line in everything.output.splitlines()[:6]}
    assert counts["shapes"] == len([line for line in shapes.output.splitlines()[1:] if line[:1].strip()])
    assert len(everything.output.splitlines()) == 7 and "kveval ls KIND lists one kind" in everything.output
    narrow = runner.invoke(app, ["ls", "presets"], env={"COLUMNS": "80"})
    assert max(map(len, narrow.output.splitlines())) <= 80 and "checked: reference" in narrow.output
    assert "llama-7b-gqa4" in shapes.output and "KV policy presets" not in shapes.output
    qwen = runner.invoke(app, ["ls", "shapes", "--grep", "QWEN"], env={"COLUMNS": "300"})
    rows = [line.split()[0] for line in qwen.output.splitlines()[1:] if line.strip() and not line.startswith(" ")]
    assert rows and all("qwen" in r for r in rows) and "llama-7b-gqa4" not in qwen.output
    kivi = runner.invoke(app, ["ls", "--grep", "kivi"], env={"COLUMNS": "300"})
    assert "kivi2" in kivi.output and "Named shapes" not in kivi.output  # a list with no match is left out


@pytest.mark.parametrize("args, words", [
    (["ls", "shape"], "error: kveval ls shape: not a list; did you mean 'shapes'?"),
    (["ls", "models", "--grep", "zzz"], "error: kveval ls: nothing in models holds 'zzz'"),
])
def test_ls_refusals_are_one_line(args, words):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.stderr.strip().startswith(words), result.stderr


@pytest.mark.parametrize("args", [["lm-eval", "--model", "hf"], ["lm-eval", "--kv", "int8", "--", "--model", "vllm"]])
def test_lm_eval_speaks_lm_evals_model_flag(args):
    """lm-eval's ``--model`` is the backend: kveval lm-eval runs its own and says so, naming ``--pretrained`` for
    the checkpoint, in one line."""
    pytest.importorskip("lm_eval")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "lm-eval's --model names the backend" in lines[0]
    assert "--pretrained ORG/MODEL" in lines[0]
    assert "--pretrained" in CliRunner().invoke(app, ["lm-eval", "-h"]).output


def test_config_counts_take_units_too(tmp_path):
    """Token counts in a config (seq_len, max_tokens, memory.context, needle and RULER lengths) take the units the
    command line takes; the resolved config holds the whole numbers; a fraction of a token or a wrong unit is the
    usual one line naming the key."""
    from kveval.config import validate
    from kveval.errors import KvevalError

    raw = {"name": "u", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8"],
           "memory": {"context": "32k"},
           "tasks": [{"perplexity": {"seq_len": "0.5k", "max_tokens": "4Ki"}},
                     {"needle": {"context_lengths": ["1k", 2048]}}]}
    cfg = validate(raw, "c.yaml")
    assert cfg.memory.context == 32768
    assert (cfg.tasks[0].params.seq_len, cfg.tasks[0].params.max_tokens) == (512, 4096)
    assert cfg.tasks[1].params.context_lengths == [1024, 2048]
    assert cfg.model_dump()["memory"]["context"] == 32768
    with pytest.raises(KvevalError, match=r"tasks\[0\]\.perplexity\.seq_len: count 1\.3k is not a whole number"):
        validate({**raw, "tasks": [{"perplexity": {"seq_len": "1.3k"}}]}, "c.yaml")
    with pytest.raises(KvevalError, match=r"memory\.context"):
        validate({**raw, "memory": {"context": "32GiB"}}, "c.yaml")


def test_did_you_mean_names_the_family_a_word_begins():
    """Issue 53: `--kv int4` suggested int8 (the closest spelling); a word that begins several names gets them."""
    from kveval.errors import did_you_mean

    names = ["int8", "int4_g32", "int4_g64", "int4_g128", "int4_token", "int4_channel", "kivi2"]
    assert did_you_mean("int4", names) == "; did you mean one of 'int4_g32', 'int4_g64', 'int4_g128', " \
                                          "'int4_token' (5 in all)?"
    assert did_you_mean("int4_g6", names) == "; did you mean 'int4_g64'?"  # one name begins with it
    assert did_you_mean("imt8", names) == "; did you mean 'int8'?"  # a misspelling: the closest
    assert did_you_mean("zzz", names) == ""


def test_memory_prints_whole_byte_counts_and_how_to_size_the_max_batch():
    """Issue 53: bytes/token printed as 131,072.0, and max batch "-" without saying --gpu-memory sizes it."""
    from kveval.commands.memory import memory_command

    text = memory_command(shape="llama-3.1-8b", kv="int8,kivi2", context=2048)
    assert "66,560 " in text and "66,560.0" not in text and "27,904 " in text
    assert "max batch: give --gpu-memory SIZE" in text
    assert "give --gpu-memory" not in memory_command(shape="llama-3.1-8b", kv="int8", gpu_memory="80GiB")


def test_progress_rates_never_round_to_zero_and_say_the_time_left():
    """Issue 53: the scan's line read "(0 cell/s)" with no time left (a cell takes seconds)."""
    from kveval.progress import rate_text, time_left

    assert rate_text(1500, 1.0, "tok") == "1,500 tok/s"
    assert rate_text(42, 10.0, "turn") == "4.2 turn/s"
    assert rate_text(3, 15.0, "cell") == "12.0 cell/min"
    assert rate_text(1, 186.0, "cell") == "3.1 min/cell"
    assert rate_text(0, 5.0, "cell") == "- cell/s"
    assert time_left(10, 40, 60.0) == ", 3 min 0 s left"
    assert time_left(1, 100, 120.0) == ", 3 h 18 min left"
    assert time_left(3, 4, 3.0) == ", 1 s left" and time_left(4, 4, 3.0) == "" and time_left(0, 4, 3.0) == ""


COMMANDS = ["run", "scan", "validate", "plan", "deploy", "memory", "report", "sweep", "calibrate", "ls", "lm-eval"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_reads_as_click_writes_it(command):
    """Issue 53: help showed <bool>, <list[str]> and {config} (typer 0.27 and 0.29: pyproject.toml bounds it)."""
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output and "<list[" not in result.output and "<str>" not in result.output
    usage = next(line for line in result.output.splitlines() if "Usage:" in line)
    assert "{" not in usage, usage


def test_memory_bills_the_models_own_context_and_says_so(tmp_path):
    """Issue 53: --shape llama-3.1-8b billed 2,048 tokens silently where kveval run uses the model's context."""
    from kveval.commands.memory import memory_command

    heading = memory_command(shape="llama-3.1-8b", kv="int8").splitlines()[0]
    assert "context 131,072 (the model's own; --context N for another)" in heading
    assert "16.00 GiB" in heading  # FP16: 32 layers x 2 x 8 heads x 128 x 2 B x 131,072 tokens
    assert "context 8,192 (the model's own" in memory_command(model="builtin:smollm2-135m", kv="int8")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 128, "max_position_embeddings": 3000}))
    assert "context 3,000 (the model's own" in memory_command(model=str(folder), kv="int8")
    assert "context 4,096," in memory_command(model=str(folder), kv="int8", context=4096)
    # a config's absurd context is one line, not a bill of 10^15 tokens
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**15}))
    result = CliRunner().invoke(app, ["memory", "--model", str(folder), "--kv", "int8"])
    assert result.exit_code == 2 and "give --context N" in result.stderr and len(result.stderr.splitlines()) == 1
    # a named shape whose entry names no context: the default, said
    assert "context 2,048 (the default: the model names no context" in memory_command(shape="smollm2-135m", kv="int8")


def test_quiet_prints_one_closing_line_per_task(monkeypatch):
    """Issue 53: --quiet still printed progress every 10 s; it prints the task's last line alone."""
    import io

    from rich.console import Console

    import kveval.progress as module

    for quiet, lines in ((True, 1), (False, 3)):
        buf = io.StringIO()
        progress = module.Progress(Console(file=buf, force_terminal=False, width=200), quiet=quiet)
        clock = iter([0.0, 11.0, 23.0, 24.0])  # the start, then one step each; 10 s apart but the last
        monkeypatch.setattr(module.time, "perf_counter", clock.__next__)
        with progress.task("scan", total=3, unit="cell") as advance:
            for _ in range(3):
                advance(1)
        out = buf.getvalue().strip().splitlines()
        assert len(out) == lines and out[-1].startswith("scan: 3/3 ("), out
