"""FP8 accuracy: greedy decoding with FP8 weights, an FP8 KV cache and both, against the same
model unquantized, on a fixed prompt set.

For each prompt both runs decode greedily; the two token sequences agree up to their first
difference. Reported per configuration:

- ``token_agreement``: the tokens before the first difference over all tokens decoded (1.0:
  every sequence identical);
- ``identical_sequences``: how many sequences are equal from start to end;
- ``mean_abs_logprob_diff``: the mean |log p_fp8(t) - log p_base(t)| of the chosen token over
  the positions where both sequences still agree (same context, same token).

    python -m benchmarks.fp8_accuracy                       # the embedded SmolLM2-135M-Instruct
    python -m benchmarks.fp8_accuracy --shape llama-3.1-8b  # random weights of a real shape (GPU)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import hardware_info, versions

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Repeat this code exactly: def add(a, b):\n    return a + b",
    "List five prime numbers.",
    "What does a compiler do?",
    "Give me three tips for learning to cook.",
    "Translate 'good morning' into French and Spanish.",
]

CONFIGS = {
    "fp8 weights": {"quantization": "fp8"},
    "fp8 kv cache": {"kv_cache_dtype": "fp8"},
    "fp8 weights + kv cache": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def compare(base: list[tuple[list[int], list[float]]], quant: list[tuple[list[int], list[float]]]) -> dict[str, Any]:
    """The agreement metrics of two runs' ``(tokens, chosen-token logprobs)`` per prompt."""
    agree = total = identical = 0
    diffs: list[float] = []
    for (bt, bl), (qt, ql) in zip(base, quant, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(bt, qt)) if a != b), min(len(bt), len(qt)))
        agree += n
        total += len(bt)
        identical += int(bt == qt)
        diffs += [abs(a - b) for a, b in zip(bl[:n], ql[:n])]
    return {
        "token_agreement": agree / total if total else 1.0,
        "identical_sequences": identical,
        "sequences": len(base),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0,
        "max_abs_logprob_diff": max(diffs, default=0.0),
    }


def _decode(model: str | None, fmt: str, prompts, max_tokens: int, options: dict) -> list:
    from cluster import LLM, SamplingParams

    llm = LLM(model=model, load_format=fmt, max_model_len=1024, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        if prompts is None:  # a real model: its chat template
            outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]))
    return res


def main(argv=None) -> dict:
    from benchmarks.shapes import SHAPES, resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: the embedded default model)")
    g.add_argument("--shape", choices=sorted(SHAPES), help="random weights of a real shape (random prompt ids)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per prompt (default: 32)")
    p.add_argument("--dtype", default="auto", help="the baseline's dtype (default: auto = bf16 on GPU, fp32 on CPU)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")

    prompts = None
    model, fmt = args.model, "safetensors"
    if args.shape:
        model, fmt = resolve_model(None, args.shape)
        prompts = [[(31 * i + 7 * j) % 1000 + 10 for j in range(64 + 16 * i)] for i in range(len(CHATS))]
    base = _decode(model, fmt, prompts, args.max_tokens, {"dtype": args.dtype})
    results = {}
    for name in names:
        quant = _decode(model, fmt, prompts, args.max_tokens, dict(CONFIGS[name], dtype=args.dtype))
        results[name] = compare(base, quant)
    out = {
        "benchmark": "fp8_accuracy",
        "model": args.model or ("embedded default" if not args.shape else args.shape),
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "results": results,
        "hardware": hardware_info(),
        "versions": versions(),
    }
    print(f"{'config':<26} {'agreement':>9} {'identical':>9} {'mean |dlogp|':>12} {'max |dlogp|':>11}")
    for name, r in results.items():
        print(
            f"{name:<26} {r['token_agreement']:>9.3f} {r['identical_sequences']:>4}/{r['sequences']:<4} "
            f"{r['mean_abs_logprob_diff']:>12.4f} {r['max_abs_logprob_diff']:>11.4f}"
        )
    if args.output:
        args.output.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
