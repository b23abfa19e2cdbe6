"""CUDA graphs for uniform steps: every row has the same query length ``q``.

``q = 1`` is plain decode; with speculative decoding ``q = 1 + k`` is a verify
step (logits at every token) and the draft model replays ``q = 1`` and
``q = k + 2`` windows. Graphs are captured per (padded batch size,
sequence-length bucket, q). The
bucket is the ``max_seq_len_upper_bound`` the kernels are sized with; it is
only an upper bound, so a step whose bound fits a bucket replays that bucket's
graph and the kernels read the exact lengths from the device ``seq_lens``.
Padded rows write no KV (slot -1) and their logits are dropped.

A ``q = 1`` logits graph also takes the greedy argmax of its logits (``last_greedy``
after a replay): every decode step needs it (greedy rows, and the greedy fallback of
sampled ones), and inside the graph its two launches cost the host nothing.

A logits graph's outputs (logits, argmax) go back to the graph pool once it is captured:
the graph keeps writing them where they were, and the runner holds a view that does not
keep that memory allocated (``borrowed_view``), so later captures reuse it. Kept apart, the
fp32 logits of every (batch size, length bucket, q) graph held about 10 GB for the 8B shape
at its 131,072-token limit, and five times that with 3 drafts. The cost is a rule: a
graph's outputs are valid until the next replay of any graph of the pool (the mixed-step
graphs share it). The runner keeps it by construction: one graph of the target's pool
replays a step, and everything that reads its outputs (sampling, verification, the copy of
the tokens) is enqueued on the same stream before the next step's replay. The draft model
replays several graphs of its pool a step, so its graphs (``logits=False``) keep theirs.
"""

from __future__ import annotations

import logging
import time

import torch

from kernels import ops
from kernels.input_prep import GraphPad
from metadata.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


def seq_buckets(max_model_len: int) -> list[int]:
    """Length bounds to capture: powers of two from 512, then ``max_model_len``, which replaces
    the last power of two when barely above it (a draft model's positions run ``2k + 2`` past
    the target's 2,048: one bucket of 2,056, not 2,048 and 2,056, halves those captures)."""
    out, b = [], 512
    while b < max_model_len:
        out.append(b)
        b *= 2
    if out and max_model_len - out[-1] <= out[-1] // 16:
        out.pop()
    return out + [max_model_len]


def capture_shapes(sizes: list[int], buckets: list[int], query_lens: tuple[int, ...]):
    """``(b, bound, q)`` of every graph ``DecodeGraphs`` captures, in capture order: the
    longest query length and the largest batch first, so that the pool is sized by the
    first capture and the outputs a logits graph gives back fit every later one."""
    for q in sorted(query_lens, reverse=True):
        for bound in buckets:
            if bound >= q:
                for b in reversed(sizes):
                    yield b, bound, q


def decode_graph_output_bytes(
    max_num_seqs: int, max_model_len: int, query_lens: tuple[int, ...], row_bytes: int, logits: bool
) -> int:
    """Device bytes the outputs of ``DecodeGraphs`` hold for the worker's life (KV sizing
    reserves them, ``workers.memory_profile``): ``b * q`` rows of ``row_bytes`` a graph, plus
    the argmax of a ``q = 1`` logits graph. Logits graphs give their outputs back to the pool
    (module docstring), so the largest one counts; other graphs (the draft's hidden states)
    each keep their own, which grows with the length buckets, i.e. with ``max_model_len``."""
    sizes = [
        alloc_bytes(b * q * row_bytes) + (alloc_bytes(b * 8) if logits and q == 1 else 0)
        for b, _, q in capture_shapes(capture_sizes(max_num_seqs), seq_buckets(max_model_len), query_lens)
    ]
    return max(sizes, default=0) if logits else sum(sizes)


def borrowed_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated: once ``t`` is gone the
    caching allocator may hand that memory out again (for a CUDA graph's output: to later
    captures into the same pool). The caller guarantees what the view reads is still there."""
    st = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def alloc_bytes(n: int) -> int:
    """``n`` rounded up as the caching allocator rounds a block (512 bytes)."""
    return (n + 511) // 512 * 512


def capture_graph(record, pool, with_argmax: bool = False, give_back: bool = False):
    """One CUDA graph of ``record()`` into ``pool`` (None: a new pool, ``graph.pool()``), after
    a warm-up run outside capture (the kernels' JIT compiles there). ``with_argmax``: the
    graph also takes its output's argmax (Triton). ``give_back``: the outputs return to the
    pool once captured and the caller holds ``borrowed_view``s (module docstring). Returns
    ``(graph, output, argmax or None)``.

    The graph is replayed once here, over the inputs it was captured with (the warm-up's:
    harmless by construction): a graph's first launch uploads it to the device, which cost
    that step's launch about 0.35 ms of host time (H200: 368 us median against 33 us for
    later launches)."""
    warm = record()
    if with_argmax:
        ops.argmax(warm)
    del warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = record()
        greedy = ops.argmax(out) if with_argmax else None
    g.replay()
    if give_back:
        out = borrowed_view(out)
        greedy = borrowed_view(greedy) if greedy is not None else None
    return g, out, greedy


class StaticStepInputs:
    """The static inputs a captured step reads: ``input_ids``, ``positions`` (per token),
    ``seq_lens`` (per row) and ``slots`` (the slot mapping), set by the subclass. A step
    either builds its inputs straight into them (``static_inputs``) or has them copied in."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor

    def static_inputs(self, n: int, t: int) -> tuple[torch.Tensor, ...]:
        """(positions, input_ids, seq_lens, slot_mapping) of a step's ``n`` rows and ``t``
        tokens, inside the static inputs: a step that writes them there (see
        ``kernels.input_prep.prepare_inputs``'s ``out``) needs no copy before its replay."""
        return self.positions[:t], self.input_ids[:t], self.seq_lens[:n], self.slots[:t]

    def _copy_in(self, input_ids, positions, seq_lens, slots) -> None:
        """Copies a step's inputs into the static ones, except those already built there."""
        statics = (self.input_ids, self.positions, self.seq_lens, self.slots)
        for dst, src in zip(statics, (input_ids, positions, seq_lens, slots)):
            if src.data_ptr() != dst.data_ptr():
                dst[: src.shape[0]].copy_(src)


class DecodeGraphs(StaticStepInputs):
    """``logits=True``: a graph returns the logits of every token; else the hidden states."""

    def __init__(
        self,
        model,
        kv_caches,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        max_blocks: int,
        device: torch.device,
        bounds_are_exact: bool,
        query_lens: tuple[int, ...] = (1,),
        logits: bool = True,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.buckets = seq_buckets(max_model_len)
        self.block_size = block_size
        self.bounds_are_exact = bounds_are_exact
        self.query_lens = query_lens
        self.logits = logits
        b = self.sizes[-1]
        t = b * max(query_lens)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.qsl = {q: torch.arange(b + 1, dtype=torch.int32, device=device) * q for q in query_lens}
        self.qsl_cpu = {q: torch.arange(b + 1, dtype=torch.int32) * q for q in query_lens}
        self.ub_cpu = torch.ones(b, dtype=torch.int32)
        self.block_table = torch.zeros(b, max_blocks, dtype=torch.int32, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.last_greedy: torch.Tensor | None = None  # argmax of the last replay's logits (q = 1)
        self.pool = None
        self.replays = 0
        self.buckets_replayed: set[int] = set()  # length buckets of the graphs replayed (stats)
        self._warned_miss = False

    def _meta(self, b: int, bound: int, q: int) -> AttentionMetadata:
        n_blk = (bound + self.block_size - 1) // self.block_size
        return AttentionMetadata(
            query_start_loc=self.qsl[q][: b + 1],
            query_start_loc_cpu=self.qsl_cpu[q][: b + 1],
            seq_lens=self.seq_lens[:b],
            seq_lens_upper_bound=self.ub_cpu[:b],
            block_table=self.block_table[:b, :n_blk],
            slot_mapping=self.slots[: b * q],
            positions=self.positions[: b * q],
            num_reqs=b,
            num_actual_tokens=b * q,
            max_query_len=q,
            max_seq_len_upper_bound=bound,
            bounds_are_exact=self.bounds_are_exact,
            eager=False,  # captured: the tuned exact launch shapes
        )

    def static_forward(self, b: int, bound: int, q: int) -> torch.Tensor:
        """The forward over the static inputs for (``b`` rows, bound, query length ``q``): what a
        graph records."""
        h = self.model(self.input_ids[: b * q], self.positions[: b * q], self._meta(b, bound, q), self.kv_caches)
        return self.model.compute_logits(h) if self.logits else h

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self.slots.fill_(-1)
        for b, bound, q in capture_shapes(self.sizes, self.buckets, self.query_lens):
            self.seq_lens.fill_(q)
            # logits graphs give their outputs back to the pool (module docstring): later captures reuse it
            g, out, greedy = capture_graph(
                lambda: self.static_forward(b, bound, q), self.pool, self.logits and q == 1, self.logits
            )
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[(b, bound, q)] = (g, out, greedy)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs of %s in %.1f s (%d batch sizes up to %d, length buckets %s, "
            "query lengths %s)",
            len(self.graphs),
            "logits" if self.logits else "hidden states (draft model)",
            time.perf_counter() - t0,
            len(self.sizes),
            self.sizes[-1],
            self.buckets,
            self.query_lens,
        )

    def shape_for(self, n: int, bound: int) -> tuple[int | None, int | None]:
        """The captured batch size for ``n`` rows and length bucket for ``bound`` (None where
        none is large enough)."""
        b = next((s for s in self.sizes if s >= n), None)
        L = next((x for x in self.buckets if x >= bound), None)
        return b, L

    def pick_shape(self, n: int, q_lens: list[int], bound: int) -> tuple[int, int, int] | None:
        q = q_lens[0]
        if q_lens.count(q) != len(q_lens):  # (C-level: a generator costs ~0.1 us a row)
            return None
        b, L = self.shape_for(n, bound)
        if q not in self.query_lens:
            return None  # e.g. a prefill: a mixed-step graph's (workers.mixed_graphs)
        if b is None or L is None:
            if not self._warned_miss:
                self._warned_miss = True
                logger.warning(
                    "uniform step (rows %d, query length %d, bound %d) has no CUDA graph "
                    "(sizes %s, buckets %s, query lengths %s): it replays a mixed-step graph or runs eagerly",
                    n,
                    q,
                    bound,
                    self.sizes,
                    self.buckets,
                    self.query_lens,
                )
            return None
        self.replays += 1
        self.buckets_replayed.add(L)
        return (b, L, q)

    def pick_step(
        self, q_lens: list[int], num_drafts: list[int], num_sampling: int, bound: int
    ) -> tuple[int, int, int] | None:
        """A step fits when every row has the same query length and samples at every token
        (plain decode, or verification with the same draft count in every row). Host values
        only, so a step can pick its graph before its inputs are built."""
        if num_sampling != len(q_lens):
            return None
        if any(num_drafts) and any(k + 1 != q for k, q in zip(num_drafts, q_lens)):
            return None
        if not any(num_drafts) and q_lens.count(1) != len(q_lens):  # (no drafts: one token a row)
            return None
        return self.pick_shape(len(q_lens), q_lens, bound)

    def padding(self, key: tuple[int, int, int], num_reqs: int) -> GraphPad:
        """What the input kernel of a step of ``num_reqs`` rows replaying graph ``key`` writes
        into the static buffers besides its inputs (``kernels.input_prep.GraphPad``): its
        query starts into this query length's (the same values: every row has ``q`` tokens),
        its block table, and the padding up to the graph's ``b`` rows (slots -1, lengths
        ``q``); ``load`` then copies and fills nothing."""
        b, _, q = key
        return GraphPad(self.qsl[q], b * q, num_reqs, self.block_table, seq_rows=b, seq_len=q)

    def load(self, inputs, key: tuple[int, int, int]) -> None:
        """Copies a step's inputs (``input_ids``, ``positions`` and ``meta``: a ``StepInputs``
        or a ``Window``) into the static inputs of graph ``key``, padding rows past the real
        ones (no KV writes). Inputs already built in place are not copied; a step whose input
        kernel padded it (``padding``: its query starts are this graph's) needs nothing."""
        b, _, q = key
        m = inputs.meta
        n, t = m.num_reqs, m.num_actual_tokens
        self._copy_in(inputs.input_ids, inputs.positions, m.seq_lens, m.slot_mapping)
        if m.query_start_loc.data_ptr() == self.qsl[q].data_ptr():  # padded by the input kernel
            return
        if m.block_table.data_ptr() != self.block_table.data_ptr():  # (not already the static table)
            self.block_table[:n, : m.block_table.shape[1]].copy_(m.block_table)
        if b > n:
            self.slots[t : b * q].fill_(-1)
            self.seq_lens[n:b].fill_(q)

    def run(self, inputs, key: tuple[int, int, int]) -> torch.Tensor:
        """Replay; returns the outputs of the real tokens (in batch order)."""
        self.load(inputs, key)
        g, out, greedy = self.graphs[key]
        g.replay()
        n = inputs.meta.num_reqs
        self.last_greedy = greedy[:n] if greedy is not None else None
        return out[: inputs.meta.num_actual_tokens]
