"""Persistent per-request state on the worker's device.

Each placed request owns a row. ``num_computed`` (tokens whose KV is written)
and ``token_ids`` live on the device and are advanced by the step itself, so a
token sampled at step N feeds step N+1 without visiting the host. The host only
keeps what it learned from plans: prompt lengths, block tables, sampling
parameters.
"""

from __future__ import annotations

import torch

from metadata.wire import NewRequest, SamplingOptions


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device through pinned memory, never a blocking copy."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def has_penalties(o: SamplingOptions) -> bool:
    """Whether a request's sampling reads its output-token counts (repetition, presence or
    frequency penalty); rows without them never need the counts kept."""
    return o.repetition_penalty != 1.0 or bool(o.presence_penalty) or bool(o.frequency_penalty)


class OptionTensors:
    """The device copy of the last step's per-row sampling options, with the host flags
    derived from them. Consecutive decode steps mostly sample the same requests in the
    same order, and a request's options never change, so the same ``SamplingOptions``
    objects (compared by identity: the objects the device state holds) reuse the device
    tensors instead of building and copying them again. The tensors are only ever read."""

    def __init__(self):
        self.opts: list[SamplingOptions] = []
        self.floats: tuple[torch.Tensor, ...] | None = None  # rows of [6, R]
        self.ints: tuple[torch.Tensor, ...] | None = None  # rows of [3, R]
        self.flags: dict = {}

    def get(self, opts: list[SamplingOptions], dev: torch.device) -> "OptionTensors":
        if self.floats is None or len(opts) != len(self.opts) or any(a is not b for a, b in zip(opts, self.opts)):
            self.floats = to_device(
                torch.tensor(
                    [
                        [o.temperature, o.top_p, o.min_p, o.repetition_penalty, o.presence_penalty, o.frequency_penalty]
                        for o in opts
                    ],
                    dtype=torch.float32,
                ).T.contiguous(),
                dev,
            ).unbind()
            self.ints = to_device(
                torch.tensor([[o.top_k, o.seed, o.min_tokens] for o in opts], dtype=torch.int64).T.contiguous(), dev
            ).unbind()
            self.opts = list(opts)
            self.flags = dict(
                all_greedy=all(o.temperature == 0 for o in opts),
                any_top_k_top_p=any(o.top_k > 0 or o.top_p < 1.0 for o in opts),
                any_min_p=any(o.min_p > 0 for o in opts),
                max_num_logprobs=max(o.num_logprobs for o in opts),
                any_penalties=any(has_penalties(o) for o in opts),
                any_min_tokens=any(o.min_tokens > 0 and o.min_tokens_stop_ids for o in opts),
            )
        return self


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

    def ensure_draft_probs(self, k: int) -> torch.Tensor:
        """Draft-model distributions of the drafts in flight (sampled rows need them to verify)."""
        if self.draft_probs is None or self.draft_probs.shape[1] < k:
            self.draft_probs = torch.zeros(self.max_rows, k, self.vocab, dtype=torch.float32, device=self.device)
        return self.draft_probs

    def write_host_drafts(self, row: int, start: int, drafts: list[int]) -> None:
        """Host-proposed drafts (``ngram_host``, exact lengths) go where the step reads its inputs."""
        end = min(start + len(drafts), self.token_ids.shape[1])
        if end > start:
            self.token_ids[row, start:end] = to_device(
                torch.tensor(drafts[: end - start], dtype=torch.int64), self.device
            )

    # ----------------------------------------------------------- lifecycle
    def add(self, req: NewRequest) -> None:
        if req.handle in self.row_of:
            raise RuntimeError(f"request handle {req.handle} is already placed")
        if not self.free_rows:
            raise RuntimeError("no free request rows on the worker (max_num_seqs exceeded)")
        row = self.free_rows.pop()
        self.row_of[req.handle] = row
        tokens = req.prompt_token_ids + req.output_token_ids
        if len(tokens) > self.max_model_len:
            raise RuntimeError(f"request {req.handle} has {len(tokens)} tokens > max_model_len")
        self.token_ids[row, : len(tokens)] = to_device(torch.tensor(tokens, dtype=torch.int64), self.device)
        # fill_ on a view launches a kernel; item assignment would copy a host scalar (a sync)
        self.num_computed[row : row + 1].fill_(req.num_cached_tokens)
        self.prompt_len[row : row + 1].fill_(len(req.prompt_token_ids))
        self.num_blocks_cpu[row] = 0
        self.append_blocks(row, req.block_ids)
        self.sampling[row] = req.sampling
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        self.prompt_mask[row].index_fill_(0, self.token_ids[row, : len(req.prompt_token_ids)], True)
        if req.output_token_ids:
            out = self.token_ids[row, len(req.prompt_token_ids) : len(tokens)]
            self.output_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

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
        self.block_table_cpu[row, n : n + len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks_cpu[row] = n + len(block_ids)
