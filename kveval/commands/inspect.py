"""``kveval inspect CONFIG_OR_MODEL``: from forward passes of the full-precision model alone, where its keys and
values will break a format, why, and what to choose instead (:mod:`kveval.inspect`; docs/inspect.md).

Writes ``inspect.json`` (everything measured), ``metrics.json`` and ``config.resolved.yaml`` (the predicted
sensitivity, in the form ``kveval plan --from-inspect`` reads), ``report.md`` and ``report.html`` into ``-o DIR``
(default ``<the config's results folder>-inspect``), and prints the findings, each with a ``kveval run`` line.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kveval.commands.plan import slug
from kveval.errors import KvevalError

INSPECT_FILE = "inspect.json"
CONFIG_COPY = "config.yaml"  # the config inspect used, when it was given a model: the run lines' config
DEFAULT_KV = ["int8", "int4_g64"]
MAX_TOKENS = 1 << 20


def _flow(value: Any) -> str:
    """Plain data as one line of YAML (what ``-s key=value`` reads)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20, sort_keys=False).strip()


def run_line(config: str, overrides: list[str], base: str, base_form: Any, name: str, form: Any,
             folder: str) -> str:
    """The ``kveval run`` line of a suggestion: the candidate and the changed policy side by side in a results
    ``folder`` of their own, after the overrides inspect was given."""
    parts = ["kveval", "run", config]
    for o in overrides:
        if not o.replace(" ", "").startswith(("kv=", "kv.")):  # the line's own kv.policies replaces them
            parts += ["-s", o]
    parts += ["-s", f"kv.policies={_flow({base: base_form, name: form})}", "-o", folder]
    return shlex.join(parts)


def _check_out(path: Path) -> None:
    """The output folder: absent, empty, or an earlier inspection's (its ``inspect.json``); a run's folder or the
    user's own files are refused."""
    from kveval.config import check_writable_path
    from kveval.results.checks import folder_kind

    kind = folder_kind(path)
    if kind == "file":
        raise KvevalError(f"-o {path}: a file is in the way; give a folder")
    if kind not in ("absent", "empty") and not (path / INSPECT_FILE).is_file():
        raise KvevalError(f"-o {path}: the folder holds files that are not an inspection's (a run's, or your own); "
                          "give a new folder with -o")
    check_writable_path(path, "-o", folder=True)


def _config(target: str, overrides: list[str], model: str | None, data: str | None, kv: list[str] | None):
    """(config, the config path the run lines name or None, the overrides the run lines carry)."""
    from kveval.config import load_config, validate

    extra = [*(overrides or [])]
    if model:
        extra.append(f"model={json.dumps(model)}")
    if data:
        extra.append(f"data={json.dumps(data)}")
    if kv:
        extra.append(f"kv={_flow(list(kv))}")
    if target.endswith((".yaml", ".yml")):  # anything else names a model: builtin:..., a folder, a hub id, a .gguf
        return load_config(target, extra), target, extra
    raw = {"name": slug(Path(target).name or target).strip(".") or "model", "model": target, "data": "builtin", "kv": DEFAULT_KV,
           "tasks": [{"perplexity": {"seq_len": 512, "max_tokens": 4096}}]}
    return validate(raw, f"kveval inspect {target}", extra), None, extra


def _window(cfg) -> int:
    """The windows inspect reads: the config's first perplexity task's (what its runs score), else 512 tokens."""
    for entry in cfg.tasks:
        if entry.kind == "perplexity":
            return int(entry.params.seq_len)
    return 512


def _specs(cfg) -> list[str]:
    """The QuantSpec presets whose sensitivity is predicted: a sensitivity task's specs, else the candidates that
    are spec presets."""
    from kveval.quant.presets import preset_names

    for entry in cfg.tasks:
        if entry.kind == "sensitivity":
            return list(dict.fromkeys(entry.params.specs))
    names = set(preset_names())
    return list(dict.fromkeys(form for form in cfg.kv.policies.values()
                              if isinstance(form, str) and form in names and form != "none"))


def inspect_command(target: str, overrides: list[str] | None = None, output: str | None = None, *,
                    model: str | None = None, data: str | None = None, kv: list[str] | None = None,
                    tokens: int = 1024, seq_len: int | None = None, against: str | None = None,
                    quiet: bool = False) -> dict:
    """``kveval inspect``: see the module docstring; returns ``inspect.json``'s document."""
    from rich.console import Console

    from kveval.messages import print_line
    from kveval.results.layout import run_folder
    from kveval.results.lock import lock_folder

    cfg, config_path, extra = _config(target, list(overrides or []), model, data, kv)
    seq_len = seq_len or _window(cfg)
    if not (2 <= seq_len <= MAX_TOKENS) or not (seq_len <= tokens <= MAX_TOKENS):
        raise KvevalError(f"--tokens {tokens} --seq-len {seq_len}: give 2 <= seq-len <= tokens <= {MAX_TOKENS}")
    candidates = {n: f for n, f in cfg.kv.policies.items() if not cfg.policies()[n].is_none}
    if not candidates:
        raise KvevalError(f"{target}: no quantized policy to inspect; give some with --kv (e.g. --kv int4_g64)")
    scan = _read_scan(against, cfg.model.name) if against else None
    runs = run_folder(cfg.name, cfg.output).as_posix()  # the config's results folder; inspect's and the
    out = Path(os.path.expanduser(output)) if output else Path(f"{runs}-inspect")  # suggestions' sit beside it
    _check_out(out)
    console = Console(width=None if sys.stdout.isatty() else 140)
    with lock_folder(out, command=f"kveval inspect {target}", hint="give another folder with -o"):
        doc = _inspect(cfg, candidates, tokens, seq_len, console, quiet)
        doc["config"] = config_path or (out / CONFIG_COPY).as_posix()
        _suggest(doc, runs, config_path or (out / CONFIG_COPY).as_posix(), extra)
        if scan is not None:
            from kveval.inspect.predict import against_scan

            doc["against_scan"] = {"scan": against, "specs": against_scan(doc["sensitivity"], scan)}
        _write(out, cfg, doc, config_path is None)
    _print(console, doc, out)
    print_line(console, f"results: {out}/")
    return doc


def _same_model(a: str, b: str) -> bool:
    """Whether two model names name the same model (the same string, or two paths to one folder or file)."""
    if a == b:
        return True
    pa, pb = Path(os.path.expanduser(a)), Path(os.path.expanduser(b))
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _read_scan(path: str, model: str) -> dict:
    """A measured scan of the same model (its metrics.json, checked as plan checks it)."""
    from kveval.results import read_metrics
    from kveval.tasks.sensitivity.planner import check_scan

    metrics = read_metrics(Path(path))
    check_scan(metrics)
    if metrics["sensitivity"].get("predicted"):
        raise KvevalError(f"--against {path}: that folder holds an inspection's prediction, not a measured scan; "
                          "give a kveval scan folder")
    if not _same_model(str(metrics.get("model")), model):
        raise KvevalError(f"--against {path}: that scan measured {metrics.get('model')!r}, not {model!r}; give a scan "
                          "of the model inspected")
    return metrics


def _inspect(cfg, candidates: dict, tokens: int, seq_len: int, console, quiet: bool) -> dict:
    from kveval.data import load_tokens
    from kveval.inspect.analysis import Inputs, inspect_model
    from kveval.models import load_model, model_arch, model_context_limit
    from kveval.progress import Progress

    progress = Progress(console, quiet=quiet)
    started = time.perf_counter()
    loaded, tokenizer = load_model(cfg.model.name, device=cfg.model.device, dtype=cfg.model.dtype,
                                   trust_remote_code=cfg.model.trust_remote_code, seed=cfg.seed,
                                   device_map=cfg.model.device_map, max_memory=cfg.model.max_memory)
    limit = model_context_limit(loaded)
    if seq_len > limit:
        raise KvevalError(f"--seq-len {seq_len} is longer than the model's context ({limit}); give a shorter one")
    d = cfg.data
    ids = load_tokens(d.source, tokenizer, split=d.split, text_field=d.text_field)
    n = min(tokens, len(ids)) // seq_len
    if n < 1:
        raise KvevalError(f"the corpus {d.source} holds {len(ids)} tokens, fewer than one window of --seq-len "
                          f"{seq_len}; give a smaller --seq-len or a larger corpus")
    windows = [ids[w * seq_len:(w + 1) * seq_len][None].to(loaded.device) for w in range(n)]
    inputs = Inputs(candidates, _specs(cfg), windows)
    with progress.task("inspect: capture and measure", n) as advance:
        doc, section = inspect_model(loaded, tokenizer, inputs, step=advance, log=progress.log)
    arch = model_arch(loaded)
    doc.update(model=cfg.model.name, data=d.source, seconds=time.perf_counter() - started, sensitivity=section,
               arch=arch.to_dict())
    return doc


def _suggest(doc: dict, runs: str, config_path: str, extra: list[str]) -> None:
    """Give every suggestion its ``kveval run`` line, into ``<the config's results folder>-<policy>``."""
    for f in doc["findings"]:
        for s in f["suggestions"]:
            name = slug(s["policy"].replace("+", "_"))
            s["run"] = run_line(config_path, extra, s["base"], doc["candidates"][s["base"]], name, s["config"],
                                f"{runs}-{name}")


def _write(out: Path, cfg, doc: dict, copy_config: bool) -> None:
    from kveval.fileio import atomic_write_json, atomic_write_text
    from kveval.inspect.document import report_html, report_markdown
    from kveval.results.layout import CONFIG_FILE

    out.mkdir(parents=True, exist_ok=True)
    resolved = cfg.resolved()
    if copy_config:
        atomic_write_text(out / CONFIG_COPY, yaml.safe_dump(resolved, sort_keys=False, width=110))
    atomic_write_text(out / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False, width=110))
    atomic_write_json(out / "metrics.json", {
        "run": f"{cfg.name}-inspect", "model": cfg.model.name, "inspect": True, "sensitivity": doc["sensitivity"],
        "memory": {"arch": doc["arch"], "context": doc["seq_len"]}})
    atomic_write_json(out / INSPECT_FILE, doc)
    atomic_write_text(out / "report.md", report_markdown(doc))
    atomic_write_text(out / "report.html", report_html(doc, out))


def _print(console, doc: dict, out: Path) -> None:
    from rich.text import Text

    console.print(Text(f"kveval inspect: {doc['model']} on {doc['data']}, {doc['tokens']} tokens in "
                       f"{doc['windows']} windows, {doc['seconds']:.0f} s"), highlight=False)
    if not doc["findings"]:
        console.print(Text("no findings: nothing in these keys and values calls for a change of format"))
    for f in doc["findings"]:
        console.print(Text("- " + f["text"]), highlight=False)
        for s in f["suggestions"]:
            console.print(Text("    " + s["run"]), highlight=False, soft_wrap=True)
    v = doc.get("against_scan")
    if v:
        for spec, r in v["specs"].items():
            rho = "n/a" if r["spearman"] is None else f"{r['spearman']:.2f}"
            console.print(Text(f"predicted vs scanned ({spec}): Spearman {rho} over {r['cells']} cells, "
                               f"{r['top5_shared']} of the 5 most sensitive shared"), highlight=False)
    budget = plan_budget(doc)
    if budget is not None:
        line = shlex.join(["kveval", "plan", str(out), "--from-inspect", "--budget", budget])
        console.print(Text(f"plan from the prediction: {line}"), highlight=False, soft_wrap=True)


def plan_budget(doc: dict) -> str | None:
    """A budget ``kveval plan --from-inspect`` plans within: halfway between the cheapest and the dearest
    predicted spec's bits per element (the spec's name when there is one), checked by planning; None when no spec
    was predicted."""
    from kveval.memory import Arch, kv_bytes
    from kveval.tasks.sensitivity.planner import plan

    specs = doc["sensitivity"]["specs"]
    if not specs:
        return None
    arch = Arch.from_dict(doc["arch"])
    bits = sorted(kv_bytes(arch, s, doc["seq_len"]).bits_per_element for s in specs)
    metrics = {"sensitivity": doc["sensitivity"], "memory": {"arch": doc["arch"], "context": doc["seq_len"]}}
    for budget in ([f"{(bits[0] + bits[-1]) / 2:.2f}"] if len(bits) > 1 else []) + [specs[0]]:
        try:
            plan(metrics, budget)
            return budget
        except KvevalError:
            continue
    return None
