"""Benchmark workloads: random, fixed and JSONL, with ``vllm bench`` semantics.

- ``random``: prompt and output lengths drawn uniformly from
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]``, token ids uniform over the
  vocabulary, all from ``--seed``; prompts are token-id prompts.
- ``fixed``: every request is the same prompt (``--prompt TEXT`` if given, else
  ``input_len`` deterministic token ids) with exactly ``output_len`` outputs.
- ``jsonl``: one request a line: ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``,
  optionally ``"output_len"`` (or ``"max_tokens"``); ``--output-len`` is the default.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class SampleRequest:
    prompt: Any  # str or {"prompt_token_ids": [...]}
    prompt_len: int  # tokens (for text prompts: as the tokenizer counts them, if known)
    expected_output_len: int

    @property
    def token_ids(self) -> list[int] | None:
        return self.prompt["prompt_token_ids"] if isinstance(self.prompt, dict) else None


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset", "--dataset-name", dest="dataset", choices=("random", "fixed", "jsonl"), default="random"
    )
    g.add_argument("--dataset-path", help="JSONL file for --dataset jsonl")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in len*(1-r) .. len*(1+r), r in [0, 1)",
    )
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt", default=None, help="fixed: the prompt text repeated (default: token ids)")


def _lens(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    lo = max(1, int(length * (1 - ratio)))
    hi = max(lo, int(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int, low_id: int = 0
) -> list[SampleRequest]:
    if not 0 <= range_ratio < 1:
        raise SystemExit(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    ins = _lens(rng, n, input_len, range_ratio)
    outs = _lens(rng, n, output_len, range_ratio)
    reqs = []
    for i_len, o_len in zip(ins, outs):
        ids = [rng.randrange(low_id, vocab_size) for _ in range(i_len)]
        reqs.append(SampleRequest({"prompt_token_ids": ids}, i_len, o_len))
    return reqs


def mostly_unknown(tokenizer, ids: list[int]) -> bool:
    """Whether more than half of ``ids`` are the tokenizer's unknown token: how a random-weight
    ``--shape``'s synthetic word-level tokenizer (it knows only its own words) reads real text."""
    unk = getattr(tokenizer, "unk_token_id", None)
    return bool(ids) and unk is not None and 2 * sum(i == unk for i in ids) > len(ids)


def text_prompt_len(text: str, tokenizer, where: str) -> int:
    """Tokens in a text prompt (words without a tokenizer). A text the tokenizer reads mostly as
    unknown tokens is refused: a random-weight ``--shape`` has a synthetic word-level tokenizer,
    so every such prompt would reach the model as the same run of ``<unk>`` (and hit the prefix
    cache)."""
    if tokenizer is None:
        return len(text.split())
    ids = tokenizer.encode(text)  # (as the server counts it: with the special tokens it adds)
    if mostly_unknown(tokenizer, ids):
        raise SystemExit(
            f"{where}: the tokenizer reads this text as unknown tokens (a random-weight --shape's tokenizer "
            "knows only its own words); give token-id prompts (--dataset random, or prompt_token_ids in the JSONL)"
        )
    return len(ids)


def fixed_requests(
    n: int, input_len: int, output_len: int, vocab_size: int, prompt: str | None, tokenizer=None
) -> list[SampleRequest]:
    if prompt is not None:
        p_len = text_prompt_len(prompt, tokenizer, "--prompt")
        return [SampleRequest(prompt, p_len, output_len) for _ in range(n)]
    ids = [3 + (i * 7919) % max(1, vocab_size - 3) for i in range(input_len)]
    return [SampleRequest({"prompt_token_ids": list(ids)}, input_len, output_len) for _ in range(n)]


def jsonl_requests(path: str, n: int | None, output_len: int, tokenizer=None) -> list[SampleRequest]:
    if not path:
        raise SystemExit("--dataset jsonl needs --dataset-path FILE.jsonl")
    reqs = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{lineno}: not JSON ({exc})") from None
        o_len = int(row.get("output_len", row.get("max_tokens", output_len)))
        if "prompt_token_ids" in row:
            ids = [int(t) for t in row["prompt_token_ids"]]
            reqs.append(SampleRequest({"prompt_token_ids": ids}, len(ids), o_len))
        elif isinstance(row.get("prompt"), str):
            text = row["prompt"]
            p_len = text_prompt_len(text, tokenizer, f"{path}:{lineno}")
            reqs.append(SampleRequest(text, p_len, o_len))
        else:
            raise SystemExit(f'{path}:{lineno}: needs "prompt" (text) or "prompt_token_ids"')
        if n is not None and len(reqs) >= n:
            break
    if not reqs:
        raise SystemExit(f"{path}: no requests")
    return reqs


def get_requests(args: argparse.Namespace, vocab_size: int, tokenizer=None) -> list[SampleRequest]:
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be >= 1")
    if args.dataset == "random":
        return random_requests(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_size, args.seed
        )
    if args.dataset == "fixed":
        return fixed_requests(args.num_prompts, args.input_len, args.output_len, vocab_size, args.prompt, tokenizer)
    return jsonl_requests(args.dataset_path, args.num_prompts, args.output_len, tokenizer)


def vocab_size_of(model: str) -> int:
    """The vocabulary of a checkpoint directory or a GGUF file."""
    from workers.models.arch import load_arch

    return load_arch(model).vocab_size
