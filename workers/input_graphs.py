"""The input kernel of graph steps, captured once per padded shape.

A step that replays a decode graph (one token a row) or a mixed-step graph builds its
inputs with ``kernels.input_prep``'s kernel, whose Triton launch cost the host more than
the graph replay after it. Here that kernel reads the step from a header in its staged
words (``kernels.input_header``), copied into one fixed device buffer, the *stage*, so its
launch is the same every step of a padded shape and is captured in a CUDA graph: a step's
inputs are one copy into the stage and one replay (``workers.step_inputs.build_window``).

The stage is reused every step. That is safe by stream order: everything that reads a
step's staged words (its input graph, its forward, its sampling, the placement of new
requests that do not fit the graph) is enqueued on the device's stream before the next
step's copy into the stage. So only steps whose every reader runs in their own launch use
it: no speculative decoding (the draft model's windows), no pipeline stages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import torch

from kernels.input_header import HEADER_WORDS, commit_lengths_from_header, prepare_inputs_from_header
from workers.cuda_graphs import capture_graph
from workers.host_staging import staging_for

logger = logging.getLogger(__name__)

BLOCK = 256  # tokens an input program covers
PLACE_TOKENS = 4096  # staged tokens a mixed graph's launch places at least (more: placed before it)


@dataclass(frozen=True)
class InputShape:
    """What a step of one input graph must match: its padded token count, for a mixed graph
    how many staged tokens its launch can place (0: it places none), and whether the input
    kernel sets the rows' lengths (one token a row; else a second kernel of the graph does:
    after any input graph the step's ``num_computed`` hold its new lengths)."""

    pad_tokens: int
    place_tokens: int
    commit_lengths: bool


def stage_words(max_num_seqs: int, max_blocks: int, logits_rows: int, option_words: int, place_tokens: int) -> int:
    """Words the stage holds: the header, a step's per-row segments (each rounded up to an
    even count), its block table (``max_blocks`` int32 a row) and the placement of up to
    ``place_tokens`` tokens of up to ``max_num_seqs`` requests."""
    n = max_num_seqs + 4
    rows = 10 * n + logits_rows + 2
    table = max_num_seqs * (max_blocks // 2 + 1)
    place = 3 * place_tokens + (5 + option_words) * n + 4
    return HEADER_WORDS + rows + table + place


def place_tokens(bucket: int) -> int:
    """Staged tokens the input graph of a mixed graph's token bucket places: its bucket, and at
    least ``PLACE_TOKENS`` (a new request's prompt may be longer than its first chunk)."""
    return max(bucket, PLACE_TOKENS)


def builds_input_graphs(runner) -> bool:
    """Whether a runner that captures graphs captures input graphs too: not with speculative
    decoding (a draft model's windows read a step's staged words: the module docstring)."""
    return runner.spec is None


def input_stage_words(max_num_seqs: int, max_blocks: int, logits_rows: int, max_tokens: int) -> int:
    """``stage_words`` of a runner's input graphs (``build_input_graphs``; ``max_tokens``: the
    top mixed-graph bucket)."""
    from workers.device_state import OPTION_WORDS

    rows = max(logits_rows, max_num_seqs)
    return stage_words(max_num_seqs, max_blocks, rows, OPTION_WORDS, place_tokens(max_tokens))


class InputGraphs:
    """Input-kernel launches by key (``("decode", b)``, ``("mixed", t)``), each over the
    stage (see the module docstring), captured as CUDA graphs on a GPU (``capture``) and
    launched directly elsewhere (the interpreter's tests)."""

    def __init__(self, st, block_size: int, capacity_words: int, device: torch.device):
        self.st = st
        self.block_size = block_size
        self.stage = torch.zeros(capacity_words, dtype=torch.int64, device=device)
        self.shapes: dict[tuple, InputShape] = {}
        self._launch: dict[tuple, partial] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def add(
        self,
        key: tuple,
        pad_tokens: int,
        out: tuple,
        qsl_out: torch.Tensor,
        block_table_dst: torch.Tensor,
        logits_dst: torch.Tensor | None = None,
        place: int = 0,
        commit_lengths: bool = False,
    ) -> None:
        """Registers the launch of one padded shape: ``out`` (positions, input_ids, seq_lens,
        slots), ``qsl_out``, ``block_table_dst`` and ``logits_dst`` are its graph's static
        buffers (whole: the kernel writes from their start); ``place``: new requests of up to
        that many staged tokens too.
        Without ``commit_lengths`` a second kernel sets the rows' lengths after it."""
        st = self.st
        state = (st.prompt_len, st.prompt_mask, st.output_counts, st.option_table) if place else None
        self.shapes[key] = InputShape(pad_tokens, place, commit_lengths)
        inputs = partial(
            prepare_inputs_from_header,
            self.stage,
            -(-pad_tokens // BLOCK),
            1 + -(-place // BLOCK) if place else 0,
            st.token_ids,
            st.num_computed,
            out,
            qsl_out,
            self.block_size,
            block_table_dst=block_table_dst,
            logits_dst=logits_dst,
            place_state=state,
            commit_lengths=commit_lengths,
            block=BLOCK,
        )
        if commit_lengths:
            self._launch[key] = inputs
        else:
            commit = partial(commit_lengths_from_header, self.stage, out[2], st.num_computed)
            self._launch[key] = lambda: (inputs(), commit())

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per registered shape. The warm-up launch and the capture's upload replay
        run over a zero header: no token, no request, no padding (nothing is written)."""
        t0 = time.perf_counter()
        self.stage[:HEADER_WORDS].zero_()
        pool = None  # (one pool for all: they allocate nothing)
        for key, launch in self._launch.items():
            g, _, _ = capture_graph(launch, pool)  # (its warm-up launch compiles the variant)
            pool = g.pool()
            self.graphs[key] = g
        torch.cuda.synchronize()
        logger.info("captured %d input-kernel CUDA graphs in %.2f s", len(self.graphs), time.perf_counter() - t0)

    def load(self, words: torch.Tensor) -> torch.Tensor:
        """``words`` (int64, CPU: a header and the step's segments) copied into the stage; returns
        the stage's view of them."""
        dst = self.stage[: words.shape[0]]
        if self.stage.is_cuda:
            staging_for(self.stage.device).copy_into(words, dst)
        else:
            dst.copy_(words)
        return dst

    def run(self, key: tuple) -> None:
        """The input kernel of shape ``key`` over the stage's step: its graph's replay, or the
        launch itself where nothing was captured."""
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
        else:
            self._launch[key]()
        self.replays += 1


def build_input_graphs(st, block_size: int, decode, mixed, max_num_seqs: int, max_blocks: int, device):
    """The input graphs of a runner's decode graphs (one-token rows: they commit the rows'
    lengths) and mixed-step graphs (they place new requests), over one stage; not captured."""
    logits_rows = mixed.logits_rows if mixed is not None else 0
    top = mixed.buckets[-1] if mixed is not None else 0
    ig = InputGraphs(st, block_size, input_stage_words(max_num_seqs, max_blocks, logits_rows, top), device)
    if decode is not None and 1 in decode.query_lens:
        for b in decode.sizes:
            outs = (decode.positions, decode.input_ids, decode.seq_lens, decode.slots)
            ig.add(("decode", b), b, outs, decode.qsl[1], decode.block_table, commit_lengths=True)
    if mixed is not None:
        for t in mixed.buckets:
            outs = (mixed.positions, mixed.input_ids, mixed.seq_lens, mixed.slots)
            logits_dst = mixed.logits_idx if mixed.logits_rows else None
            ig.add(("mixed", t), t, outs, mixed.qsl, mixed.block_table, logits_dst, place=place_tokens(t))
    return ig
