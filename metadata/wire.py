"""Per-step wire structs: ``StepPlan`` (driver -> every worker) and ``StepResult`` back.

A request's full data crosses once, in ``NewRequest``; afterwards a step carries
only deltas. There is deliberately no exact CPU sequence-length field: a row
carries its query length and ``seq_len_upper_bound``, which is exact without
speculative decoding and optimistic (all drafts accepted) with it. Workers keep
the exact lengths on the device.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable

import msgspec

BIG_ENDIAN_HOST = sys.byteorder == "big"


def token_bytes(ids: Iterable[int]) -> bytes:
    """Token ids as ``NewRequest`` carries them: little-endian int64 words. A worker decodes
    them without a Python int a token and stages them with one copy (``token_words``)."""
    a = array.array("q", ids)
    if BIG_ENDIAN_HOST:
        a.byteswap()
    return a.tobytes()


def token_words(*parts: bytes) -> array.array:
    """The token ids of ``token_bytes`` parts, concatenated, as an ``array('q')``."""
    a = array.array("q")
    for part in parts:
        a.frombytes(part)
    if BIG_ENDIAN_HOST:
        a.byteswap()
    return a


class SamplingOptions(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The device-side part of a request's sampling parameters (validated by the driver)."""

    temperature: float
    top_p: float
    top_k: int  # 0 = disabled
    min_p: float
    seed: int  # always set: the driver draws one for unseeded requests
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    min_tokens_stop_ids: list[int]  # ids masked until min_tokens outputs exist
    num_logprobs: int  # -1 = none, 0 = sampled token only, k = sampled + top k
    num_prompt_logprobs: int = -1  # the same for each prompt token (StepPlan.prompt_logprob_handles)
    logit_bias_ids: list[int] = []  # added to these ids' logits before sampling ...
    logit_bias_values: list[float] = []  # ... these values
    allowed_token_ids: list[int] = []  # sample only among these (empty: every id)
    banned_token_ids: list[int] = []  # never sample these (one-token bad words)


class NewRequest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Sent once when a request (or a preempted request resuming) is placed on the workers."""

    handle: int  # driver-assigned id, unique per placement
    prompt_words: bytes  # the prompt's token ids as little-endian int64 words (token_bytes)
    output_words: bytes  # the same of the confirmed outputs to recompute after preemption
    sampling: SamplingOptions
    block_ids: list[int]
    num_cached_tokens: int = 0  # leading tokens whose KV is already cached (prefix cache hit; exact)

    @classmethod
    def of(
        cls,
        handle: int,
        prompt: Iterable[int],
        outputs: Iterable[int],
        sampling: SamplingOptions,
        block_ids: list[int],
        num_cached_tokens: int = 0,
    ) -> "NewRequest":
        """A ``NewRequest`` from token id lists."""
        return cls(handle, token_bytes(prompt), token_bytes(outputs), sampling, block_ids, num_cached_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_words) // 8

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_words) // 8

    def token_ids(self) -> tuple[list[int], list[int]]:
        """(prompt, outputs) as lists of ints (readers off the hot path)."""
        return token_words(self.prompt_words).tolist(), token_words(self.output_words).tolist()


class ScheduledRow(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One request's share of a step; rows appear in batch order."""

    handle: int
    num_scheduled_tokens: int  # query length of this row in this step
    seq_len_upper_bound: int  # >= the device seq_len after this step's tokens
    new_block_ids: list[int]  # appended to the row's block table before the step
    sample: bool  # False for a prefill chunk that does not reach the prompt's end
    num_draft_tokens: int = 0  # speculative: the last this-many scheduled tokens are drafts
    draft_token_ids: list[int] = []  # host-proposed drafts (ngram_host); else drafts stay on the device
    token_bitmask: bytes = b""  # a constrained sampling row: the ids allowed (int32 words, bit i = id i)


class StepPlan(msgspec.Struct, forbid_unknown_fields=True):
    step_id: int
    prev_step_id: int = 0
    """The plan sent to the workers just before this one (0: the first since they started).
    Calls into an async Ray actor may start out of order; workers run plans by this chain."""
    new_requests: list[NewRequest] = []
    rows: list[ScheduledRow] = []
    finished_handles: list[int] = []  # finished or aborted: release the worker's row
    preempted_handles: list[int] = []  # preempted: release; may return as a NewRequest
    any_token_bitmask: bool = False  # some row carries a token_bitmask
    prompt_logprob_handles: list[int] = []
    """Rows whose every scheduled token's logits are wanted (prompt logprobs of the next
    token, ``StepResult.prompt_logprobs``); a step with any runs eagerly."""
    shutdown: bool = False


class TokenLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    sampled_logprob: float
    sampled_rank: int  # 1-based rank of the sampled token
    top_token_ids: list[int]
    top_logprobs: list[float]


class SampledRow(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    handle: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


class PromptLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One row's scheduled tokens, in order: for each, the logprob of the token after it in the
    row's token table (``sampled_*``: the prompt's next token), and the row's top k."""

    handle: int
    entries: list[TokenLogprobs]


class StepStats(msgspec.Struct, forbid_unknown_fields=True):
    """How long one step took on the worker. Rides in the result's envelope for the engine's
    statistics; the scheduler never reads it."""

    worker_time_s: float = 0.0  # launch start to result encoded, on the worker's clock
    host_launch_s: float = 0.0  # worker CPU time spent preparing and enqueueing the step
    device_step_s: float = -1.0  # GPU time of this step (measure_device_timeline only)
    device_idle_before_s: float = -1.0  # GPU idle between the previous step's end and this one's start


class StepResult(msgspec.Struct, forbid_unknown_fields=True):
    """What one step produced (rank 0's rows; other ranks report only ``error``)."""

    step_id: int
    outputs: list[SampledRow] = []
    prompt_logprobs: list[PromptLogprobs] = []
    error: str | None = None
    rank: int = 0
    stats: StepStats = msgspec.field(default_factory=StepStats)


_plan_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_result_decoder = msgspec.msgpack.Decoder(StepResult)


def encode(obj: StepPlan | StepResult) -> bytes:
    return _plan_encoder.encode(obj)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_decoder.decode(data)


def decode_result(data: bytes) -> StepResult:
    return _result_decoder.decode(data)
