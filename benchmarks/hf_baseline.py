"""The transformers baseline: the same workload through ``model.generate_batch``
(transformers' continuous batching, paged attention), greedy, EOS disabled."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.datasets import SampleRequest


def hf_available() -> str | None:
    """None if transformers has continuous batching, else why not."""
    try:
        import transformers
        from transformers import GenerationMixin
    except Exception as exc:
        return f"transformers is not importable: {exc}"
    if not hasattr(GenerationMixin, "generate_batch"):
        return (
            f"transformers {transformers.__version__} has no generate_batch "
            "(continuous batching); upgrade transformers for --baseline hf"
        )
    return None


def run_hf(
    model_dir: str,
    load_format: str,
    token_prompts: list[list[int]],
    output_lens: list[int],
    dtype: str,
    attn_implementation: str,
    device: str,
) -> dict[str, Any]:
    """Runs where it is called (a Ray task with the GPU, or the local process)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    why = hf_available()
    if why:
        return {"error": why}
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        dtype, torch.bfloat16 if dev.type == "cuda" else torch.float32
    )
    t0 = time.perf_counter()
    if load_format == "dummy":
        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=tdtype, attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=tdtype, attn_implementation=attn_implementation
        ).to(dev)
    model.eval()
    load_s = time.perf_counter() - t0
    # generate_batch takes one max_new_tokens for all requests: the workload's maximum.
    max_new = max(output_lens)
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cuda = dev.type == "cuda"
    kw: dict[str, Any] = {"warmup": cuda}  # warmup = CUDA-graph pre-capture
    if not cuda:  # on the CPU it would size its KV cache from host memory (slow): size it to the workload
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        page = 256
        blocks = sum(-(-(len(p) + max_new) // page) for p in token_prompts) + 2
        kw["continuous_batching_config"] = ContinuousBatchingConfig(
            page_size=page, num_blocks=blocks, max_batch_tokens=max(512, max(len(p) for p in token_prompts))
        )
    # no inference_mode: generate_batch updates its tensors in a background thread
    with torch.no_grad():
        if cuda:
            model.generate_batch(
                inputs=[p[:16] for p in token_prompts[:4]],
                generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0),
            )
            torch.cuda.synchronize()
        warm = warm_cached_manager(model, gen, token_prompts, max_new, kw)
        start = time.perf_counter()
        out = model.generate_batch(inputs=token_prompts, generation_config=gen, progress_bar=True, **kw)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
    outputs = list(out.values())
    n_out = sum(len(o.generated_tokens) for o in outputs)
    n_in = sum(len(p) for p in token_prompts)
    return {
        "backend": "transformers.generate_batch",
        "attn_implementation": attn_implementation,
        "dtype": str(tdtype).removeprefix("torch."),
        "device": str(dev),
        "model_load_s": load_s,
        "max_new_tokens": max_new,
        "note": "generate_batch uses one max_new_tokens (the workload's maximum) for every request; "
        "the timed call includes its manager's start and shutdown, and its CUDA-graph warm-up only "
        "where warm_up says so; on CPU its KV cache is sized to the workload",
        **warm,
        **throughput_fields(elapsed, len(outputs), n_in, n_out),
    }


def warm_cached_manager(model, gen, token_prompts: list[list[int]], max_new: int, kw: dict[str, Any]) -> dict[str, Any]:
    """Build generate_batch's manager for this very workload, capture its CUDA graphs and
    leave it cached on the model, so that the timed ``generate_batch`` reuses it: its
    warm-up then stays out of the timed call, as syncless's engine start-up stays out of
    its own. Where this transformers cannot (no ``WorkloadHints``, no ``warmup`` on the
    manager, or the cycle raises), the timed call warms up itself and ``warm_up`` says so.
    Mutates ``kw`` (``warmup`` off once warmed)."""
    import torch

    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError as exc:
        return {"warm_up": f"in the timed call (no WorkloadHints: {exc})"}
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in token_prompts),
        max_generated_length=max_new,
        num_requests=len(token_prompts),
    )
    manager = None
    try:
        manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=kw.get("continuous_batching_config"), workload_hints=hints
        )
        if not hasattr(manager, "warmup"):
            return {"warm_up": "in the timed call (the manager has no warmup)"}
        t0 = time.perf_counter()
        manager.warmup()
        manager.start()
        manager.stop(block=True, keep_for_next_session=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
    except Exception as exc:  # an API this version lacks: warm up inside the timed call
        if manager is not None and hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        return {"warm_up": f"in the timed call ({type(exc).__name__}: {exc})"}
    if getattr(model, "_cached_continuous_batching_manager", None) is not manager:
        return {"warm_up": "in the timed call (the warmed manager was not cached)", "warm_up_s": warm_s}
    kw["warmup"] = False
    return {"warm_up": "before the timed call (cached manager)", "warm_up_s": warm_s}


def throughput_fields(elapsed: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    """``vllm bench throughput``'s JSON fields, plus the output rate it prints."""
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": num_requests,
        "total_num_tokens": total,
        "total_num_prompt_tokens": prompt_tokens,
        "total_num_output_tokens": output_tokens,
        "requests_per_second": num_requests / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def token_prompts_of(requests: list[SampleRequest], tokenizer) -> list[list[int]]:
    return [r.token_ids if r.token_ids is not None else tokenizer.encode(r.prompt) for r in requests]
