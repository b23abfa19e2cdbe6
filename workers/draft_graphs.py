"""The draft model's whole proposal for a uniform step as one CUDA graph.

A draft-model proposal is pass A (each row's window of the step's tokens plus its newest
sampled token, through the draft), the first draft from pass A's logits at the row's last
*known* token (a device index: it depends on how many drafts were accepted), then ``k - 1``
one-token lookahead passes, each with its sampling and next-inputs kernels. Launched piece by
piece that was about 25 kernel launches, 3 graph launches and 6 copies a step on top of the
target's (H100, 5473122), and the Python between them.

When every row samples, every window has the captured length ``k + 2`` (after padding) and
no row uses top-k / top-p / min-p, all of it depends only on device values and on the padded
row count and the length bucket: one graph per (rows, bucket) records it. Its inputs are the
draft decode graphs' static buffers (the window is built straight into them; pass A and the
lookahead passes use them in turn) plus, per row, its known length, KV capacity, device row,
position, seed and temperature. A padded row (past the real ones) is known past the token
table's last column, so its drafts are never written, has temperature 0, so no distribution
is stored, and starts at position 0 with capacity 0, so it writes no KV (and attends at most
k - 1 keys).
"""

from __future__ import annotations

import logging

import torch

from kernels.spec_ops import draft_sample, draft_step_inputs
from workers.cuda_graphs import capture_graph, capture_shapes

logger = logging.getLogger(__name__)


class ProposeGraphs:
    """Graphs of ``proposer``'s (a ``DraftModelProposer``) uniform proposals over ``decode``
    (its ``DecodeGraphs``, capturing query lengths 1 and ``k + 2``), writing drafts into
    ``token_ids`` and sampled rows' distributions into ``draft_probs`` (both fixed tensors)."""

    def __init__(self, proposer, decode, token_ids: torch.Tensor, draft_probs: torch.Tensor):
        self.proposer, self.decode, self.window_len = proposer, decode, proposer.k + 2
        if not {1, self.window_len} <= set(decode.query_lens):
            need = f"need 1 and {self.window_len}"
            raise ValueError(f"the draft decode graphs capture query lengths {decode.query_lens}, {need}")
        self.token_ids, self.draft_probs = token_ids, draft_probs
        max_rows, dev = decode.sizes[-1], token_ids.device
        self.unused_col = token_ids.shape[1]  # a padded row's "known": every draft column past the table
        # per row: known length, KV capacity, device row, seed, next position (int64); pad values
        self.row_values = torch.zeros(5, max_rows, dtype=torch.int64, device=dev)
        self.pad = torch.zeros_like(self.row_values)
        self.pad[0] = self.unused_col
        self.temperature = torch.zeros(max_rows, dtype=torch.float32, device=dev)
        self.window_start = torch.arange(max_rows, dtype=torch.int64, device=dev) * self.window_len
        self.graphs: dict[tuple[int, int], object] = {}  # (rows, bucket) -> a CUDAGraph (its replay)
        self.replays = 0

    def key(self, n: int, bound: int) -> tuple[int, int] | None:
        """The captured (rows, bucket) for ``n`` rows whose passes attend at most ``bound``
        keys, or None."""
        b, L = self.decode.shape_for(n, bound)
        return (b, L) if b is not None and L is not None and (b, L) in self.graphs else None

    def static_propose(self, b: int, bound: int) -> None:
        """The proposal over the static inputs (what a graph records)."""
        p, d, q = self.proposer, self.decode, self.window_len
        known, cap, rows, seeds, start_pos = self.row_values[:, :b]
        temperature = self.temperature[:b]
        hidden = d.static_forward(b, bound, q)  # pass A over the windows
        starts = d.seq_lens[:b] - q  # each window's first position (before the passes rewrite it)
        last = self.window_start[:b] + (known - 1 - starts).clamp(0, q - 1)  # (padded rows: any)
        logits = p.model.compute_logits(hidden[last])
        pos = start_pos.clone()  # the position the next draft takes (advanced by each pass)
        table = d.block_table[:b, : (bound + p.block_size - 1) // p.block_size]
        for i in range(p.k):
            tok = draft_sample(logits, temperature, seeds, pos, self.draft_probs, rows, i, self.token_ids, known)
            if i == p.k - 1:
                break
            draft_step_inputs(tok, pos, table, cap, p.block_size, p.max_position, d.static_inputs(b, b))
            logits = p.model.compute_logits(d.static_forward(b, bound, 1))

    @torch.inference_mode()
    def capture(self) -> None:
        d = self.decode
        self.row_values.copy_(self.pad)
        self.temperature.zero_()
        d.slots.fill_(-1)
        d.seq_lens.fill_(self.window_len)
        for b, bound, _ in capture_shapes(d.sizes, d.buckets, (self.window_len,)):
            self.graphs[(b, bound)] = capture_graph(lambda: self.static_propose(b, bound), d.pool)[0]
        torch.cuda.synchronize()
        logger.info("captured %d draft proposal CUDA graphs", len(self.graphs))

    def run(self, window, key: tuple[int, int], known, capacity, rows, seeds, temperature) -> None:
        """Loads a step's window (built into the decode graphs' static inputs, or copied there)
        and its rows' values, then replays graph ``key``."""
        b, bound = key
        n = window.meta.num_reqs
        self.decode.load(window, (b, bound, self.window_len))
        for dst, src in zip(self.row_values, (known, capacity, rows, seeds, known)):
            dst[:n].copy_(src)
        self.temperature[:n].copy_(temperature)
        if b > n:
            self.row_values[:, n:b].copy_(self.pad[:, n:b])
            self.temperature[n:b].zero_()
        self.graphs[key].replay()
        self.replays += 1
