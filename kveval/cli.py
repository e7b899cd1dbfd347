"""The ``kveval`` command line: parse, load the config, call a runner, print. No logic lives here."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from kveval.errors import KvevalError
from kveval.messages import print_error, print_line


class _OneLineErrors(TyperGroup):
    """kveval's command group: a usage error (an unknown command or option, a missing or malformed argument) is
    one line on stderr in kveval's own style, ``error: kveval run: No such option: --overwrit (Possible options:
    --no-overwrite, --overwrite)``, with the nearest command for an unknown one, and exit status 2, instead of
    Typer's boxed panel."""

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if name is not None and not name.startswith("-") and self.get_command(ctx, name) is None:
            from kveval.errors import did_you_mean

            ctx.fail(f"No such command '{name}'{did_you_mean(name, self.list_commands(ctx))} (kveval -h lists them)")
        return super().resolve_command(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        # Typer ships its own copy of click (typer._click): its exceptions are matched by what they carry, not by
        # class, so that either copy works
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except Exception as exc:
            if not standalone_mode:
                raise
            if type(exc).__name__ == "Abort":  # Ctrl-C while click was prompting or parsing
                print_line(err_console, "interrupted")
                sys.exit(EXIT_INTERRUPTED)
            if not (hasattr(exc, "format_message") and isinstance(getattr(exc, "exit_code", None), int)):
                raise
            where = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "kveval"
            message = " ".join(exc.format_message().split())
            if type(exc).__name__ == "NoArgsIsHelpError" or not message:  # the help is printed already
                sys.exit(exc.exit_code)
            print_error(err_console, f"{where}: {message}")
            sys.exit(exc.exit_code)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Accuracy evaluation of KV-cache quantization for HuggingFace causal LMs.",
)
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from kveval import __version__

        print(f"kveval {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                          help="Print kveval's version and exit.")] = False,
):
    """Accuracy evaluation of KV-cache quantization for HuggingFace causal LMs."""


#: Exit status of a command stopped by bad input (a KvevalError line).
EXIT_USER_ERROR = 2
#: Exit status of a command stopped by Ctrl-C (SIGINT): 128 + 2, the shells' convention.
EXIT_INTERRUPTED = 130


#: what the libraries read at import to stay quiet: no progress bars (huggingface_hub, transformers' weight
#: loading, datasets, tqdm) and errors only from transformers' and datasets' loggers
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
             "TRANSFORMERS_VERBOSITY": "critical", "DATASETS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
#: loggers of libraries whose warnings are noise beside kveval's own lines
QUIET_LOGGERS = ("lm_eval", "transformers", "datasets", "accelerate", "huggingface_hub", "ray")


def quiet_libraries_unless_terminal(stream=None) -> bool:
    """When stderr is not a terminal (a log file, CI, another program reading it), keep the libraries' progress
    bars and warnings off it, so that a failing command's stderr is its one error line: the environment the
    libraries read at import (:data:`QUIET_ENV`, unless the user set a variable), their loggers at ERROR (transformers'
    at CRITICAL: its errors come before the exception kveval turns into the one line, e.g. a config class refusing a
    value) and their Python warnings ignored. Called before any of them is imported; returns whether it acted."""
    import importlib
    import logging
    import os
    import warnings

    stream = sys.stderr if stream is None else stream
    if getattr(stream, "isatty", lambda: False)():
        return False
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL if name == "transformers" else logging.ERROR)
    warnings.filterwarnings("ignore", module=r"(transformers|torch|lm_eval|datasets|accelerate|huggingface_hub)")
    # libraries imported already (a library caller, the tests) read the environment before: tell them directly
    # submodules by import, not attribute: huggingface_hub's lazy __getattr__ has no ``utils`` until it is imported
    if "huggingface_hub" in sys.modules:
        importlib.import_module("huggingface_hub.utils").disable_progress_bars()
    if "transformers" in sys.modules:
        tlog = importlib.import_module("transformers.utils.logging")
        tlog.disable_progress_bar()
        tlog.set_verbosity(tlog.CRITICAL)
    if "datasets" in sys.modules:
        dlog = importlib.import_module("datasets.utils.logging")
        dlog.disable_progress_bar()
        dlog.set_verbosity_error()
    if "tqdm" in sys.modules:  # TQDM_DISABLE is read when tqdm is imported: bars made from now on start disabled
        bar = sys.modules["tqdm"].std.tqdm
        if not getattr(bar, "_kveval_quiet", False):
            loud = bar.__init__

            def quiet(self, *args, **kwargs):  # callers pass disable=... themselves (lm-eval does): overruled
                kwargs["disable"] = True
                loud(self, *args, **kwargs)

            bar.__init__ = quiet
            bar._kveval_quiet = True
    return True


def user_errors(fn):
    """Bad input -> one line on stderr and exit status 2, no traceback. Ctrl-C -> one line and exit status 130,
    wherever it lands: in the work, in the report at its end, or while the line of an error is being printed (a
    second Ctrl-C while the interrupt's own line prints changes nothing). Whatever was written stays whole:
    records are appended whole and every other file is replaced atomically."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        quiet_libraries_unless_terminal()
        try:
            try:
                return fn(*args, **kwargs)
            except KvevalError as exc:
                print_error(err_console, exc)
                raise typer.Exit(EXIT_USER_ERROR) from None
        except KeyboardInterrupt:
            with contextlib.suppress(KeyboardInterrupt):
                print_line(err_console, "interrupted; rerun the same command to resume from the recorded work")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper


OverrideOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config value: key.path=value (YAML), repeatable."),
]
OutputOpt = Annotated[
    str | None,
    typer.Option("--output", "-o", help="Results folder (the config's output:, default results/<name>).")]


def checked_output(output: str | None) -> str | None:
    """``-o`` as given, refused when empty or blank: ``-o "$DIR"`` with DIR unset would otherwise be the current
    folder, and a run would write its files among the user's."""
    if output is not None and not output.strip():
        raise KvevalError("-o: an empty folder name (an unset shell variable?); give the results folder, e.g. -o "
                          "results/mine")
    return output


def with_output(overrides: list[str] | None, output: str | None) -> list[str] | None:
    """``-o PATH`` as the override ``output=PATH`` (after the ``-s`` ones: it wins), the path quoted as a YAML
    string so that a folder named ``yes`` or ``123`` stays a name."""
    if checked_output(output) is None:
        return overrides
    import json

    return [*(overrides or []), f"output={json.dumps(str(output))}"]


AllowCodeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-code",
        help="Let this run execute code that its inputs name: Python in an lm-eval include_path (!function), "
        "model.trust_remote_code. Configs are pure data; this is never a config key.",
    ),
]


@app.command()
@user_errors
def run(
    config: Annotated[Path, typer.Argument(help="Experiment config (YAML).")],
    overrides: OverrideOpt = None,
    output: OutputOpt = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a results folder that holds a different config.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar: one closing line per step.")] = False,
    allow_code: AllowCodeOpt = False,
):
    """Evaluate the config's KV policies against the full-precision baseline; write results/<name>/."""
    from kveval.commands.run import run_experiment
    from kveval.config import load_config

    cfg = load_config(config, with_output(overrides, output), allow_code=allow_code)
    run_experiment(cfg, overwrite=overwrite, quiet=quiet, config_path=str(config))


@app.command()
@user_errors
def sweep(
    sweep_file: Annotated[Path, typer.Argument(help="Sweep file (YAML): a grid of models x policies x tasks, or a list of configs.")],
    overrides: OverrideOpt = None,
    address: Annotated[str | None, typer.Option(help="Join this Ray cluster (e.g. ray://head:10001, auto) instead of starting a local Ray.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Let each run replace a run folder that holds a different config.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check every run and list them; start nothing.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="One line per finished run instead of a progress bar.")] = False,
    allow_code: AllowCodeOpt = False,
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="The sweep's folder (the sweep file's output:, default results/sweeps/<name>); "
                               "each run goes to its runs/<run>.")] = None,
):
    """Run every config of a sweep as a Ray task (kveval run in its own folder), then one report across runs."""
    from kveval.commands.sweep import sweep_command

    status = sweep_command(str(sweep_file), overrides, address=address, overwrite=overwrite, dry_run=dry_run,
                           quiet=quiet, allow_code=allow_code, output=checked_output(output))
    if status:
        raise typer.Exit(status)


@app.command()
@user_errors
def calibrate(
    config: Annotated[Path, typer.Argument(help="Experiment config; its calibration: section says how.")],
    overrides: OverrideOpt = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Scales file to write (.safetensors).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar: one closing line per step.")] = False,
    allow_code: AllowCodeOpt = False,
    export: Annotated[tuple[str, Path] | None, typer.Option(
        help="Also write a checkpoint folder with the scales: --export compressed-tensors DIR (the model's weights "
             "unchanged, config.json kv_cache_scheme, k_scale/v_scale: what vLLM loads).")] = None,
    strategy: Annotated[str, typer.Option(
        help="--export: one FP8 scale per layer and K/V (tensor) or per KV head (attn_head).")] = "tensor",
):
    """Static K/V scales from a calibration slice (the corpus tail): a scales file that policies use as scales: FILE."""
    from kveval.commands.calibrate import calibrate_command
    from kveval.config import code_allowed

    with code_allowed(allow_code):
        calibrate_command(str(config), overrides, out=None if out is None else str(out), quiet=quiet,
                          export=None if export is None else (export[0], str(export[1])), strategy=strategy)


@app.command()
@user_errors
def scan(
    config: Annotated[Path, typer.Argument(help="Config with a sensitivity task (e.g. configs/layer_scan.yaml).")],
    overrides: OverrideOpt = None,
    output: OutputOpt = None,
    naive: Annotated[bool, typer.Option(help="Recompute every layer for every cell (no prefix reuse), for checking.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace a results folder that holds a different config.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar: one closing line per step.")] = False,
    allow_code: AllowCodeOpt = False,
    engine: Annotated[str | None, typer.Option(help="Scan the cache types this engine runs (vllm, llamacpp, sglang, trtllm, transformers), into OUTPUT-ENGINE.")] = None,
):
    """Per-layer, per-K/V sensitivity: quantize one tensor at a time, measure KLD and ΔPPL against FP."""
    from kveval.commands.scan import scan_command
    from kveval.config import code_allowed

    with code_allowed(allow_code):
        scan_command(str(config), with_output(overrides, output), naive=naive, overwrite=overwrite, quiet=quiet,
                     engine=engine)


@app.command()
@user_errors
def inspect(
    target: Annotated[str, typer.Argument(metavar="CONFIG_OR_MODEL", help="A config (its model, corpus and policies) or a model (builtin:..., a folder, a hub id, a .gguf file).")],
    overrides: OverrideOpt = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Folder to write (default results/<name>-inspect).")] = None,
    model: Annotated[str | None, typer.Option(help="The model, in place of the config's.")] = None,
    data: Annotated[str | None, typer.Option(help="The corpus, in place of the config's (builtin, wikitext2, a file).")] = None,
    kv: Annotated[list[str] | None, typer.Option(help="A policy to inspect, in place of the config's (repeatable).")] = None,
    tokens: Annotated[int, typer.Option(help="Corpus tokens to capture, from its start.")] = 1024,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per window, one forward pass each (default: the config's perplexity seq_len, else 512).")] = None,
    against: Annotated[Path | None, typer.Option(help="A kveval scan folder: the predicted sensitivity's rank correlation with it.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    allow_code: AllowCodeOpt = False,
):
    """Before any run: where the model's keys and values break each format, why, and what to choose instead."""
    from kveval.commands.inspect import inspect_command
    from kveval.config import code_allowed

    with code_allowed(allow_code):
        inspect_command(target, overrides, checked_output(output), model=model, data=data, kv=kv, tokens=tokens,
                        seq_len=seq_len, against=str(against) if against else None, quiet=quiet)


@app.command()
@user_errors
def plan(
    scan_dir: Annotated[Path, typer.Argument(help="Results folder of a scan.")],
    budget: Annotated[str, typer.Option(help="4.5 (bits/element), 35KiB/token, 0.28x or 28% of FP16, or a preset (int4_g64).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Config to write (default configs/generated/...).")] = None,
    context: Annotated[str | None, typer.Option(
        help="Context for the memory bill: 4096, 32k (32,768) (default: the scan's seq_len).")] = None,
    allow_fp: Annotated[bool, typer.Option(help="Allow full precision (none) as a per-layer choice.")] = False,
    engine: Annotated[str | None, typer.Option(
        help="Plan only what this engine can run: vllm, llamacpp, sglang, trtllm, transformers.")] = None,
    from_inspect: Annotated[bool, typer.Option(
        help="SCAN_DIR is a kveval inspect folder: plan from its predicted sensitivity, not a measured scan.")] = False,
):
    """Mixed precision under a memory budget, from a scan: writes a ready-to-run config."""
    from kveval.commands.plan import plan_command
    from kveval.engines.names import check_engine_names
    from kveval.units import parse_count

    check_engine_names([engine] if engine else None)
    plan_command(str(scan_dir), budget, str(out) if out else None,
                 context=None if context is None else parse_count(context, "--context"), allow_fp=allow_fp,
                 engine=engine, from_inspect=from_inspect)


@app.command()
@user_errors
def deploy(
    target: Annotated[Path, typer.Argument(help="A .plan.json (kveval plan) or a config (its kv: policies).")],
    run: Annotated[Path | None, typer.Option(help="A run folder whose metrics give measured costs.")] = None,
    engine: Annotated[list[str] | None, typer.Option(
        help="Only this engine (repeatable): vllm, llamacpp, sglang, trtllm, transformers.")] = None,
    model: Annotated[str | None, typer.Option(help="The model name to put in the commands.")] = None,
):
    """Each policy in each engine's own syntax, or the nearest policies an engine can run with their cost."""
    from kveval.engines.names import check_engine_names

    check_engine_names(engine)  # before the heavy imports: a typo is refused at once
    from kveval.commands.deploy import deploy_command

    print(deploy_command(str(target), str(run) if run else None, engine, model), end="")


@app.command(
    "lm-eval",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
@user_errors
def lm_eval(
    ctx: typer.Context,
    kv: Annotated[str, typer.Option(help="KV policy: a preset name or a policy file (.yaml/.json).")] = "fp16",
    pretrained: Annotated[str, typer.Option(
        help="The checkpoint, as in configs (lm-eval's model_args pretrained=; lm-eval's --model is kveval's "
             "backend).")] = "builtin:smollm2-135m",
    dtype: Annotated[str, typer.Option(help="float32, float64, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "cpu",
):
    """Run lm-evaluation-harness with a KV policy: kveval lm-eval --kv int4_g64 -- --tasks ... --limit ..."""
    from kveval.commands.lm_eval import lm_eval_command

    raise typer.Exit(lm_eval_command(kv, pretrained, dtype, device, list(ctx.args)))


@app.command()
@user_errors
def parity(
    system: Annotated[str, typer.Argument(help="The system a preset is named after: llamacpp, hf_quanto, kivi, ...")],
    model: Annotated[str, typer.Option(help="Model, as in configs.")] = "builtin:smollm2-135m",
    types: Annotated[str | None, typer.Option(help="Comma-separated cache types of the system (default: its set).")] = None,
    tokens: Annotated[int | None, typer.Option(help="Token ids to evaluate (default: the system's).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output folder (default results/parity/SYSTEM).")] = None,
    layers: Annotated[int | None, typer.Option(help="Keep only the first N decoder layers, in both systems (llamacpp).")] = None,
    rotation: Annotated[str | None, typer.Option(help="llamacpp: on, off or both (the Hadamard rotation of current llama.cpp).")] = None,
    noise_floor: Annotated[bool, typer.Option("--noise-floor", help="llamacpp: also measure kveval against itself with 1e-6 input noise.")] = False,
    tool: Annotated[str | None, typer.Option(help="llamacpp: 'perplexity' runs llama.cpp's llama-perplexity --kl-divergence on the same chunks, every statistic side by side.")] = None,
    ctx: Annotated[int | None, typer.Option(help="llamacpp --tool perplexity: tokens per chunk (-c; default 512).")] = None,
    kl_divergence_base: Annotated[Path | None, typer.Option("--kl-divergence-base", help="llamacpp --tool perplexity: a base file llama-perplexity wrote (--kl-divergence-base); its chunks and logits are the reference.")] = None,
):
    """kveval's preset against the real system on the same tokens, per cache type: ΔPPL, KLD, KLD between them."""
    from kveval.commands.parity import parity_command, parity_options

    type_list = [t.strip() for t in types.split(",") if t.strip()] if types else None
    options = parity_options(layers=layers, rotation=rotation, noise_floor=noise_floor, tool=tool, ctx=ctx,
                             kl_divergence_base=str(kl_divergence_base) if kl_divergence_base else None)
    parity_command(system, model=model, types=type_list, tokens=tokens, out=str(out) if out else None,
                   options=options)


@app.command()
@user_errors
def validate(
    config: Annotated[Path, typer.Argument(help="Experiment config (YAML).")],
    overrides: OverrideOpt = None,
    output: OutputOpt = None,
    allow_code: AllowCodeOpt = False,
    overwrite: Annotated[bool, typer.Option(help="As kveval run --overwrite: a folder holding another run may be replaced.")] = False,
):
    """Check a config without running it: the schema, and what it names on this machine (output folder, corpus
    file, scales and plan files, lm-eval include folder), as kveval run checks them before it starts: an output
    folder holding another config's run, or records of input files changed since, is refused as run refuses it."""
    from kveval.config import input_files, load_config
    from kveval.results.checks import check_folder, check_inputs_unchanged
    from kveval.results.store import input_digests

    cfg = load_config(config, with_output(overrides, output), allow_code=allow_code)
    out_dir = cfg.output_dir()
    if not check_folder(out_dir, cfg.resolved(), overwrite=overwrite) and not overwrite:
        check_inputs_unchanged(out_dir, input_digests(input_files(cfg)))
    names = ", ".join(cfg.policies())
    tasks = ", ".join(t.kind for t in cfg.tasks)
    print(f"{config}: ok (model {cfg.model.name}; policies {names}; tasks {tasks}; output {cfg.output_dir()})")


@app.command()
@user_errors
def memory(
    model: Annotated[str | None, typer.Option(help="Model (builtin:NAME, hub id, local dir): only its config is read.")] = None,
    shape: Annotated[str | None, typer.Option(help="Named shape, e.g. llama-3.1-8b, qwen3-8b, deepseek-v3 (kveval ls shapes lists them all).")] = None,
    layers: Annotated[int | None, typer.Option(help="Explicit shape: number of layers.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="Explicit shape: KV heads per layer.")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Explicit shape: head dimension.")] = None,
    context: Annotated[str | None, typer.Option(help="Tokens per sequence: 32k (32,768), 128Ki; default: the model's own context.")] = None,
    batch: Annotated[str, typer.Option(help="Sequences (1, 64, 1k), or several: 1,16,64.")] = "1",
    kv: Annotated[str | None, typer.Option(help="Comma-separated policies (default: a representative set).")] = None,
    gpu_memory: Annotated[str | None, typer.Option(help="GPU memory for max batch, e.g. 80GiB.")] = None,
    gpu: Annotated[str | None, typer.Option(help="Decode roofline on this GPU: h200, h100, a100, l40s, rtx4090, or a "
                                                 "bandwidth such as 3.35TB/s (its memory sizes max batch too).")] = None,
    block_size: Annotated[int, typer.Option(help="Paged-attention block size in tokens.")] = 16,
    json_output: Annotated[bool, typer.Option("--json", help="Print the documented JSON schema instead of a table.")] = False,
):
    """The exact memory bill of KV policies: codes, scales, full-precision windows, max batch, paged blocks."""
    from kveval.commands.memory import memory_command, parse_batches
    from kveval.units import parse_count

    print(memory_command(
        model=model, shape=shape, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
        context=None if context is None else parse_count(context, "--context"), batch=parse_batches(batch),
        kv=kv, gpu_memory=gpu_memory, block_size=block_size, json_output=json_output, gpu=gpu,
    ), end="")


@app.command()
@user_errors
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Results folders (one or several runs).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output folder (default: the run, or reports/DATE).")] = None,
):
    """Tables, plots and a self-contained HTML/Markdown report of one or several runs."""
    from kveval.commands.report import report_command

    folder = report_command([str(d) for d in run_dirs], str(out) if out else None)
    print(f"report: {folder / 'report.html'}")


@app.command("ls")
@user_errors
def list_things(
    what: Annotated[str | None, typer.Argument(
        help="Only one list: presets, formats, tasks, models, corpora or shapes.")] = None,
    grep: Annotated[str | None, typer.Option(help="Only the rows that hold WORD (any case).")] = None,
):
    """List the KV policy presets, quantizer presets, tasks, builtin models, corpora and named shapes."""
    from kveval.commands.ls import LISTS, list_rows
    from kveval.errors import did_you_mean

    if what is not None and what not in LISTS:
        raise KvevalError(f"kveval ls {what}: not a list{did_you_mean(what, LISTS)} (one of {', '.join(LISTS)})")
    console = Console()
    if what is None and grep is None:  # the kinds and their counts: 570 lines at once read as noise
        t = Table(show_header=False, box=None, pad_edge=False)
        t.add_column(style="bold cyan", no_wrap=True)
        t.add_column(justify="right", no_wrap=True)
        t.add_column()
        for name, title in LISTS.items():
            t.add_row(Text(name), Text(str(len(list_rows(name)))), Text(title.split(" (")[0].split(";")[0]))
        console.print(t)
        print_line(console, "kveval ls KIND lists one kind; kveval ls --grep WORD searches them all")
        return
    shown = 0
    for name in [what] if what else list(LISTS):
        rows = [r for r in list_rows(name) if grep is None or grep.lower() in " ".join(r).lower()]
        if not rows:
            continue
        shown += len(rows)
        t = Table(title=LISTS[name], title_justify="left", show_header=False, box=None, pad_edge=False)
        t.add_column(style="bold cyan", no_wrap=True)
        for _ in range(max(len(r) for r in rows) - 1):
            t.add_column()
        for row in rows:
            t.add_row(*(Text(cell) for cell in row))  # names and help texts: never markup
        console.print(t)
        console.print()
    if not shown:
        raise KvevalError(f"kveval ls: nothing{' in ' + what if what else ''} holds '{grep}'")


def main():  # pragma: no cover - console entry for python -m kveval
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
