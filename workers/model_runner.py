"""Executes one ``StepPlan`` on the device: state update, metadata, forward, sampling."""

from __future__ import annotations

import time

import torch

from metadata.attention_metadata import AttentionMetadata
from metadata.config import EngineConfig
from metadata.wire import SampledRow, StepPlan, StepResult, TokenLogprobs
from workers import kv_cache
from workers.device_state import DeviceState, to_device
from workers.distributed import TPGroup
from workers.models.loader import load_model
from workers.sampler import PenaltyBatch, SamplingBatch, sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.model.dtype != "auto":
        return _DTYPES[cfg.model.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class ModelRunner:
    """Owns the model, the KV cache and the persistent request state of one rank."""

    def __init__(self, cfg: EngineConfig, model_dir: str, device: torch.device, tp: TPGroup, max_model_len: int):
        self.cfg = cfg
        self.device = device
        self.tp = tp
        self.dtype = resolve_dtype(cfg, device)
        self.max_model_len = max_model_len
        self.block_size = cfg.cache.block_size
        self.model, self.arch = load_model(
            model_dir, tp, self.dtype, device, max_model_len + 1, cfg.model.load_format
        )
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.max_blocks_per_req = (max_model_len + self.block_size) // self.block_size
        self.state = DeviceState(
            cfg.scheduler.max_num_seqs, max_model_len, self.max_blocks_per_req, self.arch.vocab_size, device
        )
        self.kv_caches: list = []
        self.num_blocks = 0
        self.bounds_are_exact = True  # no speculative decoding yet

    # ------------------------------------------------------------- KV cache
    def init_kv_cache(self, num_blocks: int | None = None) -> int:
        per_block = kv_cache.bytes_per_block(self.arch, self.num_kv_heads, self.block_size, self.dtype)
        budget = None
        if self.device.type == "cuda" and self.cfg.cache.kv_cache_memory_bytes is None:
            budget = self._profile_free_bytes()
        n = num_blocks or kv_cache.num_blocks_for_budget(self.cfg, per_block, budget)
        self.kv_caches = kv_cache.allocate(
            self.arch.num_layers, n, self.block_size, self.num_kv_heads, self.arch.head_dim,
            self.dtype, self.device,
        )
        self.num_blocks = n
        return n

    def _profile_free_bytes(self) -> int:
        """Free device memory under ``gpu_memory_utilization`` after a peak-sized forward."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.cfg.scheduler.max_num_batched_tokens, self.max_model_len)
        dummy = kv_cache.allocate(self.arch.num_layers, 1, self.block_size, self.num_kv_heads, self.arch.head_dim, self.dtype, self.device)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            query_start_loc_cpu=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            seq_lens_upper_bound=torch.tensor([n], dtype=torch.int32),
            block_table=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            positions=pos, num_reqs=1, num_actual_tokens=n, max_query_len=n,
            max_seq_len_upper_bound=1, bounds_are_exact=True,
        )
        with torch.inference_mode():
            h = self.model(ids, pos, meta, dummy)
            self.model.compute_logits(h[-min(n, self.cfg.scheduler.max_num_seqs):])
        torch.cuda.synchronize()
        del dummy, h
        free, total = torch.cuda.mem_get_info(self.device)
        peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        used = total - free
        budget = int(total * self.cfg.cache.gpu_memory_utilization) - used - peak_extra
        if budget <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache: {used / 2**30:.1f} GiB used of {total / 2**30:.1f} GiB; "
                "raise gpu_memory_utilization or use a smaller model"
            )
        return budget

    # ------------------------------------------------------------- the step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        st = self.state
        for h in plan.finished_handles:
            st.release(h)
        for h in plan.preempted_handles:
            st.release(h)
        for req in plan.new_requests:
            st.add(req)
        if not plan.rows:
            return StepResult(step_id=plan.step_id, rank=self.tp.rank)
        rows_cpu, q_lens, ubs, samples = [], [], [], []
        for r in plan.rows:
            row = st.row_of[r.handle]
            st.append_blocks(row, r.new_block_ids)
            rows_cpu.append(row)
            q_lens.append(r.num_scheduled_tokens)
            ubs.append(r.seq_len_upper_bound)
            samples.append(r.sample)
        out = self._run(plan, rows_cpu, q_lens, ubs, samples)
        out.worker_time_s = time.perf_counter() - t0
        return out

    def _run(self, plan, rows_cpu, q_lens, ubs, samples) -> StepResult:
        st, dev, bs = self.state, self.device, self.block_size
        n_reqs = len(rows_cpu)
        q_lens_cpu = torch.tensor(q_lens, dtype=torch.int32)
        qsl_cpu = torch.zeros(n_reqs + 1, dtype=torch.int32)
        torch.cumsum(q_lens_cpu, 0, out=qsl_cpu[1:])
        n_tokens = int(qsl_cpu[-1])
        max_ub = max(ubs)
        n_blk = (max_ub + bs - 1) // bs
        token_req_cpu = torch.repeat_interleave(torch.arange(n_reqs), q_lens_cpu.long())
        offsets_cpu = torch.arange(n_tokens) - qsl_cpu[:-1].long()[token_req_cpu]
        sample_idx = [i for i, s in enumerate(samples) if s]
        logits_idx_cpu = (qsl_cpu[1:].long() - 1)[sample_idx]
        # one pinned staging copy for all CPU-known int vectors of this step
        packed = to_device(torch.cat([torch.tensor(rows_cpu), q_lens_cpu.long(), qsl_cpu.long(), token_req_cpu, offsets_cpu, logits_idx_cpu, torch.tensor(sample_idx, dtype=torch.long)]), dev)
        sizes = [n_reqs, n_reqs, n_reqs + 1, n_tokens, n_tokens, len(sample_idx), len(sample_idx)]
        rows, q_lens_d, qsl, token_req, offsets, logits_idx, sample_rows = torch.split(packed, sizes)
        block_table = to_device(st.block_table_cpu[rows_cpu, :n_blk], dev)
        num_computed = st.num_computed[rows]
        positions = num_computed.long()[token_req] + offsets
        input_ids = st.token_ids[rows[token_req], positions]
        seq_lens = (num_computed + q_lens_d).int()
        blk = block_table.reshape(-1)[token_req * n_blk + (positions // bs).clamp(max=n_blk - 1)].long()
        slot_mapping = blk * bs + positions % bs
        meta = AttentionMetadata(
            query_start_loc=qsl.int(), query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens,
            seq_lens_upper_bound=torch.tensor(ubs, dtype=torch.int32), block_table=block_table,
            slot_mapping=slot_mapping, positions=positions, num_reqs=n_reqs, num_actual_tokens=n_tokens,
            max_query_len=int(q_lens_cpu.max()), max_seq_len_upper_bound=max_ub,
            bounds_are_exact=self.bounds_are_exact,
        )
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        st.num_computed[rows] = seq_lens
        if not sample_idx:
            return StepResult(step_id=plan.step_id, rank=self.tp.rank)
        logits = self.model.compute_logits(hidden[logits_idx])
        s_rows = rows[sample_rows]
        s_pos = seq_lens.long()[sample_rows]  # position the new token takes
        handles = [plan.rows[i].handle for i in sample_idx]
        opts = [st.sampling[rows_cpu[i]] for i in sample_idx]
        batch = self._sampling_batch(opts, s_rows, s_pos)
        so = sample(logits, batch)
        st.token_ids[s_rows, s_pos] = so.token_ids
        st.output_counts[s_rows, so.token_ids] += 1
        return self._result(plan.step_id, handles, opts, so)

    def _sampling_batch(self, opts, s_rows, s_pos) -> SamplingBatch:
        st, dev = self.state, self.device
        f = lambda vals: to_device(torch.tensor(vals, dtype=torch.float32), dev)  # noqa: E731
        any_pen = any(o.repetition_penalty != 1.0 or o.presence_penalty or o.frequency_penalty for o in opts)
        penalties = None
        if any_pen:
            penalties = PenaltyBatch(
                repetition=f([o.repetition_penalty for o in opts]),
                presence=f([o.presence_penalty for o in opts]),
                frequency=f([o.frequency_penalty for o in opts]),
                output_counts=st.output_counts[s_rows],
                prompt_mask=st.prompt_mask[s_rows],
            )
        mask = None
        if any(o.min_tokens > 0 and o.min_tokens_stop_ids for o in opts):
            ri, ids = [], []
            for i, o in enumerate(opts):
                if o.min_tokens > 0:
                    ri += [i] * len(o.min_tokens_stop_ids)
                    ids += o.min_tokens_stop_ids
            idx = to_device(torch.tensor([ri, ids], dtype=torch.int64), dev)
            mask = torch.zeros(len(opts), self.arch.vocab_size, dtype=torch.bool, device=dev)
            mask[idx[0], idx[1].clamp(max=self.arch.vocab_size - 1)] = True
            out_len = s_pos - st.prompt_len[s_rows].long()  # outputs before this token
            min_tok = to_device(torch.tensor([o.min_tokens for o in opts], dtype=torch.int64), dev)
            mask &= (out_len < min_tok)[:, None]
        return SamplingBatch(
            temperature=f([o.temperature for o in opts]),
            top_p=f([o.top_p for o in opts]),
            top_k=to_device(torch.tensor([o.top_k for o in opts], dtype=torch.int64), dev),
            min_p=f([o.min_p for o in opts]),
            seeds=to_device(torch.tensor([o.seed for o in opts], dtype=torch.int64), dev),
            positions=s_pos,
            all_greedy=all(o.temperature == 0 for o in opts),
            any_top_k_top_p=any(o.top_k > 0 or o.top_p < 1.0 for o in opts),
            any_min_p=any(o.min_p > 0 for o in opts),
            penalties=penalties,
            min_tokens_mask=mask,
            max_num_logprobs=max(o.num_logprobs for o in opts),
        )

    def _result(self, step_id, handles, opts, so) -> StepResult:
        """Copy the sampled tokens to pinned host memory and wait for that copy only."""
        tensors = [so.token_ids]
        if so.sampled_logprob is not None:
            tensors += [so.sampled_logprob, so.sampled_rank.float()]
            if so.top_ids is not None:
                tensors += [so.top_ids.float().flatten(), so.top_logprobs.flatten()]
        host = copy_to_host([t.double() if t.dtype != torch.int64 else t.double() for t in tensors], self.device)
        tok = host[0].long().tolist()
        outputs = []
        for i, h in enumerate(handles):
            lp = None
            if opts[i].num_logprobs >= 0 and so.sampled_logprob is not None:
                k = opts[i].num_logprobs
                kmax = so.top_ids.shape[1] if so.top_ids is not None else 0
                top_ids = host[3][i * kmax : i * kmax + k].long().tolist() if k else []
                top_lp = host[4][i * kmax : i * kmax + k].tolist() if k else []
                lp = [TokenLogprobs(float(host[1][i]), int(host[2][i]), top_ids, top_lp)]
            outputs.append(SampledRow(handle=h, token_ids=[tok[i]], logprobs=lp))
        return StepResult(step_id=step_id, outputs=outputs, rank=self.tp.rank)


def copy_to_host(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Non-blocking device->pinned-host copies, then the step's one deliberate wait."""
    if device.type == "cpu":
        return tensors
    from workers.sync_check import allow_sync

    outs = []
    for t in tensors:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        outs.append(buf)
    event = torch.cuda.Event()
    event.record()
    with allow_sync("waiting for the sampled-token copy to reach pinned host memory"):
        event.synchronize()
    return outs
