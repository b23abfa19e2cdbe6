"""Persistent per-request state on the worker's device.

Each placed request owns a row. ``num_computed`` (tokens whose KV is written)
and ``token_ids`` live on the device and are advanced by the step itself, so a
token sampled at step N feeds step N+1 without visiting the host. The host only
keeps what it learned from plans: prompt lengths, block tables, sampling
parameters.
"""

from __future__ import annotations

import array
import struct
from itertools import accumulate
from typing import NamedTuple

import numpy as np
import torch

from kernels.place import Placement, place_staged
from metadata.wire import NewRequest, SamplingOptions, token_words
from workers.host_staging import staging_for


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device through pinned memory, never a blocking copy (``workers.host_staging``)."""
    if device.type == "cpu":
        return t
    return staging_for(device).copy(t)


def int64_tensor(*parts) -> torch.Tensor:
    """The ints of ``parts`` (lists or other int iterables), concatenated, as an int64 CPU
    tensor: built through an ``array.array``, about 4x faster than ``torch.tensor(list)``.
    The tensor shares the array's memory and holds a reference to it (``torch.frombuffer``);
    nothing else sees the array."""
    a = array.array("q")
    for p in parts:
        if type(p) is list:
            a.fromlist(p)  # (one resize: faster than extend)
        else:
            a.extend(p)
    if not a:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(a, dtype=torch.int64)


def has_penalties(o: SamplingOptions) -> bool:
    """Whether a request's sampling reads its output-token counts (repetition, presence or
    frequency penalty); rows without them never need the counts kept."""
    return o.repetition_penalty != 1.0 or bool(o.presence_penalty) or bool(o.frequency_penalty)


OPTION_FLOATS = 7  # temperature, top_p, min_p, repetition, presence, frequency, sampling divisor
OPTION_WORDS = OPTION_FLOATS + 3  # then top_k, seed, min_tokens
TEMPERATURE_WORD, DIVISOR_WORD, SEED_WORD = 0, OPTION_FLOATS - 1, OPTION_FLOATS + 1


_FLOATS_AS_F32 = struct.Struct(f"<{OPTION_FLOATS}f")
_FLOATS_AS_I32 = struct.Struct(f"<{OPTION_FLOATS}i")


def option_words(o: SamplingOptions) -> tuple[int, ...]:
    """One request's ``OPTION_WORDS`` int64 words (``DeviceState.option_table``'s column): the
    float options as their float32 bits, then the ints (``struct``: no numpy for a few requests)."""
    div = o.temperature if o.temperature > 0 else 1.0
    floats = (o.temperature, o.top_p, o.min_p, o.repetition_penalty, o.presence_penalty, o.frequency_penalty, div)
    return (*_FLOATS_AS_I32.unpack(_FLOATS_AS_F32.pack(*floats)), o.top_k, o.seed, o.min_tokens)


def plain_temperature(flags: dict) -> bool:
    """Whether a step's sampling reads no option but the temperature and seed (greedy or
    temperature rows only: no top-k / top-p / min-p, penalties, min_tokens, logit bias, allowed or banned ids)."""
    return not (
        flags["any_top_k_top_p"]
        or flags["any_min_p"]
        or flags["any_penalties"]
        or flags["any_min_tokens"]
        or flags["any_logit_bias"]
        or flags["any_id_rules"]
    )


def option_flags(opts: list[SamplingOptions]) -> dict:
    """The host facts sampling branches on (none of them reads the device)."""
    return dict(
        all_greedy=all(o.temperature == 0 for o in opts),
        any_top_k_top_p=any(o.top_k > 0 or o.top_p < 1.0 for o in opts),
        any_min_p=any(o.min_p > 0 for o in opts),
        max_num_logprobs=max(o.num_logprobs for o in opts),
        any_penalties=any(has_penalties(o) for o in opts),
        any_min_tokens=any(o.min_tokens > 0 and o.min_tokens_stop_ids for o in opts),
        any_logit_bias=any(o.logit_bias_ids for o in opts),
        any_id_rules=any(o.allowed_token_ids or o.banned_token_ids for o in opts),
    )


class OptionTensors:
    """The device copy of the last step's per-row sampling options, with the host flags
    derived from them. Consecutive decode steps mostly sample the same requests in the
    same order, and a request's options never change, so the same ``SamplingOptions``
    objects (compared by identity: the objects the device state holds) reuse the device
    tensors instead of building and copying them again. The tensors are only ever read."""

    def __init__(self):
        self.opts: list[SamplingOptions] = []
        self.floats: tuple[torch.Tensor, ...] | None = None  # rows of [7, R]
        self.ints: tuple[torch.Tensor, ...] | None = None  # rows of [3, R]
        self.flags: dict = {}
        self.id_rules: tuple | None = None  # (rows, their device rows, bool [n, vocab]): sampling_inputs.id_rule_masks

    def get(
        self,
        opts: list[SamplingOptions],
        dev: torch.device,
        table: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        lazy: bool = False,
    ) -> "OptionTensors":
        """The options' device rows. ``table`` (``DeviceState.option_table``) and ``rows`` (the
        requests' device rows, padded to a multiple of 4 entries): gathered from the table the
        placement wrote, with no host packing and no copy; else packed and copied. ``lazy``
        (with ``table`` and ``rows``): where only temperature sampling reads the options
        (``plain_temperature``), nothing is gathered and ``floats`` / ``ints`` stay None: the
        sampler reads the table in place."""
        same = bool(self.flags) and len(opts) == len(self.opts) and all(a is b for a, b in zip(opts, self.opts))
        if not same:
            self.opts, self.flags = list(opts), option_flags(opts)
            self.floats = self.ints = self.id_rules = None
        if self.floats is not None or (
            lazy and table is not None and rows is not None and plain_temperature(self.flags)
        ):
            return self
        r = len(opts)
        if table is not None and rows is not None:
            g = torch.index_select(table, 1, rows)  # [OPTION_WORDS, w], contiguous
            self.floats = g[:OPTION_FLOATS].to(torch.int32).view(torch.float32)[:, :r].unbind()
            self.ints = g[OPTION_FLOATS:, :r].unbind()
        else:
            # one packed copy: the float rows, then the int64 rows, each padded to a multiple of four
            # entries so that every row starts on 16 bytes whatever the batch size (Triton
            # specialises a kernel on a pointer's 16-byte alignment)
            w = -(-r // 4) * 4
            words = np.array([option_words(o) for o in opts], dtype=np.int64).reshape(r, OPTION_WORDS).T
            floats = np.zeros((OPTION_FLOATS, w), dtype=np.float32)
            floats[:, :r] = words[:OPTION_FLOATS].astype(np.int32).view(np.float32)  # (the words' float32 bits)
            ints = np.zeros((3, w), dtype=np.int64)
            ints[:, :r] = words[OPTION_FLOATS:]
            raw = np.concatenate([floats.view(np.uint8).ravel(), ints.view(np.uint8).ravel()])
            packed = to_device(torch.from_numpy(raw), dev)
            self.floats = packed[: 4 * OPTION_FLOATS * w].view(torch.float32).view(OPTION_FLOATS, w)[:, :r].unbind()
            self.ints = packed[4 * OPTION_FLOATS * w :].view(torch.int64).view(3, w)[:, :r].unbind()
        return self


class StagedPlacement(NamedTuple):
    """New requests' device writes, packed on the host (``DeviceState.stage``)."""

    words: np.ndarray  # int64: tokens, their rows, their columns, then rows, cached, prompt lengths,
    # options, then each request's prompt and output offsets among the tokens
    sizes: tuple[int, ...]  # the segments of ``words``
    num_prompt_tokens: int  # the first this-many tokens are prompt tokens
    clear: bool  # whether the rows' output counts and prompt masks are cleared first (penalties)
    rows: list[int]  # the requests' device rows (host)


class DeviceState:
    def __init__(self, max_rows: int, max_model_len: int, max_blocks: int, vocab: int, device: torch.device):
        self.device = device
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.vocab = vocab
        self.token_ids = torch.zeros(max_rows, max_model_len + 1, dtype=torch.int64, device=device)
        self.num_computed = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.prompt_len = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.block_table_cpu = torch.zeros(max_rows, max_blocks, dtype=torch.int32)
        self.num_blocks_cpu = [0] * max_rows
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.sampling: list[SamplingOptions | None] = [None] * max_rows
        # penalty inputs: output token counts and prompt-token presence per row
        self.output_counts = torch.zeros(max_rows, vocab, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(max_rows, vocab, dtype=torch.bool, device=device)
        self.draft_probs: torch.Tensor | None = None  # [max_rows, K, V], allocated on first use
        self.option_tensors = OptionTensors()  # the sampling options' device tensors, reused
        # each row's sampling options as int64 words (the floats' float32 bits), written when a
        # request is placed: a step gathers its rows' instead of packing and copying them
        self.option_table = torch.zeros(OPTION_WORDS, max_rows, dtype=torch.int64, device=device)
        # the word rows the temperature sampler reads in place (kernels.sample_logits' option_rows)
        self.sampler_words = tuple(self.option_table[w] for w in (DIVISOR_WORD, TEMPERATURE_WORD, SEED_WORD))
        self.true_value = torch.ones((), dtype=torch.bool, device=device)  # an index_put_ value (device: no copy)
        self._columns = array.array("q", range(max_model_len + 1))  # (``stage``'s token columns)

    def ensure_draft_probs(self, k: int) -> torch.Tensor:
        """Draft-model distributions of the drafts in flight (sampled rows need them to verify)."""
        if self.draft_probs is None or self.draft_probs.shape[1] < k:
            self.draft_probs = torch.zeros(self.max_rows, k, self.vocab, dtype=torch.float32, device=self.device)
        return self.draft_probs

    def write_host_drafts(self, items: list[tuple[int, int, list[int]]]) -> None:
        """Host-proposed drafts (``ngram_host``, exact lengths) go where the step reads its
        inputs: ``(row, start column, drafts)`` per row, in one packed copy and one indexed
        write whatever the row count (none past the table's last column)."""
        toks, rows, cols = [], [], []
        width = self.token_ids.shape[1]
        for row, start, drafts in items:
            n = max(0, min(len(drafts), width - start))
            toks += drafts[:n]
            rows += [row] * n
            cols += range(start, start + n)
        if toks:
            d = to_device(int64_tensor(toks, rows, cols).view(3, -1), self.device)
            self.token_ids.index_put_((d[1], d[2]), d[0])

    # ----------------------------------------------------------- lifecycle
    def add(self, req: NewRequest) -> None:
        self.add_many([req])

    def _validate(self, reqs: list[NewRequest]) -> None:
        """Raise what placing ``reqs`` one by one with ``add`` would, before anything is placed."""
        seen: set[int] = set()
        for i, req in enumerate(reqs):
            if req.handle in self.row_of or req.handle in seen:
                raise RuntimeError(f"request handle {req.handle} is already placed")
            if i >= len(self.free_rows):
                raise RuntimeError("no free request rows on the worker (max_num_seqs exceeded)")
            if len(req.prompt_words) % 8 or len(req.output_words) % 8:
                raise RuntimeError(f"request {req.handle}: token ids are not int64 words (metadata.wire.token_bytes)")
            n_tok = req.num_prompt_tokens + req.num_output_tokens
            if n_tok > self.max_model_len:
                raise RuntimeError(f"request {req.handle} has {n_tok} tokens > max_model_len")
            if len(req.block_ids) > self.block_table_cpu.shape[1]:
                raise RuntimeError("block table overflow: more blocks than max_model_len needs")
            seen.add(req.handle)

    def add_many(self, reqs: list[NewRequest]) -> None:
        """Place new requests with a fixed number of device operations, whatever their number:
        one packed host->device copy and a few indexed writes. All are validated first, so
        an invalid one places none; rows are taken as ``add`` one by one would take them."""
        staged = self.stage(reqs)
        if staged is not None:
            self.place(staged, to_device(torch.from_numpy(staged.words), self.device))

    def stage(self, reqs: list[NewRequest]) -> "StagedPlacement | None":
        """``add_many``'s host half: validates ``reqs``, takes their rows and writes the host
        state (rows, options, block tables); returns their device writes packed in one int64
        array, for ``place`` once it is on the device (a step's inputs carry it in their own
        copy: ``workers.step_inputs.build_window``). None for no request."""
        if not reqs:
            return None
        self._validate(reqs)
        rows = [self.free_rows.pop() for _ in reqs]
        b_ids, b_row, b_col = [], [], []
        for row, req in zip(rows, reqs):
            self.row_of[req.handle] = row
            self.sampling[row] = req.sampling
            nb = len(req.block_ids)
            b_ids += req.block_ids
            b_row += [row] * nb
            b_col += range(nb)
            self.num_blocks_cpu[row] = nb
        if b_ids:  # host block tables: one indexed write (numpy: torch's CPU ops cost more here)
            self.block_table_cpu.numpy()[b_row, b_col] = b_ids
        # every prompt token, then every output token, then their rows, then their columns,
        # then per request: row, cached tokens, prompt length, option words. Built in one
        # ``array`` by C-level extends (numpy's small-array calls cost 5-10 us each on a GPU
        # host, and torch CPU ops more)
        plen = [req.num_prompt_tokens for req in reqs]
        olen = [req.num_output_tokens for req in reqs]
        # (the ids arrive as int64 words: one copy each, no Python int a token)
        a = token_words(*(req.prompt_words for req in reqs), *(req.output_words for req in reqs))
        t, tp = len(a), sum(plen)
        one = array.array("q", [0])
        for lens in (plen, olen):  # the prompt tokens' rows, then the output tokens'
            for row, n_tok in zip(rows, lens):
                one[0] = row
                a.extend(one * n_tok)
        cols = self._columns  # 0, 1, ...: a request's columns are a slice (a memcpy)
        for n_p in plen:
            a.extend(cols[:n_p])
        for n_p, n_o in zip(plen, olen):
            a.extend(cols[n_p : n_p + n_o])
        a.fromlist(rows)
        a.fromlist([req.num_cached_tokens for req in reqs])
        a.fromlist(plen)
        for req in reqs:  # request-major
            a.extend(option_words(req.sampling))
        a.fromlist([0, *accumulate(plen)][:-1])  # (where each request's prompt and outputs start)
        a.fromlist([0, *accumulate(olen)][:-1])
        n = len(reqs)
        return StagedPlacement(
            words=np.frombuffer(a, dtype=np.int64),
            sizes=(t, t, t, n, n, n, OPTION_WORDS * n, n, n),
            rows=rows,
            num_prompt_tokens=tp,
            # only penalties read the counts and the prompt mask, and a row without penalties
            # is unchanged by any stale ones (repetition 1, presence and frequency 0)
            clear=any(has_penalties(req.sampling) for req in reqs),
        )

    def place(self, staged: "StagedPlacement", dev: torch.Tensor) -> None:
        """``add_many``'s device half: ``staged.words`` on the device (``dev``) written into the
        state. A placement with no penalty request skips the two whole-row clears."""
        place_staged(self.placement(staged, dev), self.token_ids, self.num_computed)

    def placement(self, staged: "StagedPlacement", dev: torch.Tensor, new_j: torch.Tensor | None = None) -> Placement:
        """``place`` left to the input kernel's launch (``kernels.place.Placement``): the rows'
        clears now (penalties only), the rest by that launch. ``new_j``: each of the step's
        requests' index among the staged ones (-1: placed before; None for ``place``)."""
        t, n = staged.sizes[0], staged.sizes[3]
        if staged.clear:  # stale rows cleared, then this placement's writes (one launch on CUDA;
            # outputs to recompute after preemption are counted, repeated tokens accumulating)
            rows = dev[3 * t : 3 * t + n]
            self.output_counts.index_fill_(0, rows, 0)
            self.prompt_mask.index_fill_(0, rows, False)
        return Placement(
            dev, new_j, t, staged.num_prompt_tokens, n,
            self.prompt_len, self.prompt_mask, self.output_counts, self.option_table,
        )  # fmt: skip

    def release(self, handle: int) -> None:
        row = self.row_of.pop(handle, None)
        if row is None:
            return
        self.sampling[row] = None
        self.free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = self.num_blocks_cpu[row]
        if n + len(block_ids) > self.block_table_cpu.shape[1]:
            raise RuntimeError("block table overflow: more blocks than max_model_len needs")
        self.block_table_cpu.numpy()[row, n : n + len(block_ids)] = block_ids  # (numpy: no torch CPU op)
        self.num_blocks_cpu[row] = n + len(block_ids)
