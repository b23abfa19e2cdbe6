"""Builds one step's device inputs and ``AttentionMetadata`` from a plan.

Everything the host contributes is known at schedule time (rows, query
lengths, upper bounds, block ids) and travels in one pinned, non-blocking
copy. Positions, input ids, ``seq_lens`` and the slot mapping are derived on
the device from the persistent ``num_computed`` counters, so they stay exact
even when the host only holds bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metadata.attention_metadata import AttentionMetadata
from metadata.wire import SamplingOptions, StepPlan
from workers.device_state import DeviceState, to_device


@dataclass
class StepInputs:
    step_id: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor  # device row index per request
    logits_idx: torch.Tensor  # token index of each sampling row's last token
    sample_rows: torch.Tensor  # request index (in batch) of each sampling row
    handles: list[int]  # handles of the sampling rows
    opts: list[SamplingOptions]
    is_uniform_decode: bool  # every row: one token, sampled


def build_step_inputs(plan: StepPlan, st: DeviceState, block_size: int, bounds_are_exact: bool) -> StepInputs:
    dev, bs = st.device, block_size
    rows_cpu, q_lens, ubs, sample_idx = [], [], [], []
    for i, r in enumerate(plan.rows):
        row = st.row_of[r.handle]
        st.append_blocks(row, r.new_block_ids)
        rows_cpu.append(row)
        q_lens.append(r.num_scheduled_tokens)
        ubs.append(r.seq_len_upper_bound)
        if r.sample:
            sample_idx.append(i)
    n_reqs = len(rows_cpu)
    q_lens_cpu = torch.tensor(q_lens, dtype=torch.int64)
    qsl_cpu = torch.zeros(n_reqs + 1, dtype=torch.int64)
    torch.cumsum(q_lens_cpu, 0, out=qsl_cpu[1:])
    n_tokens = int(qsl_cpu[-1])
    max_ub = max(ubs)
    n_blk = (max_ub + bs - 1) // bs
    token_req_cpu = torch.repeat_interleave(torch.arange(n_reqs), q_lens_cpu)
    offsets_cpu = torch.arange(n_tokens) - qsl_cpu[:-1][token_req_cpu]
    logits_idx_cpu = (qsl_cpu[1:] - 1)[sample_idx]
    parts = [torch.tensor(rows_cpu, dtype=torch.int64), q_lens_cpu, qsl_cpu, token_req_cpu, offsets_cpu,
             logits_idx_cpu, torch.tensor(sample_idx, dtype=torch.int64)]
    packed = to_device(torch.cat(parts), dev)
    rows, q_lens_d, qsl, token_req, offsets, logits_idx, sample_rows = torch.split(
        packed, [p.numel() for p in parts]
    )
    block_table = to_device(st.block_table_cpu[rows_cpu, :n_blk], dev)
    num_computed = st.num_computed[rows]
    positions = num_computed.long()[token_req] + offsets
    input_ids = st.token_ids[rows[token_req], positions]
    seq_lens = (num_computed + q_lens_d).int()
    blk = block_table.reshape(-1)[token_req * n_blk + (positions // bs).clamp(max=n_blk - 1)].long()
    slot_mapping = blk * bs + positions % bs
    meta = AttentionMetadata(
        query_start_loc=qsl.int(), query_start_loc_cpu=qsl_cpu.int(), seq_lens=seq_lens,
        seq_lens_upper_bound=torch.tensor(ubs, dtype=torch.int32), block_table=block_table,
        slot_mapping=slot_mapping, positions=positions, num_reqs=n_reqs, num_actual_tokens=n_tokens,
        max_query_len=int(q_lens_cpu.max()), max_seq_len_upper_bound=max_ub,
        bounds_are_exact=bounds_are_exact,
    )
    return StepInputs(
        step_id=plan.step_id, input_ids=input_ids, positions=positions, meta=meta, rows=rows,
        logits_idx=logits_idx, sample_rows=sample_rows,
        handles=[plan.rows[i].handle for i in sample_idx],
        opts=[st.sampling[rows_cpu[i]] for i in sample_idx],
        is_uniform_decode=n_tokens == n_reqs and len(sample_idx) == n_reqs,
    )
