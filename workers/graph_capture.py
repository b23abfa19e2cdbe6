"""CUDA graph capture for a ``ModelRunner``: decode graphs, a draft model's decode and proposal
graphs, the mixed-step graphs and the input kernel's graphs (``workers.input_graphs``). A
model's graphs replay from one memory pool (one step replays one of them at a time); KV sizing
reserves their outputs beforehand (``workers.memory_profile.graph_output_bytes``),
from the same ``captures_graphs`` and ``graph_query_lens``."""

from __future__ import annotations

from workers.cuda_graphs import DecodeGraphs
from workers.draft_graphs import ProposeGraphs
from workers.input_graphs import build_input_graphs, builds_input_graphs
from workers.mixed_graphs import MixedGraphs, max_step_tokens


def capture_cuda_graphs(r) -> None:
    """Captures the runner's graphs: the target's decode graphs (one per batch size, length bucket
    and query length), a draft model's decode and proposal graphs, then the mixed-step graphs;
    nothing where ``ModelRunner.captures_graphs`` says no."""
    if not r.captures_graphs():
        return
    target_q, draft_q = r.graph_query_lens()
    r.graphs = DecodeGraphs(
        r.model,
        r.kv_caches,
        r.cfg.scheduler.max_num_seqs,
        r.max_model_len,
        r.block_size,
        r.max_blocks_per_req,
        r.device,
        r.bounds_are_exact,
        query_lens=target_q,
    )
    r.graphs.capture()
    if r.spec is not None and r.spec.draft_model is not None:
        r.spec.proposer.graphs = DecodeGraphs(
            r.spec.draft_model,
            r.spec.proposer.kv_caches,
            r.cfg.scheduler.max_num_seqs,
            r.spec.max_position,
            r.block_size,
            r.max_blocks_per_req,
            r.device,
            r.bounds_are_exact,
            query_lens=draft_q,
            logits=False,
        )
        r.spec.proposer.graphs.capture()
        proposer = r.spec.proposer
        proposer.propose_graphs = ProposeGraphs(
            proposer, proposer.graphs, r.state.token_ids, r.state.ensure_draft_probs(r.spec.k)
        )
        proposer.propose_graphs.capture()
    _capture_mixed(r)
    if builds_input_graphs(r):
        n = r.cfg.scheduler.max_num_seqs
        r.input_graphs = build_input_graphs(
            r.state, r.block_size, r.graphs, r.mixed_graphs, n, r.max_blocks_per_req, r.device
        )
        r.input_graphs.capture()


def mixed_logits_rows(r) -> int:
    """The most logits rows a step of the runner ``r`` samples from: one a request, 1 + k with
    k drafts a row."""
    k = r.cfg.speculative.num_speculative_tokens if r.spec is not None else 0
    return r.cfg.scheduler.max_num_seqs * (1 + k)


def _capture_mixed(r) -> None:
    """Whole-forward graphs per token bucket (``workers.mixed_graphs``) for the steps the
    decode graphs do not cover: prefill, mixed and uneven speculative steps, of the model
    and the draft."""
    sched = r.cfg.scheduler
    max_tokens = max_step_tokens(sched.max_num_batched_tokens, sched.max_num_seqs, r.max_model_len)
    common = dict(max_blocks=r.max_blocks_per_req, device=r.device, bounds_are_exact=r.bounds_are_exact)
    r.mixed_graphs = MixedGraphs(
        r.model,
        r.kv_caches,
        max_tokens,
        sched.max_num_seqs,
        r.max_model_len,
        pool=r.graphs.pool if r.graphs is not None else None,
        logits_rows=mixed_logits_rows(r),
        **common,
    )
    r.mixed_graphs.capture()
    if r.spec is not None and r.spec.draft_model is not None:
        # the draft's window adds each sampling row's newest token to the step's tokens
        proposer = r.spec.proposer
        proposer.mixed_graphs = MixedGraphs(
            r.spec.draft_model,
            proposer.kv_caches,
            max_tokens + sched.max_num_seqs,
            sched.max_num_seqs,
            r.spec.max_position,
            pool=proposer.graphs.pool if proposer.graphs is not None else None,
            **common,
        )
        proposer.mixed_graphs.capture()
