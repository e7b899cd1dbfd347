"""The lm-evaluation-harness bridge: the kveval model class, the CLI forwarder and the ``lm_eval`` config task.

Offline: the local tasks in tasks/lm_eval (multiple choice + generation over JSONL shipped here); lm-eval's
~15k builtin tasks are never indexed in these tests (that alone takes ~20 s).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lm_eval  # noqa: E402
import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kveval.commands.lm_eval import lm_eval_command  # noqa: E402
from kveval.config import validate  # noqa: E402
from kveval.errors import KvevalError  # noqa: E402
from kveval.patch import emulate  # noqa: E402
from kveval.policy import KVPolicy  # noqa: E402
from kveval.tasks.lm_eval import task as lm_eval_task  # noqa: E402
from kveval.tasks.lm_eval.bridge import KVEvalLM, model_args_string, resolve_policy  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks" / "lm_eval"
MC, GEN = "kveval_facts_mc", "kveval_qa_gen"


@pytest.fixture(scope="module")
def local_tasks():
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def evaluate(lm, tm, tasks, limit):
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=tm, log_samples=True)


def responses(res, task):
    return [s["resps"] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"])]


def ll_request(lm, context: str, continuation: str):
    ctx, cont = lm._encode_pair(context, continuation)
    return ((context, continuation), ctx, cont)


# --- policies, arguments ---------------------------------------------------------------------------------------------
def test_resolve_policy_forms(tmp_path):
    assert resolve_policy("int4_g64") == KVPolicy.preset("int4_g64")
    f = tmp_path / "mine.yaml"
    f.write_text("key: int4_g64\nvalue: int8\nresidual: 32\n")
    p = resolve_policy(str(f))
    assert p.name == "mine" and p.key.bits == 4 and p.value.bits == 8 and p.residual == 32
    assert resolve_policy({"spec": "int8"}).key.bits == 8
    with pytest.raises(KvevalError, match="did you mean"):
        resolve_policy("int4_g46")
    with pytest.raises(KvevalError, match="does not exist"):
        resolve_policy(str(tmp_path / "nope.yaml"))


def test_model_args_string():
    assert model_args_string("builtin:tiny-llama", "int2_g32") == "model=builtin:tiny-llama,kv=int2_g32,dtype=float32"
    with pytest.raises(KvevalError, match="cannot hold"):
        model_args_string("a,b", "int8")


def test_bad_arguments_are_one_line(tiny_llama):
    model, tok = tiny_llama
    with pytest.raises(KvevalError, match="prefill must be one of"):
        KVEvalLM(pretrained=model, tokenizer=tok, prefill="sometimes")
    with pytest.raises(KvevalError, match="needs its tokenizer"):
        KVEvalLM(pretrained=model)
    with pytest.raises(KvevalError, match="does not divide head_dim"):
        KVEvalLM(pretrained=model, tokenizer=tok, kv="int4_g64")  # tiny-llama: head_dim 32


# --- log-likelihood: emulation -----------------------------------------------------------------------------------------
def test_none_policy_equals_plain_hflm_tiny(tiny_llama, local_tasks):
    model, tok = tiny_llama
    plain = evaluate(HFLM(pretrained=model, tokenizer=tok), local_tasks, [MC], limit=6)
    ours = KVEvalLM(pretrained=model, tokenizer=tok, kv="fp16")
    bridged = evaluate(ours, local_tasks, [MC], limit=6)
    assert bridged["results"] == plain["results"]
    assert responses(bridged, MC) == responses(plain, MC)
    assert bridged["config"]["layers_quantized"] == 0 and bridged["config"]["kv_policy"] == "fp16"


def test_loglikelihood_is_the_emulated_decode(tiny_llama):
    """prefill=none: the request's score equals a hand-made emulate(prefill_len=0) pass; int2 changes it."""
    model, tok = tiny_llama
    lm = KVEvalLM(pretrained=model, tokenizer=tok, kv="int2_g32")
    req = ll_request(lm, "Question: What is 2 plus 2?\nAnswer:", " 4")
    (score, _), = lm._loglikelihood_tokens([req])
    ids = torch.tensor([(req[1] + req[2])[:-1]])
    with emulate(model, KVPolicy.preset("int2_g32"), prefill_len=0), torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0], -1)
    n = len(req[2])
    expected = float(logp[-n:].gather(1, torch.tensor(req[2])[:, None]).sum())
    assert score == pytest.approx(expected, abs=1e-4)
    (fp, _), = KVEvalLM(pretrained=model, tokenizer=tok, kv="fp16")._loglikelihood_tokens([req])
    assert abs(fp - score) > 1e-3
    assert lm.layers_quantized == 4


def test_context_prefill_mode(tiny_llama):
    """prefill=context: the context is a prefill (fp under the policy's prefill: fp), the continuation decoded;
    exact per row also when a batch pads rows of different lengths."""
    model, tok = tiny_llama
    policy = KVPolicy.preset("int2_g32")
    lm = KVEvalLM(pretrained=model, tokenizer=tok, kv=policy, prefill="context", batch_size=4)
    reqs = [ll_request(lm, "The capital of France is", c) for c in (" Paris", " Rome and Berlin")]
    reqs.append(ll_request(lm, "Two plus two makes", " four"))
    scores = [s for s, _ in lm._loglikelihood_tokens(reqs)]
    for (_, ctx, cont), score in zip(reqs, scores):
        ids = torch.tensor([(ctx + cont)[:-1]])
        with emulate(model, policy, prefill_len=len(ctx)), torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0], -1)
        expected = float(logp[-len(cont):].gather(1, torch.tensor(cont)[:, None]).sum())
        assert score == pytest.approx(expected, abs=1e-4)
    decoded = KVEvalLM(pretrained=model, tokenizer=tok, kv=policy)._loglikelihood_tokens(reqs)
    assert all(abs(a - b) > 1e-4 for a, (b, _) in zip(scores, decoded))


# --- generation: the real quantized cache -----------------------------------------------------------------------------
def gen_requests():
    args = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    return [
        Instance(request_type="generate_until", doc={}, arguments=(q, dict(args)), idx=0)
        for q in ("Question: What is 2 + 3?\nAnswer:", "Hello")
    ]


def test_generation_through_quantized_cache(tiny_llama):
    model, tok = tiny_llama
    plain = HFLM(pretrained=model, tokenizer=tok).generate_until(gen_requests())
    fp = KVEvalLM(pretrained=model, tokenizer=tok, kv="fp16")
    assert fp.generate_until(gen_requests()) == plain
    q = KVEvalLM(pretrained=model, tokenizer=tok, kv="int2_g32")
    q.generate_until(gen_requests())
    assert q.layers_quantized == 4


# --- entry points --------------------------------------------------------------------------------------------------
class LocalOnlyTaskManager(TaskManager):
    def __init__(self, *args, include_defaults=True, **kwargs):
        super().__init__(*args, include_defaults=False, **kwargs)


def test_cli_forwarder(tmp_path, monkeypatch):
    monkeypatch.setattr("lm_eval.tasks.TaskManager", LocalOnlyTaskManager)  # skip indexing lm-eval's builtin tasks
    for backend in (["--model", "hf"], ["--model=vllm"], ["-M", "hf"]):
        with pytest.raises(KvevalError, match="lm-eval's --model names the backend.*--pretrained ORG/MODEL"):
            lm_eval_command("int8", "builtin:tiny-llama", "float32", "cpu", backend)
    rc = lm_eval_command(  # lm-eval's own spelling of kveval's backend is accepted
        "int2_g32", "builtin:tiny-llama", "float32", "cpu",
        ["--model", "kveval", "--tasks", MC, "--include_path", str(TASKS_DIR), "--limit", "3",
         "--output_path", str(tmp_path / "out")],
    )
    assert rc == 0
    (result,) = tmp_path.glob("out/**/results_*.json")
    data = json.loads(result.read_text())
    assert data["config"]["model"] == "kveval"
    assert data["config"]["kv_policy"] == "int2_g32" and data["config"]["layers_quantized"] == 4
    assert MC in data["results"]
    with pytest.raises(KvevalError, match="unrecognized arguments: --no-such-flag"):  # one line, not argparse's usage
        lm_eval_command("int8", "builtin:tiny-llama", "float32", "cpu", ["--no-such-flag"])


def test_metric_names():
    got = lm_eval_task.metric_values(
        {"alias": "x", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": "N/A", "em,strip": 1.0,
         "f1,a": 0.1, "f1,b": 0.2}
    )
    assert got == {"acc": 0.5, "em": 1.0, "f1,a": 0.1, "f1,b": 0.2, "n": 4}


def run_config(tmp_path, **lm_eval_params):
    from kveval.commands.run import run_experiment

    raw = {
        "name": "lmeval_t", "model": "builtin:tiny-llama", "kv": ["int2_g32"], "output": str(tmp_path / "run"),
        "tasks": [{"lm_eval": {"tasks": [MC], "include_path": str(TASKS_DIR), "limit": 4, **lm_eval_params}}],
    }
    return run_experiment(validate(raw), quiet=True)


def test_config_task_runs_resumes_and_rejects_unknown_names(tmp_path, monkeypatch):
    metrics = run_config(tmp_path)
    base, q = metrics["baseline"]["lm_eval"][MC], metrics["policies"]["int2_g32"]["lm_eval"][MC]
    assert base["n"] == 4 and base["layers_quantized"] == 0 and q["layers_quantized"] == 4
    assert set(q) >= {"acc", "acc_norm", "delta_acc", "delta_acc_norm"}
    records = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in records) == [f"lm_eval/{MC}/baseline", f"lm_eval/{MC}/int2_g32"]

    def fail(*a, **k):
        raise AssertionError("a recorded (task, policy) was evaluated again")

    monkeypatch.setattr(lm_eval_task, "evaluate_one", fail)
    again = run_config(tmp_path)
    assert again["policies"]["int2_g32"]["lm_eval"] == metrics["policies"]["int2_g32"]["lm_eval"]
    assert len((tmp_path / "run" / "records.jsonl").read_text().splitlines()) == 2

    with pytest.raises(KvevalError) as info:
        run_config(tmp_path / "other", tasks=["kveval_facts_mcq"])
    msg = str(info.value)
    assert "\n" not in msg and "unknown lm-eval task 'kveval_facts_mcq'" in msg and f"did you mean '{MC}'" in msg
    assert not (tmp_path / "other").exists(), "the results folder is not touched"
    with pytest.raises(KvevalError, match="is not a folder"):
        run_config(tmp_path / "other", include_path="no/such/folder")


# --- the builtin model ---------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_builtin_none_equals_hflm_and_int2_changes_accuracy(builtin_model, local_tasks):
    model, tok = builtin_model
    # 12 items: measured FP 8/12 correct, int2_g32 5/12 (all 32: 19 vs 15; int4_g64 17)
    plain = evaluate(HFLM(pretrained=model, tokenizer=tok), local_tasks, [MC], limit=12)
    fp = evaluate(KVEvalLM(pretrained=model, tokenizer=tok, kv="none"), local_tasks, [MC], limit=12)
    assert fp["results"] == plain["results"]
    assert responses(fp, MC) == responses(plain, MC)
    q = evaluate(KVEvalLM(pretrained=model, tokenizer=tok, kv="int2_g32"), local_tasks, [MC], limit=12)
    assert q["results"][MC]["acc,none"] != plain["results"][MC]["acc,none"]
    assert q["config"]["layers_quantized"] == 30 and q["config"]["num_layers"] == 30


@pytest.mark.integration
def test_builtin_generation_none_equals_hflm(builtin_model, local_tasks):
    model, tok = builtin_model
    plain = evaluate(HFLM(pretrained=model, tokenizer=tok), local_tasks, [GEN], limit=4)
    fp = evaluate(KVEvalLM(pretrained=model, tokenizer=tok, kv="fp16"), local_tasks, [GEN], limit=4)
    assert fp["results"] == plain["results"] and responses(fp, GEN) == responses(plain, GEN)
