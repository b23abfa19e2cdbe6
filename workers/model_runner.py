"""Executes one ``StepPlan`` on the device: state update, metadata, forward, sampling."""

from __future__ import annotations

import collections
import time

import torch

from metadata.config import EngineConfig
from metadata.wire import StepPlan, StepResult
from kernels.ops import build_kernel_settings, precompile_tile_gemm
from kernels.settings import install_kernel_settings
from workers import kv_cache
from workers.cuda_graphs import DecodeGraphs
from workers.device_state import DeviceState
from workers.distributed import TPGroup
from workers.models.loader import load_model
from workers.pending_step import PendingStep, PinnedPool
from workers.memory_profile import profile_free_bytes
from workers.pipeline import WHOLE_MODEL, PipelineComm, scratch_model
from workers.prompt_logprobs import compute_prompt_logprobs
from workers.sampler import commit_tokens, sample
from workers.sampling_inputs import build_sampling_batch
from workers.step_inputs import build_step_inputs, sampling_rows

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.model.dtype != "auto":
        return _DTYPES[cfg.model.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_fp8_device(model, kv_dtype: torch.dtype, device: torch.device) -> None:
    """FP8 weights or KV cache need e4m3 support: compute capability 8.9 (Ada) or newer."""
    fp8 = kv_dtype == torch.float8_e4m3fn or model.projections()[0].weight_scale is not None
    if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise RuntimeError(
            f"quantization='fp8' and kv_cache_dtype='fp8' need a GPU of compute capability 8.9 or newer "
            f"(Ada, Hopper); {torch.cuda.get_device_name(device)} has {cap}: drop them"
        )


def allocator_counts() -> tuple[int, int]:
    """(pinned host blocks, device segments) the caching allocators have created so far: a
    launch that grows either pays a ``cudaHostAlloc`` or ``cudaMalloc`` (diagnostics only:
    reading the counters costs the host tens of microseconds)."""
    host_stats = getattr(torch.cuda, "host_memory_stats", None)  # (torch 2.7+)
    host = host_stats().get("num_host_alloc", 0) if host_stats is not None else 0
    return host, torch.cuda.memory_stats().get("num_device_alloc", 0)


# a launch's host time, split: releasing and placing requests; the step's inputs; the forward
# (a graph's input copies and replay, or eager) and the lengths' update; sampling or
# verification with the commit; the next drafts; the result's copy (0 for the last three
# where the step samples no row)
LAUNCH_PHASES = ("place", "inputs", "forward", "sample", "propose", "copy")


class ModelRunner:
    """Owns the model, the KV cache and the persistent request state of one rank.

    ``pp``: this rank's pipeline stage and its transfers (None: the whole model here). A
    stage holds only its layers and their KV; the last stage samples and sends the tokens
    to stage 0, which embeds them in the next step (``workers.pipeline``)."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_dir: str,
        device: torch.device,
        tp: TPGroup,
        max_model_len: int,
        pp: PipelineComm | None = None,
    ):
        self.cfg = cfg
        self.device = device
        self.tp = tp
        self.pp = pp
        self.stage = pp.stage if pp is not None else WHOLE_MODEL
        self.dtype = resolve_dtype(cfg, device)
        self.max_model_len = max_model_len
        self.block_size = cfg.cache.block_size
        # the kernel settings, read once here: every launch of this worker follows them
        install_kernel_settings(build_kernel_settings(cfg.kernels))
        self.model, self.arch = load_model(
            model_dir,
            tp,
            self.dtype,
            device,
            max_model_len + 1,
            cfg.model.load_format,
            self.stage,
            quantization=cfg.model.quantization,
        )
        self.kv_dtype = torch.float8_e4m3fn if cfg.cache.kv_cache_dtype.startswith("fp8") else self.dtype
        check_fp8_device(self.model, self.kv_dtype, device)
        self.num_layers = len(self.model.layers)  # this stage's
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.max_blocks_per_req = (max_model_len + self.block_size) // self.block_size
        self.state = DeviceState(
            cfg.scheduler.max_num_seqs, max_model_len, self.max_blocks_per_req, self.arch.vocab_size, device
        )
        self.kv_caches: list = []
        self.num_blocks = 0
        self.spec = None
        if cfg.speculative.speculative_method != "off":
            from workers.spec_decode import SpecDecoder

            self.spec = SpecDecoder(cfg, self.arch, tp, self.dtype, device, max_model_len)
            if self.spec.method == "draft_model":  # before the KV cache is sized: it lives as long
                self.state.ensure_draft_probs(self.spec.k)  # (and the proposal graphs write it)
        # with speculative decoding the plan's lengths assume every draft is accepted
        self.bounds_are_exact = self.spec is None
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs = None  # workers.mixed_graphs.MixedGraphs, after capture
        self.input_graphs = None  # workers.input_graphs.InputGraphs, after capture (no drafts, no stages)
        self.pad_query_lens = None  # verify lengths uneven steps pad to (None: the graphs')
        self.padded_steps = 0  # verify steps run padded to a uniform query length
        self.launch_ms: collections.deque = collections.deque(maxlen=4096)  # host time a launch
        self.mixed_launch_ms: collections.deque = collections.deque(maxlen=4096)  # ... of steps no decode graph fits
        # (mixed step?, ms of each of LAUNCH_PHASES) a launch with rows: where the host time goes
        self.launch_phases: collections.deque = collections.deque(maxlen=4096)
        # (mixed step?, wall ms, the launching thread's CPU ms) a launch with rows: a gap between
        # the two is time the thread did not run (another thread held the GIL, or it blocked)
        self.launch_cpu: collections.deque = collections.deque(maxlen=4096)
        self._decode_graph_step = True  # whether the step being launched replays a decode graph
        self._probe_cycles = 0  # launch_wait_probe_ms in torch.cuda._sleep cycles
        # with the probe armed, (mixed step?, pinned host blocks, device segments) a launch created
        self.launch_allocs: collections.deque = collections.deque(maxlen=4096)
        self._last_end_ev = None
        self._pinned = PinnedPool()

    # ------------------------------------------------------------- KV cache
    def init_kv_cache(self, num_blocks: int | None = None) -> int:
        per_block = (
            kv_cache.bytes_per_block(self.arch, self.num_kv_heads, self.block_size, self.kv_dtype)
            * self.num_layers
            // self.arch.num_layers
        )
        draft = self.spec.draft_model if self.spec is not None else None
        if draft is not None:
            # drop a previous draft cache before allocating the new one; the draft's cache has the
            # same blocks: size both together
            self.spec.proposer = None
            per_block += kv_cache.bytes_per_block(
                self.spec.draft_arch, self.spec.draft_num_kv_heads, self.block_size, self.dtype
            )
        budget = None
        if self.device.type == "cuda" and self.cfg.cache.kv_cache_memory_bytes is None:
            budget = profile_free_bytes(self)
        n = num_blocks or kv_cache.num_blocks_for_budget(self.cfg, per_block, budget)
        self.kv_caches = kv_cache.allocate(
            self.num_layers,
            n,
            self.block_size,
            self.num_kv_heads,
            self.arch.head_dim,
            self.kv_dtype,
            self.device,
        )
        if draft is not None:
            self.spec.attach_kv_cache(
                kv_cache.allocate(
                    self.spec.draft_arch.num_layers,
                    n,
                    self.block_size,
                    self.spec.draft_num_kv_heads,
                    self.spec.draft_arch.head_dim,
                    self.dtype,
                    self.device,
                ),
                self.block_size,
            )
        self.num_blocks = n
        return n

    @staticmethod
    def draw_once(logits: torch.Tensor) -> torch.Tensor:
        """One seeded draw per row, through the race over probabilities and through the fused
        temperature sampler (compiles both before serving starts)."""
        from kernels.ops import exponential_race, sample_logits

        rows = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        ones = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
        sample_logits(logits.float(), ones, ones, rows, rows, rows)
        return exponential_race(logits.float().softmax(dim=-1), rows, rows)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile what the first steps would otherwise compile mid-serving (Triton JIT): the
        sampling kernels (one row suffices: they are not specialised on sizes), then a
        scratch requests' steps through ``execute`` (``_scratch_request_steps``: the input
        variants a fresh machine compiled inside the first request, docs/decisions.md, and the
        first uses of the sampled-row paths; with graphs on, they replay captured graphs), then
        the sampling stage at each row-count class (``workers.sampling_warm_up``: a kernel's
        first launch loads it, and the load can wait for the device). Shapes no graph covers
        (eager workers' mixed and spec-verify steps) are not run here: if they need a new variant,
        ``workers.compile_watch`` says so. The scratch KV blocks keep garbage, which nothing reads:
        every position's KV is written before attention reads it. Every TP rank runs the
        same plans, so their collectives pair up."""
        if self.device.type != "cuda":
            return
        self.draw_once(torch.zeros(1, self.arch.vocab_size, device=self.device))
        if self.spec is not None:
            self.spec.warm_up(self.state, self.model.lm_head.padded_vocab)
        self._scratch_request_steps()
        if self.model.lm_head is not None:  # (a pipeline stage before the last samples nothing)
            from workers.sampling_warm_up import warm_sampling_rows

            head, k = self.model.lm_head, self.cfg.speculative.num_speculative_tokens if self.spec else 0
            n = self.cfg.scheduler.max_num_seqs
            warm_sampling_rows(
                self.state, self.arch.vocab_size, head.padded_vocab, n, k + 1 if k else 0, self.spec is None
            )
        self.reset_launch_stats()  # the stats count serving steps only
        self._precompile_tile_gemm()
        if self.graphs is None:  # enforce_eager, or a pipeline stage
            self._warm_eager_decode()
        self.arm_launch_probe()

    def _precompile_tile_gemm(self) -> None:
        """The mid-batch GEMM variants its tuning table picks for this model's weights: an
        eager step of 2-256 tokens (``enforce_eager``, a pipeline stage, ubatched halves, a
        draft's uncaptured window) would otherwise compile them while serving (graph captures
        already did theirs). FP8
        projections: the activation-quantized GEMMs above 16 rows (``kernels.fp8_linear``;
        eager and pipeline-stage steps capture nothing)."""
        draft = self.spec.draft_model if self.spec is not None else None
        uses = [
            u
            for m in (self.model, draft)
            if m is not None
            for u in (m.tile_gemm_uses() if hasattr(m, "tile_gemm_uses") else [])
        ]
        from workers.mixed_graphs import max_step_tokens

        sched = self.cfg.scheduler
        max_rows = max_step_tokens(sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len)
        fp8 = [
            (p.weight, p.weight_scale, p.bias, p.input_scale)
            for m in (self.model, draft)
            if m is not None
            for p in m.projections()
            if p.weight_scale is not None
        ]
        with torch.no_grad():  # a draft model's projections too: its uncaptured windows run eager
            self.tile_gemm_warm_launches = precompile_tile_gemm(
                uses, max_rows=max_rows, max_logit_rows=sched.max_num_seqs
            )
            if fp8 and self.device.type == "cuda":  # FP8 projections: every batch class, now
                from kernels.fp8_linear import precompile as precompile_fp8

                self.tile_gemm_warm_launches += precompile_fp8(fp8, self.dtype, max_rows)

    def _warm_eager_decode(self) -> None:
        """One scratch decode pass per eager one-token attention variant and per batch size,
        of the model and of a draft model (whose passes also run eagerly):
        ``workers.eager_warm_up``."""
        from workers.eager_warm_up import warm_eager_decode

        n = self.cfg.scheduler.max_num_seqs
        self.eager_warm_cases = warm_eager_decode(
            scratch_model(self.model, self.pp, self.dtype),
            self.kv_caches,
            n,
            self.max_model_len,
            self.block_size,
            self.device,
        )
        if self.spec is not None and self.spec.draft_model is not None:
            self.eager_warm_cases += warm_eager_decode(
                self.spec.draft_model,
                self.spec.proposer.kv_caches,
                n,
                self.spec.max_position,
                self.block_size,
                self.device,
            )

    def _scratch_request_steps(self) -> None:
        """The scratch requests' steps through ``execute`` (``workers.sampling_warm_up.
        scratch_request_plans``: the step shapes serving starts with)."""
        from workers.mixed_graphs import max_step_tokens
        from workers.sampling_warm_up import scratch_request_plans

        sched = self.cfg.scheduler
        step_cap = max_step_tokens(sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len)
        plans = scratch_request_plans(
            self.block_size, self.max_model_len, self.num_blocks, self.state.max_rows, self.arch.vocab_size, step_cap
        )
        for plan in plans:
            self.execute(plan)
        if self.device.type == "cuda":  # every step form, placing and not
            from workers.input_warm_up import warm_input_forms

            st = self.state
            warm_input_forms(st.max_model_len, st.block_table_cpu.shape[1], st.vocab, self.block_size, self.device)
        self._last_end_ev = None  # the first real step's device-idle gap starts with it

    def captures_graphs(self) -> bool:
        """Whether ``capture_cuda_graphs`` captures (a pipeline stage would need its transfers inside)."""
        return self.device.type == "cuda" and not self.cfg.enforce_eager and self.pp is None

    def graph_query_lens(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Decode graphs' query lengths: the target's (decode, k-draft verify), the draft's (1, k + 2)."""
        k = self.cfg.speculative.num_speculative_tokens if self.spec is not None else 0
        return ((1, 1 + k) if k else (1,)), (1, k + 2)

    def capture_cuda_graphs(self) -> None:
        """The decode, proposal and mixed-step CUDA graphs (``workers.graph_capture``)."""
        from workers.graph_capture import capture_cuda_graphs

        capture_cuda_graphs(self)

    # ------------------------------------------------------------- the step
    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> PendingStep:
        """Apply the plan and enqueue the step's device work; returns without waiting."""
        allocs = None
        if self._probe_cycles and plan.rows:  # diagnostics: the device is busy for a while
            torch.cuda._sleep(self._probe_cycles)
            allocs = allocator_counts()
        c0, t0 = time.thread_time(), time.perf_counter()
        pending = self._enqueue(plan, t0)
        pending.launch_s = time.perf_counter() - t0
        if plan.rows:
            cpu_ms = (time.thread_time() - c0) * 1e3
            self.launch_ms.append(pending.launch_s * 1e3)
            self.launch_cpu.append((not self._decode_graph_step, pending.launch_s * 1e3, cpu_ms))
            if not self._decode_graph_step:
                self.mixed_launch_ms.append(pending.launch_s * 1e3)
        if allocs is not None:  # (counted outside the launch's timing)
            grown = (a - b for a, b in zip(allocator_counts(), allocs))
            self.launch_allocs.append((not self._decode_graph_step, *grown))
        return pending

    def reset_launch_stats(self) -> None:
        """Forget the launch times and graph replays so far (the warm-up's, a benchmark's warm-up)."""
        for times in (self.launch_ms, self.mixed_launch_ms, self.launch_phases, self.launch_cpu, self.launch_allocs):
            times.clear()
        if self.graphs is not None:
            self.graphs.replays = 0
            self.graphs.buckets_replayed.clear()
        if self.mixed_graphs is not None:
            self.mixed_graphs.replays = 0
        if self.input_graphs is not None:
            self.input_graphs.replays = 0

    def arm_launch_probe(self) -> None:
        """``launch_wait_probe_ms``: calibrate ``torch.cuda._sleep``'s cycles per ms once,
        before serving (a deliberate wait)."""
        ms = self.cfg.launch_wait_probe_ms
        if not ms or self.device.type != "cuda":
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        self._probe_cycles = int(ms * 20_000_000 / start.elapsed_time(end))

    @torch.inference_mode()
    def _enqueue(self, plan: StepPlan, t0: float) -> PendingStep:
        st = self.state
        for h in plan.finished_handles:
            st.release(h)
        for h in plan.preempted_handles:
            st.release(h)
        # new requests: a fixed number of device operations, however many, their data riding
        # in the step inputs' copy (one host->device copy a step)
        if not plan.rows:
            st.add_many(plan.new_requests)
            return PendingStep(plan.step_id, self.tp.rank, t0)
        staged = st.stage(plan.new_requests)
        marks = [t0, time.perf_counter()]  # LAUNCH_PHASES' boundaries
        start_ev = self._record_event()
        inp = build_step_inputs(
            plan,
            st,
            self.block_size,
            self.bounds_are_exact,
            self.graphs,
            self.pad_query_lens,
            self.max_model_len,
            self.mixed_graphs,
            staged,
            commit_lengths=self.spec is None and self.pp is None,  # (drafts, stages: the old lengths read)
            input_graphs=self.input_graphs,
            eager=bool(plan.prompt_logprob_handles),
        )
        key = inp.graph_key
        self._decode_graph_step = key is not None
        marks.append(time.perf_counter())
        raw_argmax = prompt = None
        if key is not None:
            logits = self.graphs.run(inp, key)
            raw_argmax = self.graphs.last_greedy  # q = 1 graphs only: one logits row a sampling row
            if inp.pads is not None:  # a padded verify step: the real tokens' logits rows
                logits = logits[inp.logits_idx]
        elif inp.mixed_graph:  # the forward, the sampled rows' logits and their argmax: one replay
            mg = self.mixed_graphs
            logits = mg.logits(inp.input_ids, inp.positions, inp.meta, self.kv_caches, inp.logits_idx)
            raw_argmax = mg.last_greedy
        else:
            if self.pp is not None:  # a pipeline stage (no graphs): transfers around its layers
                hidden = self.pp.forward(self.model, inp, self.kv_caches, self.dtype)
                if not self.stage.is_last:
                    self.pp.pass_on(hidden, inp, st)  # stage 0 also takes the sampled tokens
                    return PendingStep(plan.step_id, self.tp.rank, t0)
            else:
                hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_caches)
            logits = self.model.compute_logits(hidden[inp.logits_idx]) if inp.handles else None
            if plan.prompt_logprob_handles:
                prompt = compute_prompt_logprobs(plan, inp, st, hidden, self.model.compute_logits, self.cfg.scheduler)
        seq_lens = inp.seq_lens  # (without a padded verify step's padding)
        self.padded_steps += inp.pads is not None
        if not inp.lengths_committed:  # (else the input kernel did)
            st.num_computed[inp.rows] = seq_lens
        marks.append(time.perf_counter())
        if not inp.handles:  # a prefill chunk short of its prompt's end: nothing to sample
            if self.spec is not None:
                self.spec.sync_draft_kv(st, inp)
            self._record_phases(key is None, marks)
            pending = PendingStep(plan.step_id, self.tp.rank, t0, prompt=prompt)
            if prompt is not None:
                pending.start_copy(self.device, self._pinned)
            return pending
        # (options read where they live, unless a proposer, a verifier or a token mask reads them)
        masks = [plan.rows[i].token_bitmask for i in inp.sample_rows_cpu] if plan.any_token_bitmask else None
        lazy = self.spec is None and masks is None
        s_rows, s_pos = sampling_rows(inp, seq_lens, wide=not lazy)
        batch = build_sampling_batch(inp.opts, st, s_rows, s_pos, inp.sample_device_rows, lazy=lazy, masks=masks)
        s_pos = batch.positions
        if inp.max_drafts:  # sampled, verified and committed (tokens, lengths, counts) on the device
            so, tokens, n_acc, known = self.spec.verify(logits, inp, batch, st, s_rows)
        else:
            so = sample(logits, batch, raw_argmax, commit=st.token_ids)  # (committed by the sampler where it can)
            # (the lengths a proposer continues from: one launch, only where one proposes)
            tokens, n_acc, known = so.token_ids[:, None], None, s_pos + 1 if self.spec is not None else None
            if not so.committed:
                self._commit_tokens(st, s_rows, s_pos, so.token_ids, count=batch.penalties is not None)
        if self.pp is not None:  # stage 0 embeds them next step: device to device, no host
            self.pp.send_tokens(tokens[:, 0])
        marks.append(time.perf_counter())
        if self.spec is not None:  # drafts for the next step, written where it reads its inputs
            self.spec.propose(st, inp, s_rows, known, batch)
        marks.append(time.perf_counter())
        pending = PendingStep(plan.step_id, self.tp.rank, t0, inp.handles, inp.opts, so, tokens, n_acc, prompt)
        pending.start_copy(self.device, self._pinned)
        marks.append(time.perf_counter())
        self._record_phases(key is None, marks)
        if start_ev is not None:
            pending.timeline = (start_ev, self._record_event(), self._last_end_ev)
            self._last_end_ev = pending.timeline[1]
        return pending

    def _record_phases(self, mixed: bool, marks: list[float]) -> None:
        """``LAUNCH_PHASES``' ms from their boundaries (the phases past the last mark: 0)."""
        marks = marks + [marks[-1]] * (len(LAUNCH_PHASES) + 1 - len(marks))
        self.launch_phases.append((mixed, *((b - a) * 1e3 for a, b in zip(marks, marks[1:]))))

    @staticmethod
    def _commit_tokens(st, s_rows, pos, tokens, count: bool = True) -> None:
        """The sampled tokens feed the next step on the device, without visiting the host.
        ``count=False`` (no row of the step has a penalty, a host-known fact) skips the
        output-token counts: only penalties read them, and a row's penalties never change.
        (Speculative steps commit inside their verification: ``SpecDecoder.verify``.)"""
        commit_tokens(st.token_ids, st.output_counts, s_rows, pos, tokens, count)

    def _record_event(self):
        if not (self.cfg.measure_device_timeline and self.device.type == "cuda"):
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self, pending: PendingStep) -> StepResult:
        return pending.result()

    def enable_ubatching(self, threshold: int) -> None:
        """Worker-side micro-batches: eager forwards over ``threshold`` tokens run as two
        overlapped halves (workers/ubatch.py). Call after CUDA-graph capture."""
        from workers.ubatch import UbatchedModel

        self.model = UbatchedModel(self.model, threshold, self.tp)
        self.mixed_graphs = None  # the split halves are the point: those steps run eagerly
