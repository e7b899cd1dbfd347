"""``kveval lm-eval --kv POLICY -- LM_EVAL_ARGS``: lm-eval's own command line with kveval's model class."""

from __future__ import annotations

from kveval.errors import KvevalError
from kveval.tasks.lm_eval.bridge import model_args_string


def lm_eval_command(kv: str, model: str, dtype: str, device: str, lm_eval_args: list[str]) -> int:
    """``kveval lm-eval --kv int4_g64 -- --tasks ... --limit ...``: run lm-eval's own command line with
    ``--model kveval --model_args model=MODEL,kv=KV,dtype=DTYPE`` (and ``--device DEVICE`` unless given).

    ``lm_eval_args`` are lm-eval's ``run`` arguments, in lm-eval's own spelling; its ``--model`` (the backend) may
    only be ``kveval`` (the backend that puts the policy in the cache; any other is refused, naming ``--pretrained``
    for the checkpoint), ``--model_args`` are merged after kveval's (e.g. ``--model_args prefill=context
    batch_size=4``). Returns the exit status.
    """
    args = list(lm_eval_args)
    if args and args[0] == "run":
        args = args[1:]
    args = _without_kveval_backend(args)
    argv = ["run", "--model", "kveval", "--model_args", model_args_string(model, kv, dtype)]
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        argv += ["--device", device]
    argv += args
    import sys

    from lm_eval._cli import HarnessCLI

    parser = HarnessCLI()
    try:
        parsed = parser._parser.parse_args(argv)
        parser.execute(parsed)
    except SystemExit as exc:  # argparse errors and --help
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ValueError as exc:  # lm-eval's bad input: "Tasks not found: ...", a bad --model_args value
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvevalError(f"lm-eval: {first}") from None
    finally:
        sys.stdout.flush()
    return 0


def _without_kveval_backend(args: list[str]) -> list[str]:
    """lm-eval's arguments without a ``--model kveval`` (kveval sets it); any other backend is one line: lm-eval's
    ``--model`` names the backend (``hf``, ``vllm``...), and kveval's is the one that quantizes the cache."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a in ("--model", "-M") or a.startswith("--model="):
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            if value != "kveval":
                raise KvevalError(f"kveval lm-eval: lm-eval's --model names the backend, and kveval lm-eval runs "
                                  f"its own (--model kveval, which puts the KV policy in the cache), not "
                                  f"'{value}'; name the checkpoint with kveval lm-eval --pretrained ORG/MODEL")
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out
