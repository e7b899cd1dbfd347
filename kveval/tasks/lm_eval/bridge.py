"""lm-evaluation-harness bridge: any lm-eval task under any KV policy, with no fork of lm-eval.

``KVEvalLM`` is lm-eval's HuggingFace model (``HFLM``) with two methods replaced:

- log-likelihood requests (``_model_call``: multiple choice, perplexity-style tasks) run in one pass under
  :func:`kveval.patch.emulate`, i.e. with the logits that token-by-token decoding through the quantized cache
  would give;
- generation requests (``_model_generate``) decode through a fresh :class:`kveval.patch.QuantizedKVCache` per
  batch (packed storage, the real thing).

The prefill setting of log-likelihood requests is explicit (model argument ``prefill``), because lm-eval scores
context + continuation in one forward pass, which a serving engine would run as a *prefill*, and a prefill with
``policy.prefill == "fp"`` never reads a quantized key:

- ``prefill=none`` (default): every token is scored as if decoded one at a time through the quantized cache
  (``emulate(prefill_len=0)``, the same convention as kveval's perplexity). Exact for batched, right-padded
  input: padding sits after the real tokens, which causal attention never lets them see.
- ``prefill=context``: the request's context is the prompt (prefilled as ``policy.prefill`` says) and only the
  continuation is decoded; the rows of a batch are then run one by one (each has its own context length).
  With ``policy.prefill: fp`` a one-token continuation (most multiple-choice tasks) sees no quantized key at all.

Entry points::

    # Python: kveval loads the model, or pass an already loaded model and tokenizer
    lm = KVEvalLM(model="builtin:smollm2-135m", kv="int4_g64")
    lm_eval.simple_evaluate(model=lm, tasks=["kveval_facts_mc"], task_manager=TaskManager(include_path=...))
    # lm-eval's own command line / simple_evaluate(model="kveval", model_args=...)
    lm-eval run --model kveval --model_args model=builtin:smollm2-135m,kv=int4_g64 --tasks ... --device cpu
    # kveval's command line (forwards lm-eval's arguments): lm_eval_command() below
    kveval lm-eval --kv int4_g64 -- --tasks kveval_facts_mc --include_path tasks/lm_eval --limit 20

Under a ``none`` policy (``fp16``) the results equal plain ``HFLM`` on the same model to the last digit.

NaN or infinity in the logits of a request (log-likelihood, or a generated token) stops the evaluation with one
:class:`KvevalError` line naming whose fault it is (the model's when no layer is quantized, else the policy's):
:mod:`kveval.tasks.common.finite`, the check every kveval task shares. lm-eval would otherwise score NaN silently.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kveval.errors import KvevalError
from kveval.patch import QuantizedKVCache, cache_kwargs, emulate
from kveval.policy import KVPolicy
from kveval.tasks.common.finite import check_finite_logits, finite_generation, finite_quantizer_inputs

log = logging.getLogger(__name__)

PREFILL_MODES = ("none", "context")
LOGLIKELIHOOD = "an lm-eval log-likelihood request"  # where, in the non-finite logits line
GENERATION = "an lm-eval generation request"


def resolve_policy(kv: str | dict | KVPolicy) -> KVPolicy:
    """A policy from a preset name (``int4_g64``), a policy file (``.yaml``/``.yml``/``.json`` holding one policy
    mapping, as under ``kv.policies`` in a config), a policy mapping, or a ``KVPolicy``."""
    if isinstance(kv, KVPolicy):
        return kv
    if isinstance(kv, dict):
        return KVPolicy.from_config(kv)
    kv = str(kv)
    path = Path(kv).expanduser()
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        from kveval.schema import load_yaml, read_text_file

        if not path.exists():
            raise KvevalError(f"policy file {kv!r} does not exist")  # a FIFO or folder: read_text_file refuses it
        data = load_yaml(read_text_file(path, "policy file", max_bytes=1 << 20), f"policy file {kv}")
        return KVPolicy.from_config(data, name=path.stem)
    return KVPolicy.preset(kv)


def quantized_layer_count(model, policy: KVPolicy) -> int:
    """How many attention layers of ``model`` quantize K or V under ``policy`` (what the patches will count)."""
    from kveval.models import model_info

    info = model_info(model)
    n, sliding = info["num_layers"], info["sliding_layers"]
    return sum(1 for i in info["kv_layers"] if not all(s.is_none for s in policy.specs_for_layer(i, n, sliding)))


@register_model("kveval")
class KVEvalLM(HFLM):
    """lm-eval's ``HFLM`` whose KV cache is quantized under a kveval policy.

    Arguments (all also usable as ``--model_args key=value``):
        model: a kveval model name (``builtin:smollm2-135m``, a hub id, a folder, a ``.gguf`` file), loaded with
            ``kveval.models.load_model``; or ``pretrained``: the same name, or an already loaded ``PreTrainedModel``
            (then ``tokenizer`` is required).
        kv: preset name, policy file, policy mapping or ``KVPolicy`` (default ``fp16``: no quantization).
        prefill: ``none`` | ``context``, how log-likelihood requests are scored (see the module docstring).
        dtype, device: for loading by name (``float32``; ``cpu`` unless lm-eval's ``--device`` says otherwise).
        Everything else (``batch_size``, ``max_length``, ...) goes to ``HFLM``.

    After a request, ``layers_quantized`` holds the number of attention layers that the patch (emulation or
    cache) actually quantized; ``get_model_info()`` (written into lm-eval's results ``config``) reports it.
    """

    def __init__(
        self,
        pretrained: Any = None,
        model: str | None = None,
        kv: str | dict | KVPolicy = "fp16",
        prefill: str = "none",
        tokenizer: Any = None,
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,
        **kwargs,
    ) -> None:
        if prefill not in PREFILL_MODES:
            raise KvevalError(f"kveval lm-eval model: prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if model is not None and pretrained is not None:
            raise KvevalError("kveval lm-eval model: give either model= (a name) or pretrained=, not both")
        source = model if model is not None else pretrained
        if source is None:
            source = "builtin:smollm2-135m"
        if isinstance(source, str):
            from kveval.models import load_model

            loaded, loaded_tok = load_model(
                source, device=device or "cpu", dtype=str(dtype), trust_remote_code=bool(trust_remote_code)
            )
            tokenizer = tokenizer if tokenizer is not None else loaded_tok
            self.kveval_name = source
        else:
            if tokenizer is None:
                raise KvevalError("kveval lm-eval model: an already loaded model needs its tokenizer (tokenizer=...)")
            loaded = source
            self.kveval_name = getattr(source, "kveval_name", None) or getattr(source, "name_or_path", None)
        from kveval.memory.fit import check_design
        from kveval.models import model_arch, model_info

        info = model_info(loaded)
        self.policy = resolve_policy(kv)
        check_design(model_arch(loaded), self.policy)
        self.prefill = prefill
        self.layers_quantized = None  # measured on the first request
        self.layers_quantized_expected = quantized_layer_count(loaded, self.policy)
        self._context_lens: dict[tuple, int] = {}
        super().__init__(pretrained=loaded, tokenizer=tokenizer, **kwargs)
        mode = (
            "every token decoded through the quantized cache" if prefill == "none"
            else f"context prefilled (policy prefill: {self.policy.prefill}), continuation decoded"
        )
        log.info(
            "kveval: policy %s (%s); %d of %d layers quantized; log-likelihood: %s",
            self.policy.name, self.policy.describe(), self.layers_quantized_expected, info["num_layers"], mode,
        )

    # --- log-likelihood: single-pass emulation ------------------------------------------------------------------
    def _note(self, count: int) -> None:
        if count != self.layers_quantized_expected:  # never a silent full-precision run
            raise RuntimeError(
                f"kveval: {count} layers were quantized, expected {self.layers_quantized_expected}"
            )
        self.layers_quantized = count

    # --- NaN or infinity: one line, never a silent score -----------------------------------------------------------
    def _quantized_by(self) -> str | None:
        """What quantizes the cache, for the non-finite check's message: None when no layer is quantized (then
        the logits are the model's own)."""
        return None if self.layers_quantized_expected == 0 else f"policy '{self.policy.name}'"

    def _check_finite(self, logits: torch.Tensor, where: str) -> torch.Tensor:
        """``logits``, after :func:`kveval.tasks.common.finite.check_finite_logits` (one KvevalError line on NaN or
        infinity, naming the model or the policy)."""
        check_finite_logits(logits, where=where, dtype=self._model.dtype, quantized_by=self._quantized_by())
        return logits

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` of right-padded ``inps [batch, seq]`` under the policy's emulation;
        NaN or infinity in them is one :class:`KvevalError` line, never a score."""
        if attn_mask is not None or labels is not None:
            raise KvevalError("kveval lm-eval model: encoder-decoder (seq2seq) models are not supported")
        if self.prefill == "context":
            return self._call_with_context(inps)
        with finite_quantizer_inputs(LOGLIKELIHOOD, self._quantized_by() or "the full-precision model"):
            with emulate(self.model, self.policy, prefill_len=0) as emu:
                out = super()._model_call(inps)
        self._note(emu.layers_quantized)
        return self._check_finite(out, LOGLIKELIHOOD)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """Remember each request's context length in its model input (for ``prefill=context``), then score."""
        if self.prefill == "context":
            self._context_lens = {}
            for _key, context_enc, continuation_enc in requests:
                inp = (context_enc + continuation_enc)[-(self.max_length + 1):][:-1]
                self._context_lens[tuple(inp)] = max(len(inp) - len(continuation_enc) + 1, 0)
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._context_lens = {}

    def _lookup_context(self, row: list[int]) -> tuple[int, int]:
        """(real length, context length) of one right-padded (with 0) input row."""
        last = max((i + 1 for i, t in enumerate(row) if t != 0), default=0)
        for n in range(len(row), last - 1, -1):
            ctx = self._context_lens.get(tuple(row[:n]))
            if ctx is not None:
                return n, ctx
        raise RuntimeError("kveval: a log-likelihood input matches no request; use prefill=none")

    def _call_with_context(self, inps: torch.Tensor) -> torch.Tensor:
        out = None
        for b, row in enumerate(inps.tolist()):
            n, ctx = self._lookup_context(row)
            with finite_quantizer_inputs(LOGLIKELIHOOD, self._quantized_by() or "the full-precision model"):
                with emulate(self.model, self.policy, prefill_len=ctx) as emu:
                    logits = super()._model_call(inps[b : b + 1, :n])
            self._note(emu.layers_quantized)
            self._check_finite(logits, LOGLIKELIHOOD)
            if out is None:
                out = logits.new_zeros(inps.shape[0], inps.shape[1], logits.shape[-1])
            out[b, :n] = logits[0]
        return out

    # --- generation: the real quantized cache -------------------------------------------------------------------
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """Greedy/sampled generation with a fresh ``QuantizedKVCache`` (left padding of a batch is stored too,
        masked out by the attention mask; with batch_size 1 there is none)."""
        from transformers import LogitsProcessorList

        cache = QuantizedKVCache(self.model, self.policy, read="buffered")  # faster, the same tokens as lean
        generation_kwargs.update(cache_kwargs(self.model, cache))
        finite = finite_generation(where=GENERATION, dtype=self._model.dtype, quantized_by=self._quantized_by())
        generation_kwargs["logits_processor"] = LogitsProcessorList(
            [*(generation_kwargs.get("logits_processor") or []), *finite])
        with finite_quantizer_inputs(GENERATION, self._quantized_by() or "the full-precision model"):
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        self._note(sum(1 for layer in cache.layers if not (layer.key_spec.is_none and layer.value_spec.is_none)))
        return out

    # --- reporting ----------------------------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        """Model facts for lm-eval's results ``config`` (no hub query: the model was loaded by kveval)."""
        from kveval.models import model_info

        return {
            "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
            "model_dtype": str(self._model.dtype),
            "kveval_model": self.kveval_name,
            "kv_policy": self.policy.name,
            "kv_policy_description": self.policy.describe(),
            "kv_policy_config": self.policy.to_config(),
            "kv_prefill": self.prefill,
            "num_layers": model_info(self._model)["num_layers"],
            "layers_quantized": (
                self.layers_quantized if self.layers_quantized is not None else self.layers_quantized_expected
            ),
        }


def model_args_string(model: str, kv: str, dtype: str = "float32", prefill: str | None = None) -> str:
    """lm-eval's ``--model_args`` for the kveval model, e.g. ``model=builtin:smollm2-135m,kv=int4_g64,dtype=float32``."""
    for name, value in (("model", model), ("kv", kv), ("dtype", dtype), ("prefill", prefill)):
        if value is not None and ("," in str(value) or "=" in str(value)):
            raise KvevalError(f"--{name} {value!r}: lm-eval's model_args cannot hold ',' or '='")
    parts = [f"model={model}", f"kv={kv}", f"dtype={dtype}"]
    if prefill is not None:
        parts.append(f"prefill={prefill}")
    return ",".join(parts)


