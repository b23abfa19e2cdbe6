"""A launched step on its way to the host: the sampled tokens' copy to pinned memory
(``PendingStep``) and the reused pinned buffers it copies into (``PinnedPool``)."""

from __future__ import annotations

import time

import torch

from metadata.wire import SampledRow, StepResult, TokenLogprobs


class PinnedPool:
    """Pinned host buffers (with their CUDA event) for the sampled tokens' copy, reused step
    after step: a fresh pinned tensor and event cost the host more than the copy itself. A
    buffer comes back only from ``PendingStep.result``, after its event was waited for and
    its contents read, so no copy can still be writing into a buffer handed out again."""

    def __init__(self):
        self._free: dict[tuple[int, torch.dtype], list] = {}

    def take(self, numel: int, dtype: torch.dtype):
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, pin_memory=True), torch.cuda.Event()

    def give(self, buf, event) -> None:
        free = self._free.setdefault((buf.numel(), buf.dtype), [])
        if len(free) < 8:  # at most a few steps are in flight; drop the rest
            free.append((buf, event))


def pack_outputs(tokens: torch.Tensor, n_acc: torch.Tensor | None, so) -> tuple[torch.Tensor, list[int]]:
    """What a step returns to the host, in one tensor for one copy, and its parts' sizes: the
    tokens [S, W] as they are; with accepted-draft counts or logprobs, every part as float64
    (exact for ids below 2^53) concatenated (``so``: the ``SamplerOutput``)."""
    if n_acc is None and so.sampled_logprob is None:  # tokens only: copied as they are
        packed = tokens.flatten()
        return packed, [packed.numel()]
    parts = [tokens.double().flatten()]
    if n_acc is not None:
        parts.append(n_acc.double())
    if so.sampled_logprob is not None:
        parts += [so.sampled_logprob.double(), so.sampled_rank.double()]
        if so.top_ids is not None:
            parts += [so.top_ids.double().flatten(), so.top_logprobs.double().flatten()]
    return torch.cat(parts), [t.numel() for t in parts]


class PendingStep:
    """A launched step whose sampled tokens are being copied to pinned host memory."""

    def __init__(
        self, step_id: int, rank: int, t0: float, handles=None, opts=None, so=None, tokens=None, n_acc=None, prompt=None
    ):
        self.step_id, self.rank, self.t0 = step_id, rank, t0
        self.handles, self.opts, self.so = handles or [], opts or [], so
        self.tokens, self.n_acc = tokens, n_acc  # [S, W] emitted tokens, [S] accepted drafts
        self.prompt = prompt  # a PromptLogprobsPart (workers.prompt_logprobs), copied alike
        self.prompt_host = None
        self.event = None
        self.pool: PinnedPool | None = None  # where host_packed returns once read
        self.launch_s = 0.0  # host time of launch(), set when it returns
        self.timeline = None  # (start, end, previous step's end) CUDA events

    def start_copy(self, device: torch.device, pool: PinnedPool) -> None:
        """The step's outputs (sampled tokens, prompt logprobs: whichever it has) on their way
        to pinned host memory, behind one event."""
        packed = None
        if self.so is not None:
            packed, self.sizes = pack_outputs(self.tokens, self.n_acc, self.so)
        if device.type == "cpu":
            self.host_packed = packed
            self.prompt_host = self.prompt.packed if self.prompt is not None else None
            return
        if self.prompt is not None:  # (rare: an eager step; its own buffer, not pooled)
            self.prompt_host = torch.empty(self.prompt.packed.shape, dtype=torch.float64, pin_memory=True)
            self.prompt_host.copy_(self.prompt.packed, non_blocking=True)
        if packed is not None:
            self.host_packed, self.event = pool.take(packed.numel(), packed.dtype)
            self.pool = pool
            self.host_packed.copy_(packed, non_blocking=True)
        else:
            self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> StepResult:
        if self.event is not None:
            from workers.sync_check import allow_sync

            with allow_sync("the sampled tokens' copy to pinned host memory"):
                self.event.synchronize()  # the step's one deliberate wait
        out = StepResult(step_id=self.step_id, rank=self.rank)
        if self.prompt is not None:
            out.prompt_logprobs = self.prompt.entries(self.prompt_host)
        if self.so is not None:
            host = list(torch.split(self.host_packed, self.sizes))
            width = self.tokens.shape[1]
            tok = host[0].long().view(-1, width).tolist()
            if self.n_acc is not None:
                n_acc = host.pop(1).long().tolist()
            else:
                n_acc = [0] * len(self.handles)
            kmax = self.so.top_ids.shape[1] if self.so.top_ids is not None else 0
            for i, h in enumerate(self.handles):
                lp = None
                k = self.opts[i].num_logprobs
                if k >= 0 and len(host) > 1:
                    top_ids = host[3][i * kmax : i * kmax + k].long().tolist() if k else []
                    top_lp = host[4][i * kmax : i * kmax + k].tolist() if k else []
                    lp = [TokenLogprobs(float(host[1][i]), int(host[2][i]), top_ids, top_lp)]
                out.outputs.append(SampledRow(handle=h, token_ids=tok[i][: n_acc[i] + 1], logprobs=lp))
            if self.pool is not None:  # waited for and read: the buffer may be reused
                self.pool.give(self.host_packed, self.event)
                # they may belong to a later step now: a second result() must fail, not read them
                self.pool = self.host_packed = self.event = None
        st = out.stats
        st.worker_time_s = time.perf_counter() - self.t0
        st.host_launch_s = self.launch_s
        if self.timeline is not None:  # all three events have completed: no wait here
            start, end, prev_end = self.timeline
            st.device_step_s = start.elapsed_time(end) / 1e3
            if prev_end is not None:
                st.device_idle_before_s = prev_end.elapsed_time(start) / 1e3
        return out
