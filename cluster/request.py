"""Driver-side request state."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field

from metadata.sampling_params import SamplingParams
from metadata.wire import SamplingOptions, token_bytes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    """One generated sequence (a ``n > 1`` request is ``n`` of these).

    ``num_computed_tokens`` counts tokens scheduled into the KV cache, including
    steps still in flight; ``num_placeholders`` counts sampled tokens still in
    flight. Both are exact without speculative decoding; with it they become
    upper bounds, reconciled when a ``StepResult`` arrives.

    Prefix caching: ``num_confirmed_kv`` counts leading tokens whose KV finished
    steps (or a cache hit) wrote for the current placement ``kv_handle``;
    ``block_hashes`` are the chained hashes of its full blocks of confirmed
    tokens; the first ``num_committed_blocks`` of ``block_ids`` are cached.
    """

    request_id: str
    parent_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    options: SamplingOptions
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    extra_stop_ids: tuple[int, ...] = ()
    """Stop tokens the model's generation config adds (``cluster.generation_config``): they
    finish a request as its ``stop_token_ids`` do, naming the token (as vLLM reports them)."""
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0  # (SamplingParams.priority; the scheduler orders by it under 'priority')
    order: int = 0  # arrival rank, set by the scheduler: ties in priority go first come, first served
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With ``params.prompt_logprobs``: one entry a prompt token, the first None (as vLLM);
    complete once it is as long as the prompt (filled chunk by chunk by the scheduler)."""
    cumulative_logprob: float = 0.0
    grammar: object = None
    """With ``params.structured_outputs``: its matcher (``cluster.structured_output.RequestGrammar``)."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_placeholders: int = 0
    block_ids: list[int] = field(default_factory=list)
    handle: int = -1  # current placement on the workers; -1 = not placed
    kv_handle: int = -1  # placement whose KV ``block_ids`` hold (outlives ``handle`` until freed)
    num_confirmed_kv: int = 0
    num_committed_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    emitted_chars: int = 0  # text already streamed
    first_token_time: float | None = None
    last_token_time: float | None = None

    @functools.cached_property
    def prompt_wire(self) -> bytes:
        """The prompt as ``NewRequest`` carries it (``token_bytes``; built once: a prompt never
        changes, and a preempted request is placed again)."""
        return token_bytes(self.prompt_token_ids)

    @property
    def num_tokens_upper(self) -> int:
        """Prompt + confirmed outputs + in-flight samples: what the KV cache must hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all of them known yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_outputs_upper(self) -> int:
        return len(self.output_token_ids) + self.num_placeholders

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
