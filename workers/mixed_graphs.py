"""Whole-forward CUDA graphs for the steps the decode graphs do not cover.

Prefill, mixed prefill+decode and speculative steps with uneven draft counts have a
per-step query layout, so they cannot replay a decode graph (one query length for every
row). Their forward is captured once per *token bucket*, attention included:

* the token count is padded to the bucket: padded tokens write no KV (slot -1) and
  compute rows nothing reads (every other op is row-wise);
* the request count is padded to ``rows(bucket)`` (at most ``max_num_seqs``): padded
  requests are empty (their query range starts and ends at the real token count), so
  their attention programs exit at once;
* attention takes its prefill-shaped launch (``kernels.attention_splits.launch_config``
  with a query-length bound above ``DECODE_MAX_Q``), whose grid depends only on those two
  padded counts, and reads every exact value (query starts, lengths, pages) from the
  device, as it does eagerly; the key bound is the longest sequence the cache holds.

The target model's graphs end in its logits at the step's sampled positions (a static
index, padded to ``logits_rows(t)``) and their greedy argmax, so a step's logits GEMM is no
eager cuBLAS call, whose per-shape set-up cost the launch about 0.7 ms; those outputs go back
to the pool as the decode graphs' do (``workers.cuda_graphs``). The draft model's graphs
return hidden states.

A step then costs a few input copies and one graph launch, where eager attention between
captured segments cost about 0.5 ms of host time a layer, and a fully eager forward
enqueues more kernels than the device's launch queue holds (about 1,000 entries on a
Hopper GPU), so that its launch waits for a busy device.
"""

from __future__ import annotations

import logging
import time

import torch

from kernels.attention_splits import DECODE_MAX_Q
from kernels.input_prep import GraphPad
from metadata.attention_metadata import AttentionMetadata
from workers.cuda_graphs import StaticStepInputs, alloc_bytes, capture_graph

logger = logging.getLogger(__name__)


def max_step_tokens(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
    """The most tokens one step of the target model holds: the top token bucket, the memory
    profile's forward and the GEMM precompilation's largest row count."""
    return min(max_num_batched_tokens, max_model_len * max_num_seqs)


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts to capture: fine steps at small sizes (where padding costs the
    most relative to the work), coarser above."""
    sizes = [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    b = 3072
    while sizes[-1] < max_tokens:
        sizes.append(b)
        b = b + b // 2 if b < 8192 else b * 2
    out = [s for s in sizes if s < max_tokens]
    return out + [max_tokens]


def mixed_graph_output_bytes(max_tokens: int, row_bytes: int, logits_rows: int = 0) -> int:
    """Device bytes the outputs of ``MixedGraphs`` hold: with ``logits_rows``, the largest
    bucket's logits (``row_bytes`` a row) and argmax (the buckets share them); else one
    ``t``-row hidden state a bucket."""
    if logits_rows:
        rows = min(logits_rows, max_tokens)
        return alloc_bytes(rows * row_bytes) + alloc_bytes(rows * 8)
    return sum(token_buckets(max_tokens)) * row_bytes


class MixedGraphs(StaticStepInputs):
    """Replaces ``model(input_ids, positions, meta, kv_caches)`` for steps of up to
    ``max_tokens`` tokens and ``max_num_seqs`` requests over ``kv_caches`` (the caches the
    graphs were captured with): ``forward`` has the model's signature and result.
    ``max_seq_len``: the longest sequence a step may attend (the attention launch's key
    bound); ``max_blocks``: the block-table width. ``logits_rows`` > 0: the graphs end in
    the logits of up to that many tokens and their argmax (``logits``) instead."""

    def __init__(
        self,
        model,
        kv_caches,
        max_tokens: int,
        max_num_seqs: int,
        max_seq_len: int,
        max_blocks: int,
        device: torch.device,
        bounds_are_exact: bool,
        pool=None,
        logits_rows: int = 0,
    ):
        self.model, self.kv_caches = model, kv_caches
        self.logits_rows = logits_rows
        self.buckets = token_buckets(max_tokens)
        self.max_num_seqs, self.max_seq_len = max_num_seqs, max_seq_len
        self.bounds_are_exact = bounds_are_exact
        t, r = self.buckets[-1], max_num_seqs
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.qsl = torch.zeros(r + 1, dtype=torch.int32, device=device)
        self.qsl_cpu = torch.zeros(r + 1, dtype=torch.int32)  # the torch reference's copy (CPU tests)
        self.seq_lens = torch.zeros(r, dtype=torch.int32, device=device)
        self.ub_cpu = torch.zeros(r, dtype=torch.int32)
        self.block_table = torch.zeros(r, max_blocks, dtype=torch.int32, device=device)
        self.logits_idx = torch.zeros(max(logits_rows, 1), dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.last_greedy: torch.Tensor | None = None  # argmax of the last ``logits`` replay's rows
        self.pool = pool  # shared with the decode graphs: one step replays one graph at a time
        self.replays = 0

    def rows(self, t: int) -> int:
        """The request count bucket ``t`` is captured for (a request has at least one token)."""
        return min(self.max_num_seqs, t)

    def _meta(self, t: int) -> AttentionMetadata:
        r = self.rows(t)
        return AttentionMetadata(
            query_start_loc=self.qsl[: r + 1],
            query_start_loc_cpu=self.qsl_cpu[: r + 1],
            seq_lens=self.seq_lens[:r],
            seq_lens_upper_bound=self.ub_cpu[:r],
            block_table=self.block_table[:r],
            slot_mapping=self.slots[:t],
            positions=self.positions[:t],
            num_reqs=r,
            num_actual_tokens=t,
            max_query_len=max(t, DECODE_MAX_Q + 1),  # a bound: always the prefill-shaped launch
            max_seq_len_upper_bound=self.max_seq_len,
            bounds_are_exact=self.bounds_are_exact,
            eager=False,
        )

    def logits_rows_of(self, t: int) -> int:
        """The logits rows bucket ``t``'s graph computes (a sampled token is a step's token)."""
        return min(self.logits_rows, t)

    def static_forward(self, t: int) -> torch.Tensor:
        """The forward over the static inputs at bucket ``t`` (what a graph records): hidden
        states, or with ``logits_rows`` the logits at ``logits_idx`` (indices past ``t``,
        stale padding, read row ``t - 1``)."""
        h = self.model(self.input_ids[:t], self.positions[:t], self._meta(t), self.kv_caches)
        if not self.logits_rows:
            return h
        idx = self.logits_idx[: self.logits_rows_of(t)].clamp(max=t - 1)
        return self.model.compute_logits(h[idx])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self.slots.fill_(-1)
        self.qsl.zero_()  # every request empty: the warm-up launches compute nothing
        self.seq_lens.zero_()
        logits = bool(self.logits_rows)  # (logits and argmax back to the pool, as the decode graphs')
        for t in reversed(self.buckets):  # largest first: the pool is sized once
            g, out, greedy = capture_graph(lambda: self.static_forward(t), self.pool, logits, logits)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[t] = (g, out, greedy)
        torch.cuda.synchronize()
        logger.info(
            "captured %d mixed-step CUDA graphs in %.1f s (token buckets up to %d)",
            len(self.graphs),
            time.perf_counter() - t0,
            self.buckets[-1],
        )

    # ---------------------------------------------------------------- replay
    def fits(self, num_tokens: int) -> bool:
        return bool(self.graphs) and num_tokens <= self.buckets[-1]

    def bucket(self, num_tokens: int) -> int:
        """The token bucket a step of ``num_tokens`` replays."""
        return next(b for b in self.buckets if b >= num_tokens)

    def padding(self, num_tokens: int, num_logits: int) -> GraphPad:
        """What the input kernel of a step of ``num_tokens`` tokens and ``num_logits`` sampled
        tokens writes into these graphs' buffers (``kernels.input_prep.GraphPad``): its query
        starts, the padding to its bucket, its block table and (with ``logits_rows``, when they
        fit) its sampled-token indices; ``load`` and ``logits`` then copy none of them."""
        t = self.bucket(num_tokens)
        fits = 0 < num_logits <= self.logits_rows
        return GraphPad(self.qsl, t, self.rows(t), self.block_table, logits_dst=self.logits_idx if fits else None)

    def load(self, input_ids, positions, meta: AttentionMetadata) -> int:
        """Copies a step's inputs into the static buffers, padded (what its input kernel did
        not already build there: ``padding``); returns its bucket."""
        t_real, n = input_ids.shape[0], meta.num_reqs
        t = self.bucket(t_real)
        r = self.rows(t)
        if n > r:
            raise ValueError(f"a step of {n} requests exceeds max_num_seqs={self.max_num_seqs}")
        self._copy_in(input_ids, positions, meta.seq_lens, meta.slot_mapping[:t_real])
        if meta.query_start_loc.data_ptr() != self.qsl.data_ptr():  # else padded by the input kernel
            self.slots[t_real:t].fill_(-1)
            self.qsl[: n + 1].copy_(meta.query_start_loc)
            self.qsl[n + 1 : r + 1].fill_(t_real)  # padded requests: empty, at the real token count
            if meta.block_table.data_ptr() != self.block_table.data_ptr():
                self.block_table[:n, : meta.block_table.shape[1]].copy_(meta.block_table)
        if not self.qsl.is_cuda:  # only the torch reference (CPU) reads the CPU copies; a replay never does
            self.qsl_cpu[: n + 1] = meta.query_start_loc_cpu
            self.qsl_cpu[n + 1 : r + 1] = t_real
            self.ub_cpu[:n] = meta.seq_lens_upper_bound
            self.ub_cpu[n:r] = 0
        return t

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """The model's forward, from this step's bucket's graph: hidden states ``[T, H]`` of
        the real tokens (graphs without ``logits_rows``)."""
        assert kv_caches is self.kv_caches, "a mixed graph replays over the caches it captured"
        assert not self.logits_rows, "these graphs end in logits: use logits()"
        t = self.load(input_ids, positions, meta)
        g, hidden, _ = self.graphs[t]
        g.replay()
        self.replays += 1
        return hidden[: input_ids.shape[0]]

    def logits(self, input_ids, positions, meta: AttentionMetadata, kv_caches, logits_idx) -> torch.Tensor:
        """The step's forward from its bucket's graph: float32 logits ``[n, V]`` of the tokens
        ``logits_idx`` (device int64 ``[n]``, ``n`` may be 0) and their argmax in
        ``last_greedy``; valid until the next replay of a graph of the pool."""
        assert kv_caches is self.kv_caches, "a mixed graph replays over the caches it captured"
        t = self.load(input_ids, positions, meta)
        n = logits_idx.shape[0]
        if n > self.logits_rows_of(t):
            raise ValueError(f"{n} logits rows exceed the {self.logits_rows_of(t)} of token bucket {t}")
        if logits_idx.data_ptr() != self.logits_idx.data_ptr():  # (else the input kernel copied them)
            self.logits_idx[:n].copy_(logits_idx)
        g, logits, greedy = self.graphs[t]
        g.replay()
        self.replays += 1
        self.last_greedy = greedy[:n]
        return logits[:n]
