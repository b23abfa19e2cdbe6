"""Per-step ``SamplingBatch`` from the sampling rows' options (host-known) and device state."""

from __future__ import annotations

import torch

from metadata.wire import SamplingOptions
from workers.device_state import DeviceState, to_device
from workers.sampler import PenaltyBatch, SamplingBatch


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
        if (self.floats is None or len(opts) != len(self.opts)
                or any(a is not b for a, b in zip(opts, self.opts))):
            self.floats = to_device(torch.tensor(
                [[o.temperature, o.top_p, o.min_p, o.repetition_penalty, o.presence_penalty,
                  o.frequency_penalty] for o in opts], dtype=torch.float32).T.contiguous(), dev).unbind()
            self.ints = to_device(torch.tensor([[o.top_k, o.seed, o.min_tokens] for o in opts],
                                               dtype=torch.int64).T.contiguous(), dev).unbind()
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


def build_sampling_batch(opts: list[SamplingOptions], st: DeviceState, s_rows: torch.Tensor,
                         s_pos: torch.Tensor) -> SamplingBatch:
    dev = st.device
    cached = st.option_tensors.get(opts, dev)
    flags = cached.flags
    temperature, top_p, min_p, rep, pres, freq = cached.floats
    top_k, seeds, min_tokens = cached.ints
    penalties = None
    if flags["any_penalties"]:
        penalties = PenaltyBatch(repetition=rep, presence=pres, frequency=freq,
                                 output_counts=st.output_counts[s_rows], prompt_mask=st.prompt_mask[s_rows])
    mask = None
    if flags["any_min_tokens"]:
        ri, ids = [], []
        for i, o in enumerate(opts):
            if o.min_tokens > 0:
                ri += [i] * len(o.min_tokens_stop_ids)
                ids += o.min_tokens_stop_ids
        idx = to_device(torch.tensor([ri, ids], dtype=torch.int64), dev)
        mask = torch.zeros(len(opts), st.vocab, dtype=torch.bool, device=dev)
        mask[idx[0], idx[1].clamp(max=st.vocab - 1)] = True
        out_len = s_pos - st.prompt_len[s_rows].long()  # outputs before this token (device)
        mask &= (out_len < min_tokens)[:, None]
    return SamplingBatch(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seeds=seeds, positions=s_pos,
        all_greedy=flags["all_greedy"], any_top_k_top_p=flags["any_top_k_top_p"],
        any_min_p=flags["any_min_p"], penalties=penalties, min_tokens_mask=mask,
        max_num_logprobs=flags["max_num_logprobs"],
    )
