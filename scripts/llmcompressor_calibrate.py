"""llm-compressor's own KV-cache calibration (``oneshot`` with a ``kv_cache_scheme``), for the parity test of
``kveval calibrate --set calibration.method=minmax_ema`` (tests/test_llmcompressor_parity.py).

Runs in llm-compressor's environment (``bash scripts/setup_llmcompressor.sh`` prints its python), never in
kveval's: llmcompressor 0.14 pins transformers <= 5.17 and compressed-tensors 0.19.

    PYTHON scripts/llmcompressor_calibrate.py MODEL_DIR WINDOWS_JSON OUT_DIR [--strategy tensor|attn_head]
        [--observer minmax|static_minmax] [--dtype float32|bfloat16]

``WINDOWS_JSON`` holds ``{"windows": [[token ids], ...]}``: the calibration batches, one sequence each, in the order
they are observed (no shuffling, no padding, no BOS added: the ids are the model's input as they are). The
quantized checkpoint (compressed-tensors ``kv_cache_scheme``, ``model.layers.N.self_attn.k_scale`` / ``v_scale``
beside the unchanged weights) is written to ``OUT_DIR`` by llm-compressor's ``save_pretrained``, and a summary
(versions, scales) to ``OUT_DIR/llmcompressor_run.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("windows")
    ap.add_argument("out")
    ap.add_argument("--strategy", default="tensor", choices=("tensor", "attn_head"))
    ap.add_argument("--observer", default=None, help="llm-compressor's observer (default: its own, minmax)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()

    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from compressed_tensors.quantization import QuantizationArgs
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = json.loads(Path(args.windows).read_text())["windows"]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    scheme = {"num_bits": 8, "type": "float", "strategy": args.strategy, "dynamic": False, "symmetric": True}
    if args.observer:
        scheme["observer"] = args.observer
    recipe = QuantizationModifier(kv_cache_scheme=QuantizationArgs(**scheme))
    oneshot(model=model, processor=tokenizer, dataset=data, recipe=recipe, num_calibration_samples=len(windows),
            max_seq_length=max(len(w) for w in windows), shuffle_calibration_samples=False, batch_size=1,
            output_dir=args.out)
    scales = {}
    for name, p in model.named_parameters():
        if name.endswith(("k_scale", "v_scale")):
            scales[name] = p.detach().float().flatten().tolist()
    summary = {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
               "transformers": transformers.__version__, "torch": torch.__version__, "dtype": args.dtype,
               "strategy": args.strategy, "observer": args.observer or "minmax (default)",
               "windows": len(windows), "tokens": sum(len(w) for w in windows), "scales": scales}
    (Path(args.out) / "llmcompressor_run.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "scales"}))


if __name__ == "__main__":
    main()
