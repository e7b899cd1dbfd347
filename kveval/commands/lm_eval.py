"""``kveval lm-eval --kv POLICY -- LM_EVAL_ARGS``: lm-eval's own command line with kveval's model class."""

from __future__ import annotations

import sys

from kveval.errors import KvevalError

#: what to do when lm-evaluation-harness is not installed
INSTALL = "pip install 'kveval[lmeval]'"


def _harness():
    """(lm-eval's ``HarnessCLI``, kveval's ``model_args_string``); one KvevalError line with the install command
    when lm-evaluation-harness is not installed (kveval's extra ``lmeval``)."""
    try:
        from lm_eval._cli import HarnessCLI

        from kveval.tasks.lm_eval.bridge import model_args_string
    except ModuleNotFoundError as exc:
        if not str(exc.name or "").startswith("lm_eval"):
            raise
        raise KvevalError(f"kveval lm-eval needs lm-evaluation-harness, which is not installed: {INSTALL}") from None
    return HarnessCLI, model_args_string


def lm_eval_command(kv: str, model: str, dtype: str, device: str, lm_eval_args: list[str]) -> int:
    """``kveval lm-eval --kv int4_g64 -- --tasks ... --limit ...``: run lm-eval's own command line with
    ``--model kveval --model_args model=MODEL,kv=KV,dtype=DTYPE`` (and ``--device DEVICE`` unless given).

    ``lm_eval_args`` are lm-eval's ``run`` arguments, in lm-eval's own spelling; its ``--model`` (the backend) may
    only be ``kveval`` (the backend that puts the policy in the cache; any other is refused, naming ``--pretrained``
    for the checkpoint), ``--model_args`` are merged after kveval's (e.g. ``--model_args prefill=context
    batch_size=4``). Returns the exit status; arguments lm-eval's parser refuses (an unknown option,
    ``--gen_kwargs notkeyvalue``) are one KvevalError line with its message, as is a backend set by any spelling of
    ``--model`` (``-M hf``, ``-Mhf``, ``-M=hf``: lm-eval's own parse of the arguments says which backend is set).
    """
    args = list(lm_eval_args)
    if args and args[0] == "run":
        args = args[1:]
    args = _without_kveval_backend(args)
    HarnessCLI, model_args_string = _harness()
    argv = ["run", "--model", "kveval", "--model_args", model_args_string(model, kv, dtype)]
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        argv += ["--device", device]
    argv += args
    parser = HarnessCLI()
    parsed = _parsed(parser._parser, argv)
    if isinstance(parsed, int):
        return parsed  # --help (printed already)
    backend = getattr(parsed, "model", "kveval")
    if backend != "kveval":  # lm-eval's -M, -Mhf, -M=hf, --model=hf, an abbreviation: whatever spelling set it
        raise _other_backend(backend)
    try:
        parser.execute(parsed)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ValueError as exc:  # lm-eval's bad input: "Tasks not found: ...", a bad --model_args value
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvevalError(f"lm-eval: {first}") from None
    finally:
        sys.stdout.flush()
    return 0


def _parsed(parser, argv: list[str]):
    """lm-eval's parse of ``argv``, or the exit status of ``--help`` (printed on stdout); an argparse error (an
    unknown or ambiguous option, ``--gen_kwargs notkeyvalue``) is one KvevalError line with argparse's message,
    instead of lm-eval's usage text and its error on stderr."""
    import contextlib
    import io

    caught = io.StringIO()
    try:
        with contextlib.redirect_stderr(caught):
            return parser.parse_args(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        text = caught.getvalue().strip()
        if code == 0:
            if text:
                print(text, file=sys.stderr)
            return code
        lines = [ln for ln in text.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {code}"
        message = last.split(" error: ", 1)[1] if " error: " in last else last
        raise KvevalError(f"kveval lm-eval: lm-eval refused its arguments: {message.strip()} (lm-eval run -h lists "
                          f"them)") from None


def _other_backend(value: str) -> KvevalError:
    return KvevalError(f"kveval lm-eval: lm-eval's --model names the backend, and kveval lm-eval runs its own "
                       f"(--model kveval, which puts the KV policy in the cache), not '{value}'; name the checkpoint "
                       f"with kveval lm-eval --pretrained ORG/MODEL")


def _without_kveval_backend(args: list[str]) -> list[str]:
    """lm-eval's arguments without a ``--model kveval`` (kveval sets it); any other backend is one line: lm-eval's
    ``--model`` names the backend (``hf``, ``vllm``...), and kveval's is the one that quantizes the cache."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a in ("--model", "-M") or a.startswith("--model="):
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            if value != "kveval":
                raise _other_backend(value)
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out
