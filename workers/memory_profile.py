"""KV cache sizing: the device memory a worker can give its KV cache, measured."""

from __future__ import annotations

import logging
from itertools import accumulate

import torch

from metadata.attention_metadata import AttentionMetadata
from workers import kv_cache
from workers.cuda_graphs import decode_graph_output_bytes
from workers.graph_capture import mixed_logits_rows
from workers.input_graphs import builds_input_graphs, input_stage_words
from workers.mixed_graphs import max_step_tokens, mixed_graph_output_bytes
from workers.pipeline import scratch_model

logger = logging.getLogger(__name__)


def profile_request_lens(num_tokens: int, max_len: int) -> list[int]:
    """The profiling forward's requests: ``num_tokens`` tokens (the largest captured step) in
    requests of at most ``max_len`` (positions stay inside the rotary table)."""
    full, rest = divmod(num_tokens, max_len)
    return [max_len] * full + ([rest] if rest else [])


def profile_free_bytes(r) -> int:
    """Free device memory under ``gpu_memory_utilization`` after a peak-sized forward of the
    ``ModelRunner`` ``r`` (the target's largest step, ``max_step_tokens``; the draft model's
    own steps are not profiled), and the sampler's and verifier's temporaries of the largest
    logits batch."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(r.device)
    sched = r.cfg.scheduler
    # the largest step a graph is captured for (workers.mixed_graphs' top bucket)
    n = max_step_tokens(sched.max_num_batched_tokens, sched.max_num_seqs, r.max_model_len)
    dummy = kv_cache.allocate(r.num_layers, 1, r.block_size, r.num_kv_heads, r.arch.head_dim, r.kv_dtype, r.device)
    lens = profile_request_lens(n, r.max_model_len)
    ids = torch.zeros(n, dtype=torch.int64, device=r.device)
    pos = torch.cat([torch.arange(q) for q in lens]).to(r.device)
    qsl = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl.to(r.device),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=r.device),
        seq_lens_upper_bound=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.zeros(
            len(lens), (max(lens) + r.block_size - 1) // r.block_size, dtype=torch.int32, device=r.device
        ),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=r.device),
        positions=pos,
        num_reqs=len(lens),
        num_actual_tokens=n,
        max_query_len=max(lens),
        max_seq_len_upper_bound=max(lens),
        bounds_are_exact=True,
        eager=True,
    )
    rows = mixed_logits_rows(r)  # logits rows of the largest step: every row verifies 1 + k tokens with drafts on
    with torch.inference_mode():
        model = scratch_model(r.model, r.pp, r.dtype)
        h = model(ids, pos, meta, dummy)
        logits = model.compute_logits(h[-rows:] if n >= rows else h[-1:].expand(rows, -1).contiguous())
        if r.stage.is_last:
            r.draw_once(logits)  # the sampler's temporaries count towards the peak
            from workers.sampling_warm_up import sample_every_option

            # and those of the costliest sampling step: every option (penalties, top-k/top-p,
            # min-p, logprobs) on a full batch of rows (warm-up runs one, as may serving)
            sample_every_option(r.state, logits[: min(rows, r.state.max_rows)])
            if r.spec is not None:  # verification: target probs and residual
                spare = [torch.empty_like(logits) for _ in range(2)]
                if r.spec.method == "draft_model":  # the proposal graphs' draft logits, held in their pool
                    spare += [torch.empty(sched.max_num_seqs, logits.shape[1], device=r.device) for _ in range(2)]
                del spare
    torch.cuda.synchronize()
    del dummy, h, logits
    free, total = torch.cuda.mem_get_info(r.device)
    peak_extra = torch.cuda.max_memory_allocated(r.device) - torch.cuda.memory_allocated(r.device)
    used = total - free
    graphs = graph_output_bytes(r)
    budget = int(total * r.cfg.cache.gpu_memory_utilization) - used - peak_extra - graphs
    if graphs:
        logger.info("CUDA graph outputs reserve %.2f GiB of the KV cache budget", graphs / 2**30)
    if budget <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: {used / 2**30:.1f} GiB used and {graphs / 2**30:.1f} GiB "
            f"reserved for CUDA graph outputs of {total / 2**30:.1f} GiB; raise gpu_memory_utilization, "
            "lower max_num_seqs or num_speculative_tokens (the graphs' logits), or use a smaller model"
        )
    return budget


def graph_output_bytes(r) -> int:
    """Device bytes the ``ModelRunner`` ``r``'s CUDA graphs will keep as outputs once captured
    (``capture_cuda_graphs``: none on the CPU, with ``enforce_eager`` or in a pipeline stage):
    the decode graphs' largest logits (the others share its memory), the mixed-step graphs'
    largest logits, the draft's decode graphs' and mixed-step graphs' hidden states, which
    the profiling forward does not allocate, and the input graphs' stage."""
    if not r.captures_graphs():
        return 0
    sched = r.cfg.scheduler
    target_q, draft_q = r.graph_query_lens()
    logits_row = r.model.lm_head.padded_vocab * 4  # fp32 logits, gathered over the TP ranks
    elt = torch.empty(0, dtype=r.dtype).element_size()
    max_tokens = max_step_tokens(sched.max_num_batched_tokens, sched.max_num_seqs, r.max_model_len)
    total = decode_graph_output_bytes(sched.max_num_seqs, r.max_model_len, target_q, logits_row, True)
    total += mixed_graph_output_bytes(max_tokens, logits_row, mixed_logits_rows(r))
    if r.spec is not None and r.spec.draft_model is not None:
        draft_row = r.spec.draft_arch.hidden_size * elt
        total += decode_graph_output_bytes(sched.max_num_seqs, r.spec.max_position, draft_q, draft_row, False)
        total += mixed_graph_output_bytes(max_tokens + sched.max_num_seqs, draft_row)
    if builds_input_graphs(r):  # the input graphs' stage
        total += 8 * input_stage_words(sched.max_num_seqs, r.max_blocks_per_req, mixed_logits_rows(r), max_tokens)
    return total
