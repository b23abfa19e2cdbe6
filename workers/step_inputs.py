"""Builds one step's device inputs and ``AttentionMetadata`` from a plan.

Everything the host contributes is known at schedule time (rows, query
lengths, upper bounds, block ids, draft counts) and travels in one pinned,
non-blocking copy. Positions, input ids, ``seq_lens`` and the slot mapping are
derived on the device from the persistent ``num_computed`` counters, so they
stay exact even when the host only holds bounds.

With speculative decoding a sampling row carrying ``k`` drafts needs logits at
its last ``k + 1`` tokens; the indices into those logits are host-known too.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from kernels.input_header import HEADER_WORDS, header_words
from kernels.input_prep import prepare_inputs
from metadata.attention_metadata import AttentionMetadata
from metadata.wire import SamplingOptions, StepPlan
from workers.device_state import DeviceState, StagedPlacement, int64_tensor, to_device

_PAD = [0]  # one int64 word: rounds an odd-length segment up to 16 bytes


@dataclass
class Window:
    """Device inputs of one forward over per-row token windows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    block_table: torch.Tensor  # device [num_reqs, n_blk]
    capacity: torch.Tensor  # device int64 [num_reqs]: positions the row's blocks can hold
    lengths_committed: bool = False  # the rows' num_computed hold their new lengths (set on the device)


def build_window(
    st: DeviceState,
    rows: torch.Tensor | None,
    rows_cpu: list[int],
    q_lens: list[int],
    ubs: list[int],
    starts: torch.Tensor | None,
    block_size: int,
    bounds_are_exact: bool,
    block_table: torch.Tensor | None = None,
    capacity: torch.Tensor | None = None,
    packed_extra: list[list[int]] | None = None,
    out: tuple | None = None,
    table_blocks: int | None = None,
    graph_pad: tuple | None = None,
    placement: StagedPlacement | None = None,
    commit_lengths: bool = False,
    input_graph: tuple | None = None,
) -> tuple[Window, list[torch.Tensor], torch.Tensor]:
    """Row ``r`` covers positions ``starts[r] .. starts[r] + q_lens[r] - 1`` (``starts`` on the
    device); ``ubs[r]`` bounds its KV length after the window. Slots outside the row's
    allocated blocks are -1 (skipped), so lookahead writes can never touch another row's KV.

    Everything host-made travels in ONE pinned copy (each copy costs the host tens of us):
    the window's lengths and query starts (nothing per token), ``packed_extra`` (returned
    on the device), the block table when not given (its int32 rows reinterpreted as int64
    words, so no cast kernel), and the device ``rows`` when given as None. ``starts`` None:
    the rows' ``num_computed``, read by the input kernel itself.
    ``out``: where to write positions, input ids, ``seq_lens`` and the slot mapping (a
    CUDA graph's static inputs); ``graph_pad``: a ``kernels.input_prep.GraphPad`` of a mixed-step
    graph's bucket, which the input kernel pads the step to; with its ``logits_dst``, the
    first extra (the sampled-token indices) is copied there by the kernel too.
    ``placement``: new requests staged by ``DeviceState.stage``, carried in the same copy and
    placed by the input kernel's launch (``DeviceState.placement``; before it, by
    ``DeviceState.place``, where ``starts`` are given or ``commit_lengths`` is on).
    ``commit_lengths`` (one token a row, ``starts`` None): the input kernel also sets each
    row's ``num_computed`` to its new length. ``table_blocks``: the packed block table's width (default:
    the blocks of the largest bound; a lookahead needs more). ``input_graph``: (a
    ``workers.input_graphs.InputGraphs``, the key of the step's shape), for a graph step
    (``out`` and ``graph_pad`` given, everything host-made staged): its words go into the
    fixed stage behind a header and the captured input kernel reads them there; a step that
    does not fit the stage takes the launch. Returns the window (its ``block_table`` on
    the device), the extras and the device rows."""
    dev, bs = st.device, block_size
    n_reqs = len(rows_cpu)
    shape = None
    if input_graph is not None:
        shape = input_graph[0].shapes[input_graph[1]]
        if shape.commit_lengths != commit_lengths or graph_pad is None or graph_pad.tokens != shape.pad_tokens:
            raise ValueError(f"build_window: the step does not match input graph {input_graph[1]}")
        if starts is not None or rows is not None or capacity is not None or block_table is not None:
            raise ValueError("build_window: an input graph's step stages its rows, capacities and table")
    # host ints as lists (each torch op on small CPU tensors costs more than the Python)
    qsl = [0, *accumulate(q_lens)]
    n_tokens = qsl[-1]
    max_ub = max(ubs)
    # the query starts, not per-token lists: the input kernel finds each token's request
    lists = [q_lens, qsl]
    if capacity is None:
        lists.append([st.num_blocks_cpu[r] * bs for r in rows_cpu])
    # new requests are placed by the input kernel's own launch (where it reads the rows'
    # starts): each step request's index among them rides along
    fold = placement is not None and starts is None and not commit_lengths
    if shape is not None:  # (more tokens than the input graph's launch places: placed before it)
        fold = fold and placement.sizes[0] <= shape.place_tokens
    if fold:
        j_of = {row: j for j, row in enumerate(placement.rows)}
        lists.append([j_of.get(r, -1) for r in rows_cpu])
    extra = list(packed_extra or [])
    n_own, n_extra = len(lists), len(extra)
    if rows is None:
        extra.append(rows_cpu)
    # every segment starts on a 16-byte boundary (an even count of int64 words): Triton
    # specialises a kernel on each pointer's 16-byte alignment, so segments whose offsets
    # followed the batch's parity compiled new kernel variants mid-serving
    chunks, sizes, keep = [], [], []
    for part in lists + extra:
        chunks.append(part)
        keep.append(len(sizes))
        sizes.append(len(part))
        if len(part) & 1:
            chunks.append(_PAD)
            sizes.append(1)
    packed = int64_tensor(*chunks)
    n_blk = table_blocks if table_blocks is not None else (max_ub + bs - 1) // bs
    width = n_blk + (n_blk & 1)  # an even int32 count fills whole int64 words
    arrays = [packed.numpy()]
    if block_table is None:  # (numpy: torch's CPU indexing and cat cost more here)
        table = st.block_table_cpu.numpy()[rows_cpu, :width]
        if table.shape[1] < width:  # the table's last column: pad the word
            table = np.pad(table, ((0, 0), (0, width - table.shape[1])))
        words = table.view(np.int64).ravel()
        arrays.append(words)
        keep.append(len(sizes))
        sizes.append(words.size)
    if placement is not None:  # last: the segments above keep their 16-byte offsets
        arrays.append(placement.words)
        sizes.append(placement.words.size)
    if shape is not None and HEADER_WORDS + sum(sizes) > input_graph[0].stage.shape[0]:
        shape = None  # (a step too large for the stage: the input kernel's own launch)
    if shape is not None:
        starts_at = list(accumulate(sizes, initial=HEADER_WORDS))
        at = lambda i: starts_at[keep[i]]  # noqa: E731 (segment i's word offset)
        offsets = dict(q_lens=at(0), qsl_in=at(1), capacity=at(2), rows=at(n_own + n_extra), block_table=at(-1))
        st_n = (0, 0, 0)
        if fold:
            offsets.update(new_j=at(n_own - 1), staged=starts_at[len(sizes) - 1])
            st_n = (placement.sizes[0], placement.num_prompt_tokens, placement.sizes[3])
        n_logits = 0
        if graph_pad.logits_dst is not None:
            offsets["logits_src"], n_logits = at(n_own), sizes[keep[n_own]]
        hdr = header_words(
            qsl[-1], n_reqs, n_blk, width, graph_pad.tokens, graph_pad.reqs, max(graph_pad.seq_rows, n_reqs),
            graph_pad.seq_len, offsets, n_logits, *st_n,
        )  # fmt: skip
        arrays.insert(0, np.array(hdr, dtype=np.int64))
    if len(arrays) > 1:
        packed = torch.from_numpy(np.concatenate(arrays))
    if shape is not None:
        packed = input_graph[0].load(packed)[HEADER_WORDS:]
    else:
        packed = to_device(packed, dev)
    views = packed.split_with_sizes(sizes)  # (the method: torch.split's Python wrapper costs more)
    split = [views[i] for i in keep]  # the segments, without their pads
    place = None
    if fold:
        place = st.placement(placement, views[-1], split[n_own - 1])
    elif placement is not None:  # the new requests' writes, before the input kernel reads their rows
        st.place(placement, views[-1])
    q_lens_d, qsl_in = split[:2]
    if capacity is None:
        capacity = split[2]
    back = split[n_own : n_own + n_extra]
    if rows is None:
        rows = split[n_own + n_extra]
    if block_table is None:
        block_table = split[-1].view(torch.int32).view(n_reqs, width)[:, :n_blk]
    if graph_pad is not None and graph_pad.logits_dst is not None:
        graph_pad = graph_pad._replace(logits_src=back[0])
    committed = commit_lengths
    if shape is not None:  # the captured input kernel, over the stage's step (it sets the lengths)
        input_graph[0].run(input_graph[1])
        committed = True
        positions, input_ids, seq_lens, slot_mapping = out
        qsl_d = graph_pad.qsl[: n_reqs + 1]
    else:
        positions, input_ids, seq_lens, slot_mapping, qsl_d = prepare_inputs(
            starts,
            rows,
            qsl_in,
            n_tokens,
            q_lens_d,
            capacity,
            st.token_ids,
            block_table,
            bs,
            every_request_has_tokens=min(q_lens) >= 1,
            out=out,
            num_computed=st.num_computed if starts is None else None,
            pad=graph_pad,
            commit_lengths=commit_lengths,
            place=place,
        )
    meta = AttentionMetadata(
        query_start_loc=qsl_d,
        query_start_loc_cpu=torch.from_numpy(np.array(qsl, dtype=np.int32)),  # (cheaper than torch.tensor)
        seq_lens=seq_lens,
        seq_lens_upper_bound=torch.from_numpy(np.array(ubs, dtype=np.int32)),
        block_table=block_table,
        slot_mapping=slot_mapping,
        positions=positions,
        num_reqs=n_reqs,
        num_actual_tokens=n_tokens,
        max_query_len=max(q_lens),
        max_seq_len_upper_bound=max_ub,
        bounds_are_exact=bounds_are_exact,
        eager=True,  # a graph replay uses its own metadata
    )
    return Window(input_ids, positions, meta, block_table, capacity, committed), back, rows


@dataclass
class StepInputs:
    step_id: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor  # device row index per request
    rows_cpu: list[int]
    q_lens: list[int]
    ubs: list[int]
    logits_idx: torch.Tensor  # token indices whose logits are needed (k + 1 per sampling row)
    bonus_idx: torch.Tensor  # per sampling row: its last entry in logits_idx
    sample_rows: torch.Tensor  # request index (in batch) of each sampling row
    sample_rows_cpu: list[int]
    sample_device_rows: torch.Tensor  # device row of each sampling row, padded to a multiple of 4 (with row 0)
    handles: list[int]  # handles of the sampling rows
    opts: list[SamplingOptions]
    is_uniform_decode: bool  # every row: one token, sampled
    num_drafts: list[int]  # per sampling row (host-known)
    max_drafts: int
    spec_idx: torch.Tensor | None = None  # [S, K] entry in logits_idx of each draft slot (clamped)
    draft_token_idx: torch.Tensor | None = None  # [S, K] token index of each draft (clamped)
    num_drafts_d: torch.Tensor | None = None  # [S] on the device
    window: Window | None = None
    graph_key: tuple[int, int, int] | None = None  # the decode graph it replays, picked while built
    mixed_graph: bool = False  # else: whether it replays a mixed-step graph (inputs built into it)
    pads: list[int] | None = None  # padding tokens after each row's real ones (see uniform_pads)
    real_seq_lens: torch.Tensor | None = None  # device lengths without the padding (None: meta's)
    lengths_committed: bool = False  # num_computed already holds seq_lens (the input kernel wrote it)

    @property
    def seq_lens(self) -> torch.Tensor:
        """Each row's device KV length after this step's real tokens."""
        return self.meta.seq_lens if self.real_seq_lens is None else self.real_seq_lens


def uniform_pads(q_lens: list[int], ubs: list[int], query_lens, max_len: int | None) -> list[int] | None:
    """Padding tokens per row that give every row the same query length: the smallest of
    ``query_lens`` (the captured ones) at least the longest row; None when the rows are
    uniform already, no captured length fits, or a padded position would pass ``max_len``.

    A speculative step whose rows carry different draft counts (rows near ``max_tokens``
    get fewer) then replays the verify graph of its batch size instead of a mixed-step
    graph (the prefill-shaped attention over every row's window). Padding tokens come after a row's real ones: causal
    attention keeps them out of every real token's view, their slots beyond the row's
    blocks are -1, and a position the row's blocks do hold gets KV past the row's length,
    which (like a rejected draft's) is rewritten before anything reads it."""
    top = max(q_lens)
    if all(q == top for q in q_lens):
        return None
    q_pad = min((q for q in query_lens if q >= top), default=None)
    if q_pad is None:
        return None
    pads = [q_pad - q for q in q_lens]
    if max_len is not None and any(u + p > max_len for u, p in zip(ubs, pads)):
        return None
    return pads


def build_step_inputs(
    plan: StepPlan,
    st: DeviceState,
    block_size: int,
    bounds_are_exact: bool,
    graphs=None,
    pad_query_lens: tuple[int, ...] | None = None,
    max_len: int | None = None,
    mixed=None,
    placement: StagedPlacement | None = None,
    commit_lengths: bool = False,
    input_graphs=None,
    eager: bool = False,
) -> StepInputs:
    """``graphs`` (a ``DecodeGraphs``): pick the step's graph from host values first and build
    the inputs straight into its static buffers (``StepInputs.graph_key``).
    ``pad_query_lens``: query lengths a verify step with uneven draft counts may be padded to
    (``uniform_pads``; the graphs' own when None and ``graphs`` is given); ``max_len``: the
    longest position + 1 the model's rotary table holds. ``mixed`` (a ``MixedGraphs``): a step
    no decode graph fits builds its inputs into the mixed-step graph's static buffers.
    ``placement``: the plan's new requests (``DeviceState.stage``), placed from the same copy.
    ``commit_lengths``: where every row has one token and the step replays a decode graph (or
    no graphs exist), its input kernel also sets the rows' ``num_computed``
    (``StepInputs.lengths_committed``; only where nothing reads the old lengths before the
    step would set them: no drafts, no pipeline stages). ``input_graphs`` (a
    ``workers.input_graphs.InputGraphs``): a step replaying a graph whose input kernel was
    captured replays that too (``build_window``'s ``input_graph``). ``eager``: no graph of
    any kind, no padding (a step whose every token's hidden state is read: prompt logprobs)."""
    if eager:
        graphs = mixed = input_graphs = pad_query_lens = None
    if pad_query_lens is None and graphs is not None:
        pad_query_lens = graphs.query_lens
    # (comprehensions, not one loop of appends: this runs on every launch's critical path)
    prows = plan.rows
    row_of = st.row_of
    rows_cpu = [row_of[r.handle] for r in prows]
    q_lens = [r.num_scheduled_tokens for r in prows]
    ubs = [r.seq_len_upper_bound for r in prows]
    sample_idx = [i for i, r in enumerate(prows) if r.sample]
    drafts = [prows[i].num_draft_tokens for i in sample_idx]
    for row, r in zip(rows_cpu, prows):
        if r.new_block_ids:  # (most decode rows have none)
            st.append_blocks(row, r.new_block_ids)
    host_drafts = [
        (row, r.seq_len_upper_bound - r.num_draft_tokens, r.draft_token_ids)
        for row, r in zip(rows_cpu, prows)
        if r.draft_token_ids
    ]
    st.write_host_drafts(host_drafts)
    k_max = max(drafts, default=0)
    pads = None
    if k_max and pad_query_lens and len(sample_idx) == len(q_lens):  # every row verifies its drafts
        if all(k + 1 == q for k, q in zip(drafts, q_lens)):
            pads = uniform_pads(q_lens, ubs, pad_query_lens, max_len)
    q_win, ubs_win = q_lens, ubs
    if pads is not None:
        q_win = [q + p for q, p in zip(q_lens, pads)]
        ubs_win = [u + p for u, p in zip(ubs, pads)]
    ends = list(accumulate(q_win))  # one past each request's last token (host ints: no tensor)
    logits_idx, bonus_idx, spec_idx, draft_tok = [], [], [], []
    if not k_max:  # one logits row a sampling row, its last token (pads come only with drafts)
        logits_idx = [ends[i] - 1 for i in sample_idx]
        bonus_idx = list(range(len(sample_idx)))
    for i, k in zip(sample_idx, drafts) if k_max else ():
        end = ends[i] - 1 - (pads[i] if pads is not None else 0)  # the row's last real token
        base = len(logits_idx)
        logits_idx.extend(range(end - k, end + 1))
        bonus_idx.append(base + k)
        if k_max:
            spec_idx.append([base + min(j, k) for j in range(k_max)])
            draft_tok.append([end - k + 1 + min(j, k - 1) if k else end for j in range(k_max)])
    # the sampling rows' device rows, padded to a multiple of 4 entries (a gather of their
    # options then yields rows that start on 16 bytes: workers.device_state.OptionTensors)
    s_rows = [rows_cpu[i] for i in sample_idx]
    s_rows += [0] * (-len(s_rows) % 4)
    extra = [logits_idx, bonus_idx, sample_idx, s_rows]
    if k_max:
        extra += [[v for r in spec_idx for v in r], [v for r in draft_tok for v in r], drafts]
    if pads is not None:
        extra.append(pads)
    key = None
    if graphs is not None:
        if pads is not None:
            key = graphs.pick_shape(len(q_win), q_win, max(ubs_win))
        else:
            key = graphs.pick_step(q_lens, drafts, len(sample_idx), max(ubs))
    out = graph_pad = None
    mixed_graph = key is None and mixed is not None and mixed.fits(ends[-1])
    if key is not None:  # a decode or verify graph, padded to its rows by the input kernel
        out = graphs.static_inputs(len(rows_cpu), ends[-1])
        graph_pad = graphs.padding(key, len(rows_cpu))
    elif mixed_graph:  # the mixed-step graph this step replays, padded to its bucket by the input kernel
        out = mixed.static_inputs(len(rows_cpu), ends[-1])
        graph_pad = mixed.padding(ends[-1], len(logits_idx))
    # the rows, the block table and the extras ride in the window's one copy
    # (one token a row, and a launch form start-up compiled: a decode graph's, or an engine without graphs)
    commit = commit_lengths and pads is None and ends[-1] == len(q_lens) and min(q_lens) == 1
    commit = commit and (key is not None or (graphs is None and mixed is None))
    input_graph = None
    if input_graphs is not None and graph_pad is not None:
        ig_key = ("mixed", graph_pad.tokens) if key is None else ("decode", key[0]) if key[2] == 1 else None
        shape = input_graphs.shapes.get(ig_key)
        if shape is not None and shape.commit_lengths == commit:
            input_graph = (input_graphs, ig_key)
    win, back, rows = build_window(
        st,
        None,
        rows_cpu,
        q_win,
        ubs_win,
        None,
        block_size,
        bounds_are_exact,
        packed_extra=extra,
        out=out,
        graph_pad=graph_pad,
        placement=placement,
        commit_lengths=commit,
        input_graph=input_graph,
    )
    logits_i, bonus_i, sample_rows, s_rows_d = back[:4]
    if graph_pad is not None and graph_pad.logits_dst is not None:  # (copied there by the input kernel)
        logits_i = graph_pad.logits_dst[: len(logits_idx)]
    inp = StepInputs(
        step_id=plan.step_id,
        input_ids=win.input_ids,
        positions=win.positions,
        meta=win.meta,
        rows=rows,
        rows_cpu=rows_cpu,
        q_lens=q_lens,
        ubs=ubs,
        logits_idx=logits_i,
        bonus_idx=bonus_i,
        sample_rows=sample_rows,
        sample_rows_cpu=sample_idx,
        sample_device_rows=s_rows_d,
        handles=[plan.rows[i].handle for i in sample_idx],
        opts=[st.sampling[rows_cpu[i]] for i in sample_idx],
        is_uniform_decode=len(q_lens) == win.meta.num_actual_tokens and len(sample_idx) == len(q_lens),
        num_drafts=drafts,
        max_drafts=k_max,
        window=win,
        graph_key=key,
        mixed_graph=mixed_graph,
        pads=pads,
        lengths_committed=win.lengths_committed,
    )
    if k_max:
        s = len(sample_idx)
        inp.spec_idx, inp.draft_token_idx, inp.num_drafts_d = back[4].view(s, k_max), back[5].view(s, k_max), back[6]
    if pads is not None:
        inp.real_seq_lens = win.meta.seq_lens - back[-1].to(win.meta.seq_lens.dtype)
    return inp


def sampling_rows(inp: StepInputs, seq_lens: torch.Tensor, wide: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Device rows of the step's sampling requests and the position each one's (bonus) token
    takes (``seq_lens``: the step's device lengths), as int64, or with ``wide`` False as the
    lengths' int32 (no cast launch: the fused sampler reads either)."""
    if len(inp.sample_rows_cpu) == len(inp.rows_cpu):  # every row samples (decode; the indices are sorted)
        return inp.rows, seq_lens.long() if wide else seq_lens
    pos = seq_lens[inp.sample_rows]
    return inp.sample_device_rows[: len(inp.sample_rows_cpu)], pos.long() if wide else pos
