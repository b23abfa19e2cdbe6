"""Worker-side micro-batches ("ubatches"): split a large step in two and overlap them.

When a step's token count passes ``parallel.ubatch_token_threshold``, the worker
(never the driver) splits the batch by token count at ``num_tokens // 2``; the
request at the cut straddles both halves. Each half gets its own
``AttentionMetadata`` sliced from the step's: query starts rebased to the slice,
and for the straddling request in the first half, device ``seq_lens`` and CPU
``seq_lens_upper_bound`` reduced by the tokens that fall in the second half. The
adjusted vectors are clones; the step's metadata is never mutated. The second
half's part of that request sees the first half's keys because, layer by layer,
the first half writes its KV before the second half attends.

Every rank decides the same way: the decision is a function of the plan's token
count (identical bytes on every rank) and the engine config, with no collective.

With tensor parallelism the two halves run as two host threads taking strict
turns: a half launches its all-reduce asynchronously and hands the turn to the
other half, whose compute then overlaps that communication; it waits for its
collective only when the turn comes back. Collectives are therefore issued in
the same order on every rank (A0, B0, A1, B1, ...), which the process group
requires. Without tensor parallelism there is nothing to overlap and the halves
run one after the other.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import threading

import torch

from metadata.attention_metadata import AttentionMetadata
from workers.distributed import TPGroup, set_overlap_turn


def should_split(num_tokens: int, threshold: int | None) -> bool:
    return threshold is not None and num_tokens > threshold and num_tokens >= 2


def split_point(num_tokens: int) -> int:
    """The token index where the second micro-batch starts (by token count)."""
    return num_tokens // 2


def slice_metadata(
    meta: AttentionMetadata, tok_lo: int, tok_hi: int, block_size: int | None = None
) -> AttentionMetadata:
    """Metadata for tokens ``[tok_lo, tok_hi)`` of ``meta``'s batch, equal to building it
    directly for that slice. ``block_size`` narrows the block table to the slice's bound."""
    if not 0 <= tok_lo < tok_hi <= meta.num_actual_tokens:
        raise ValueError(f"bad token slice [{tok_lo}, {tok_hi}) of {meta.num_actual_tokens} tokens")
    starts = meta.query_start_loc_cpu.tolist()  # CPU, known at schedule time
    r_lo = bisect.bisect_right(starts, tok_lo) - 1  # the request holding token tok_lo
    r_hi = bisect.bisect_left(starts, tok_hi) - 1  # the request holding token tok_hi - 1
    n = tok_hi - tok_lo
    cut_after = starts[r_hi + 1] - tok_hi  # tokens of the last request beyond this slice
    qsl_cpu = (meta.query_start_loc_cpu[r_lo : r_hi + 2] - tok_lo).clamp(0, n)
    qsl = (meta.query_start_loc[r_lo : r_hi + 2] - tok_lo).clamp(0, n)  # device op, no sync
    seq_lens = meta.seq_lens[r_lo : r_hi + 1].clone()
    upper = meta.seq_lens_upper_bound[r_lo : r_hi + 1].clone()
    if cut_after:  # the straddling request's KV ends where this slice ends
        seq_lens[-1:].sub_(cut_after)
        upper[-1:].sub_(cut_after)
    max_ub = int(upper.max())
    block_table = meta.block_table[r_lo : r_hi + 1]
    if block_size is not None:
        block_table = block_table[:, : (max_ub + block_size - 1) // block_size]
    return AttentionMetadata(
        query_start_loc=qsl.to(meta.query_start_loc.dtype),
        query_start_loc_cpu=qsl_cpu.to(meta.query_start_loc_cpu.dtype),
        seq_lens=seq_lens,
        seq_lens_upper_bound=upper,
        block_table=block_table,
        slot_mapping=meta.slot_mapping[tok_lo:tok_hi],
        positions=meta.positions[tok_lo:tok_hi],
        num_reqs=r_hi - r_lo + 1,
        num_actual_tokens=n,
        max_query_len=int((qsl_cpu[1:] - qsl_cpu[:-1]).max()),
        max_seq_len_upper_bound=max_ub,
        bounds_are_exact=meta.bounds_are_exact,
        eager=meta.eager,
    )


def split_metadata(meta: AttentionMetadata, block_size: int | None = None) -> tuple[int, list[AttentionMetadata]]:
    s = split_point(meta.num_actual_tokens)
    return s, [slice_metadata(meta, 0, s, block_size), slice_metadata(meta, s, meta.num_actual_tokens, block_size)]


class _Turns:
    """Two micro-batches take strict turns on the host; exactly one issues device work."""

    def __init__(self):
        self.cv = threading.Condition()
        self.current = 0
        self.done = [False, False]

    def wait_turn(self, i: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.current == i)

    def pass_turn(self, i: int) -> None:
        with self.cv:
            if self.done[1 - i]:
                return  # the other half has finished: keep going
            self.current = 1 - i
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.current == i)

    def finish(self, i: int) -> None:
        with self.cv:
            self.done[i] = True
            self.current = 1 - i
            self.cv.notify_all()


class _Turn:
    def __init__(self, turns: _Turns, i: int):
        self.turns, self.i = turns, i

    def yield_turn(self) -> None:
        self.turns.pass_turn(self.i)


def _thread_context():
    """The caller's per-thread state that a helper thread must re-enter."""
    from workers import sync_check

    armed = getattr(sync_check._local, "armed", None)
    inference = torch.is_inference_mode_enabled()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = (torch.cuda.current_device(), torch.cuda.current_stream())

    @contextlib.contextmanager
    def enter():
        with contextlib.ExitStack() as stack:
            if inference:
                stack.enter_context(torch.inference_mode())
            if cuda is not None:
                torch.cuda.set_device(cuda[0])
                stack.enter_context(torch.cuda.stream(cuda[1]))
            if armed is not None:
                stack.enter_context(armed.armed())
            yield

    return enter


class UbatchedModel:
    """Wraps the model's forward: steps over ``threshold`` tokens run as two micro-batches.

    Every other attribute (``layers``, ``compute_logits``, ...) is the wrapped model's.
    """

    def __init__(self, model, threshold: int, tp: TPGroup):
        if threshold < 1:
            raise ValueError(f"ubatch_token_threshold must be >= 1, got {threshold}")
        self.model = model
        self.threshold = threshold
        self.tp = tp
        self.num_split_steps = 0
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __call__(self, input_ids, positions, meta: AttentionMetadata, kv_caches, intermediate=None):
        """``intermediate``: a pipeline stage's ``(hidden, residual)`` input, split like the
        tokens; a stage before the last returns such a pair, concatenated back."""
        if not should_split(meta.num_actual_tokens, self.threshold):
            return self._forward(input_ids, positions, meta, kv_caches, intermediate)
        block_size = kv_caches[0][0].shape[1] if kv_caches else None
        s, metas = split_metadata(meta, block_size)
        halves = (
            [None, None]
            if intermediate is None
            else [tuple(t[:s] for t in intermediate), tuple(t[s:] for t in intermediate)]
        )
        parts = [
            (input_ids[:s], positions[:s], metas[0], halves[0]),
            (input_ids[s:], positions[s:], metas[1], halves[1]),
        ]
        self.num_split_steps += 1
        if self.tp.size == 1:
            outs = [self._forward(ids, pos, m, kv_caches, mid) for ids, pos, m, mid in parts]
        else:
            outs = self._overlapped(parts, kv_caches)
        if isinstance(outs[0], tuple):  # (hidden, residual) for the next stage
            return tuple(torch.cat(pair, dim=0) for pair in zip(*outs))
        return torch.cat(outs, dim=0)

    def _forward(self, ids, pos, meta, kv_caches, intermediate):
        if intermediate is None:  # the first stage, or no pipeline
            return self.model(ids, pos, meta, kv_caches)
        return self.model(ids, pos, meta, kv_caches, intermediate)

    def _overlapped(self, parts, kv_caches) -> list[torch.Tensor]:
        if self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ubatch")
        turns, outs, errors = _Turns(), [None, None], [None, None]
        enter = _thread_context()

        def body(i: int) -> None:
            turns.wait_turn(i)
            set_overlap_turn(_Turn(turns, i))
            try:
                ids, pos, m, mid = parts[i]
                outs[i] = self._forward(ids, pos, m, kv_caches, mid)
            except BaseException as exc:  # re-raised by the caller below
                errors[i] = exc
            finally:
                set_overlap_turn(None)
                turns.finish(i)

        def helper_body() -> None:
            with enter():
                body(1)

        fut = self._helper.submit(helper_body)
        body(0)
        fut.result()
        for e in errors:
            if e is not None:
                raise e
        return outs
