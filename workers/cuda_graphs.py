"""CUDA graphs for uniform decode steps (every row: one token, sampled).

Graphs are captured per (padded batch size, sequence-length bucket). The
bucket is the ``max_seq_len_upper_bound`` the kernels are sized with; it is
only an upper bound, so a step whose bound fits a bucket replays that bucket's
graph and the kernels read the exact lengths from the device ``seq_lens``.
Padded rows write no KV (slot -1) and their logits are dropped.
"""

from __future__ import annotations

import logging

import torch

from metadata.attention_metadata import AttentionMetadata
from workers.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


def seq_buckets(max_model_len: int) -> list[int]:
    out, b = [], 512
    while b < max_model_len:
        out.append(b)
        b *= 2
    return out + [max_model_len]


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 max_blocks: int, device: torch.device, bounds_are_exact: bool):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.buckets = seq_buckets(max_model_len)
        self.block_size = block_size
        self.bounds_are_exact = bounds_are_exact
        b = self.sizes[-1]
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.qsl_cpu = torch.arange(b + 1, dtype=torch.int32)
        self.ub_cpu = torch.ones(b, dtype=torch.int32)
        self.block_table = torch.zeros(b, max_blocks, dtype=torch.int32, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _meta(self, b: int, bound: int) -> AttentionMetadata:
        n_blk = (bound + self.block_size - 1) // self.block_size
        return AttentionMetadata(
            query_start_loc=self.qsl[: b + 1], query_start_loc_cpu=self.qsl_cpu[: b + 1],
            seq_lens=self.seq_lens[:b], seq_lens_upper_bound=self.ub_cpu[:b],
            block_table=self.block_table[:b, :n_blk], slot_mapping=self.slots[:b],
            positions=self.positions[:b], num_reqs=b, num_actual_tokens=b, max_query_len=1,
            max_seq_len_upper_bound=bound, bounds_are_exact=self.bounds_are_exact,
        )

    def _forward(self, b: int, bound: int) -> torch.Tensor:
        h = self.model(self.input_ids[:b], self.positions[:b], self._meta(b, bound), self.kv_caches)
        return self.model.compute_logits(h)

    @torch.inference_mode()
    def capture(self) -> None:
        self.slots.fill_(-1)
        for bound in self.buckets:
            for b in reversed(self.sizes):
                self._forward(b, bound)  # warm-up: JIT-compile the kernels for this shape
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = self._forward(b, bound)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[(b, bound)] = (g, out)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (sizes %s, buckets %s)",
                    len(self.graphs), self.sizes, self.buckets)

    def pick(self, inputs: StepInputs) -> tuple[int, int] | None:
        if not inputs.is_uniform_decode:
            return None
        n, bound = inputs.meta.num_reqs, inputs.meta.max_seq_len_upper_bound
        b = next((s for s in self.sizes if s >= n), None)
        L = next((x for x in self.buckets if x >= bound), None)
        return None if b is None or L is None else (b, L)

    def run(self, inputs: StepInputs, key: tuple[int, int]) -> torch.Tensor:
        """Replay; returns logits of the real rows (in batch order)."""
        b, _ = key
        n = inputs.meta.num_reqs
        m = inputs.meta
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.seq_lens[:n].copy_(m.seq_lens)
        self.slots[:n].copy_(m.slot_mapping)
        self.block_table[:n, : m.block_table.shape[1]].copy_(m.block_table)
        if b > n:
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
        g, out = self.graphs[key]
        g.replay()
        return out[:n]


