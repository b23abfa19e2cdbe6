"""Draft proposers for speculative decoding. Drafts stay on the device.

After a step, every sampling row knows (on the device only) how many tokens it
has: ``known = num_computed + 1``. A proposer writes ``K`` drafts into the
row's ``token_ids`` at ``known .. known + K - 1``, exactly where the next step
gathers its inputs, so drafts never visit the host; the driver only knows the
count it scheduled.
"""

from __future__ import annotations

import torch

from workers.device_state import DeviceState
from kernels.ops import exponential_race
from kernels.spec_ops import draft_sample, draft_step_inputs, ngram_propose
from kernels.reference import STREAM_DRAFT, write_column
from workers.sampler import sampling_probs
from workers.step_inputs import StepInputs, build_window, uniform_pads


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(
        self, st: DeviceState, inp: StepInputs, s_rows: torch.Tensor, known: torch.Tensor, draft_sampling=None
    ) -> None:
        width = min(st.token_ids.shape[1], max(inp.ubs) + 1)  # host bound on every known length
        ngram_propose(st.token_ids, s_rows, known, width, self.k, self.n_min, self.n_max)


class _Inputs:
    def __init__(self, input_ids, positions, meta):
        self.input_ids, self.positions, self.meta = input_ids, positions, meta


class DraftModelProposer:
    """A small model with the target's vocabulary, run in the same worker with its own KV
    cache (same block ids: a block holds the same positions in both caches).

    Pass A replays this step's target windows plus the newly sampled token, so the
    draft's KV covers every token the target has seen; the hidden state at the row's
    last *known* token (a device index: it depends on how many drafts were accepted)
    yields the first draft. Passes B feed each draft back ``K - 1`` times. Lookahead
    KV writes land in blocks the driver allocated for them; anything beyond a row's
    blocks is skipped, never written into another row.
    """

    def __init__(self, model, kv_caches, k: int, block_size: int, bounds_are_exact: bool, max_position: int):
        self.model, self.kv_caches, self.k = model, kv_caches, k
        self.max_position = max_position  # lookahead positions are clamped into the rotary table
        self.graphs = None  # DecodeGraphs of the draft (hidden states), set after capture
        self.mixed_graphs = None  # MixedGraphs of the draft, set after capture
        self.propose_graphs = None  # workers.draft_graphs.ProposeGraphs, set after capture
        self.pad_query_lens = None  # window lengths uneven steps pad to (None: the graphs')
        self.padded_windows = 0
        self.block_size = block_size
        self.bounds_are_exact = bounds_are_exact

    def propose(
        self, st: DeviceState, inp: StepInputs, s_rows: torch.Tensor, known: torch.Tensor, draft_sampling
    ) -> None:
        from metadata.attention_metadata import AttentionMetadata

        k, bs = self.k, self.block_size
        samples = [0] * len(inp.rows_cpu)
        sample_list = inp.sample_rows_cpu
        for i in sample_list:
            samples[i] = 1
        q_lens = [q + s for q, s in zip(inp.q_lens, samples)]
        ubs = [u + s for u, s in zip(inp.ubs, samples)]
        starts = inp.meta.num_computed_tokens().long()  # device: KV length before this step
        n_blk = min((max(ubs) + k + bs - 1) // bs, st.block_table_cpu.shape[1])
        # uneven windows of rows that all sample: padded to one captured length (uniform_pads)
        query_lens = self.pad_query_lens or (self.graphs.query_lens if self.graphs is not None else None)
        pads = uniform_pads(q_lens, ubs, query_lens, self.max_position) if query_lens and all(samples) else None
        q_win, ubs_win = q_lens, ubs
        if pads is not None:  # (a pad is at most k: the window still fits the k-lookahead table)
            self.padded_windows += 1
            q_win = [q + p for q, p in zip(q_lens, pads)]
            ubs_win = [u + p for u, p in zip(ubs, pads)]
        # a uniform proposal replays one graph, its window built straight into the graph's inputs
        key = self._graph_key(q_win, ubs_win, ubs, samples, draft_sampling)
        out = self.graphs.static_inputs(len(q_win), sum(q_win)) if key is not None else None
        # the block table (wide enough for the k lookahead drafts) rides in the window's copy
        win, _, _ = build_window(
            st, inp.rows, inp.rows_cpu, q_win, ubs_win, starts, bs, self.bounds_are_exact, table_blocks=n_blk, out=out
        )
        if key is not None:
            ds = draft_sampling
            self.propose_graphs.run(win, key, known, win.capacity, s_rows, ds.seeds, ds.temperature)
            return
        block_table = win.block_table
        hidden = self._forward(win, len(q_win), q_win, max(ubs_win))
        if not sample_list:
            return  # a step without sampling rows only advances the draft's KV
        # the last known token of sampling row i sits at offset known - 1 - start in its window
        qsl = win.meta.query_start_loc.long()
        sr = inp.sample_rows
        idx = qsl[sr] + (known.long() - 1 - starts[sr])
        logits = self.model.compute_logits(hidden[idx])
        cap = win.capacity[sr]
        bt = block_table[sr]
        s_ubs = [ubs[i] for i in sample_list]
        n = len(sample_list)
        pos = known.long().clone()  # position the next draft takes (advanced in place)
        step_qsl = torch.arange(n + 1, dtype=torch.int32, device=st.device)
        for i in range(k):
            tok = self._pick(logits, draft_sampling, pos, st, s_rows, known, i)
            if i == k - 1:
                break
            bound = max(s_ubs) + i + 1
            key = self.graphs.pick_shape(n, [1] * n, bound) if self.graphs is not None else None
            if key is not None:  # the inputs go straight into the graph's static buffers
                out = self.graphs.static_inputs(n, n)
                if bt.data_ptr() != self.graphs.block_table.data_ptr():  # (once: every step reads it)
                    bt = self.graphs.block_table[:n, : bt.shape[1]].copy_(bt)
            else:
                out = (
                    torch.empty_like(pos),
                    torch.empty_like(pos),
                    torch.empty_like(step_qsl[:n]),
                    torch.empty_like(pos),
                )
            draft_step_inputs(tok, pos, bt, cap, bs, self.max_position, out)
            meta = AttentionMetadata(
                query_start_loc=step_qsl,
                query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32),
                seq_lens=out[2],
                seq_lens_upper_bound=torch.tensor([u + i + 1 for u in s_ubs], dtype=torch.int32),
                block_table=bt,
                slot_mapping=out[3],
                positions=out[0],
                num_reqs=n,
                num_actual_tokens=n,
                max_query_len=1,
                max_seq_len_upper_bound=bound,
                bounds_are_exact=self.bounds_are_exact,
                eager=True,  # graphs use their own
            )
            hidden = self._forward(_Inputs(out[1], out[0], meta), n, [1] * n, bound, key)
            logits = self.model.compute_logits(hidden)

    def _graph_key(self, q_win: list[int], ubs_win: list[int], ubs: list[int], samples: list[int], ds):
        """The proposal graph a step replays (``workers.draft_graphs``; host values only), or
        None: every row samples, every window has the captured ``k + 2`` tokens, and no row
        uses top-k / top-p / min-p."""
        pg = self.propose_graphs
        if pg is None or ds is None or not all(samples) or ds.any_top_k_top_p or ds.any_min_p:
            return None
        if any(q != pg.window_len for q in q_win):
            return None
        # pass A attends its windows; lookahead pass i the row's bound + i + 1 keys
        return pg.key(len(q_win), max(max(ubs_win), max(ubs) + self.k - 1))

    def _forward(self, inputs, n: int, q_lens: list[int], bound: int, key=False) -> torch.Tensor:
        """The draft's forward over a window: a decode graph where one fits (``key``: already
        picked, None for none), else a mixed-step graph, else eager."""
        if key is False:
            key = self.graphs.pick_shape(n, q_lens, bound) if self.graphs is not None else None
        if key is not None:
            return self.graphs.run(inputs, key)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(inputs.input_ids.shape[0]):
            return self.mixed_graphs.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def _pick(self, logits, ds, pos, st: DeviceState, s_rows, known, i: int) -> torch.Tensor:
        """Draft ``i`` of every sampling row, also written where the next step reads it
        (``known + i``). Greedy rows take the draft's argmax; sampled rows draw from the draft
        distribution (same temperature/top-k/top-p/min-p as the target) and keep it for
        verification. Without top-k / top-p / min-p that is one launch (``kernels.draft_sample``)."""
        if not (ds.any_top_k_top_p or ds.any_min_p):
            probs = None if ds.all_greedy else st.ensure_draft_probs(self.k)
            return draft_sample(logits, ds.temperature, ds.seeds, pos, probs, s_rows, i, st.token_ids, known)
        logits = logits.float()
        tok = logits.argmax(dim=-1)
        if not ds.all_greedy:
            probs = sampling_probs(
                logits, ds.temperature, ds.top_k, ds.top_p, ds.min_p, ds.any_top_k_top_p, ds.any_min_p
            )
            probs = probs / probs.sum(dim=-1, keepdim=True)
            st.ensure_draft_probs(self.k)[s_rows, i] = probs
            drawn = exponential_race(probs, ds.seeds ^ STREAM_DRAFT, pos)
            tok = torch.where(ds.temperature > 0, drawn, tok)
        write_column(st.token_ids, s_rows, known.long() + i, tok)
        return tok
