"""Device-side sampling: penalties, min_tokens, temperature, top-k/top-p/min-p, seeded draws.

Randomness is a counter-based hash of (request seed, token position, token id),
so a seeded request draws the same tokens whatever else is in the batch, after
preemption, and on any number of ranks. The draw is an exponential race
(argmax p / E, E ~ Exp(1)), the Gumbel-max trick in probability space. Nothing
here reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ops import argmax, exponential_race, sample_logits


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step (device tensors unless noted). With
    ``option_rows`` set the per-row options were not gathered (None): the temperature
    sampler reads them from ``option_words`` at those device rows."""

    temperature: torch.Tensor | None  # float32 [R]
    top_p: torch.Tensor | None  # float32 [R]
    top_k: torch.Tensor | None  # int64 [R], 0 = off
    min_p: torch.Tensor | None  # float32 [R]
    seeds: torch.Tensor | None  # int64 [R]
    positions: torch.Tensor  # int64 [R] (int32 where option_rows is set): position the sampled token takes
    all_greedy: bool  # CPU flags, from the request parameters
    any_top_k_top_p: bool
    any_min_p: bool
    penalties: "PenaltyBatch | None" = None
    min_tokens_mask: torch.Tensor | None = None  # bool [R, V]: ids to forbid now
    max_num_logprobs: int = -1  # CPU: -1 none
    sample_temperature: torch.Tensor | None = None  # float32 [R]: temperature, 1 where 0 (None: derived)
    option_words: tuple | None = None  # the divisor, temperature and seed word rows (DeviceState.sampler_words)
    option_rows: torch.Tensor | None = None  # int64 [>= R]: each row's device row, where not gathered
    logit_bias: tuple | None = None  # (rows int64 [N], ids int64 [N], biases float32 [N]) added first
    allowed: tuple | None = None  # (rows int64 [C], bool [C, V]): the ids constrained rows may take


@dataclass
class PenaltyBatch:
    repetition: torch.Tensor  # float32 [R]
    presence: torch.Tensor
    frequency: torch.Tensor
    output_counts: torch.Tensor  # int32 [R, V]
    prompt_mask: torch.Tensor  # bool [R, V]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [R]
    sampled_logprob: torch.Tensor | None = None  # float32 [R]
    sampled_rank: torch.Tensor | None = None  # int64 [R]
    top_ids: torch.Tensor | None = None  # int64 [R, k]
    top_logprobs: torch.Tensor | None = None  # float32 [R, k]
    committed: bool = False  # the tokens are already in the token table (``sample``'s ``commit``)


def apply_penalties(logits: torch.Tensor, p: PenaltyBatch) -> torch.Tensor:
    seen = (p.output_counts > 0) | p.prompt_mask
    rep = p.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = p.output_counts.to(logits.dtype)
    logits = logits - p.frequency[:, None] * counts
    return logits - p.presence[:, None] * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    # keep the smallest prefix whose mass reaches top_p: a token is dropped once the
    # tokens above it already hold top_p (top_p = 1 keeps everything, however tiny)
    drop = drop | ((before >= top_p[:, None]) & (top_p[:, None] < 1.0))
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_divisor(temperature: torch.Tensor, sample_temperature: torch.Tensor | None) -> torch.Tensor:
    """What a row's logits are divided by: its temperature, 1 where greedy (``sample_temperature``:
    that, precomputed with the options; else derived, one launch)."""
    if sample_temperature is not None:
        return sample_temperature
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    any_top_k_top_p: bool,
    any_min_p: bool,
    sample_temperature: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution a non-greedy row samples from: temperature, top-k/top-p, min-p.

    Rows with temperature 0 are computed at temperature 1 (callers pick argmax for them);
    ``sample_temperature``: that divisor, precomputed (``SamplingBatch``: no launches).
    min-p zeroes tokens without renormalising: every consumer (the exponential race,
    the rejection sampler's ratios) is invariant to a per-row scale.
    """
    scaled = logits / sampling_divisor(temperature, sample_temperature)[:, None]
    if any_top_k_top_p:
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    if any_min_p:
        thresh = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < thresh, 0.0)
    return probs


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    raw_argmax: torch.Tensor | None = None,
    commit: torch.Tensor | None = None,
) -> SamplerOutput:
    """Sample one token per row of ``logits`` [R, V] (float32). ``raw_argmax``: the argmax of
    these very logits, already computed (inside a decode CUDA graph); used only where no
    penalty or min_tokens mask changes the logits first. ``commit`` (the token table): where
    the temperature sampler reads the option table, it also writes each row's token at
    ``commit[option_rows[r], positions[r]]`` (``SamplerOutput.committed``)."""
    raw = logits
    if batch.logit_bias is not None:
        r, ids, v = batch.logit_bias
        logits = logits.index_put((r, ids), v, accumulate=True)
    if batch.allowed is not None:  # (structured outputs: only the constrained rows)
        rows, allowed = batch.allowed
        logits = logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    if batch.min_tokens_mask is not None:
        logits = logits.masked_fill(batch.min_tokens_mask, float("-inf"))
    if raw_argmax is not None and logits is raw:
        greedy_ids = raw_argmax
    else:
        greedy_ids = argmax(logits)
    if batch.all_greedy:
        token_ids = greedy_ids
    elif batch.option_rows is not None:  # temperature only, the options read where they live
        div, temp, seeds = batch.option_words
        token_ids = sample_logits(
            logits, div, temp, seeds, batch.positions, greedy_ids, option_rows=batch.option_rows, commit=commit
        )
    elif not (batch.any_top_k_top_p or batch.any_min_p):  # temperature only: straight from the logits
        divisor = sampling_divisor(batch.temperature, batch.sample_temperature)
        token_ids = sample_logits(logits, divisor, batch.temperature, batch.seeds, batch.positions, greedy_ids)
    else:
        probs = sampling_probs(
            logits,
            batch.temperature,
            batch.top_k,
            batch.top_p,
            batch.min_p,
            batch.any_top_k_top_p,
            batch.any_min_p,
            batch.sample_temperature,
        )
        sampled = exponential_race(probs, batch.seeds, batch.positions)
        token_ids = torch.where(batch.temperature > 0, sampled, greedy_ids)
    committed = batch.option_rows is not None and commit is not None and not batch.all_greedy
    return _with_logprobs(SamplerOutput(token_ids=token_ids, committed=committed), raw, batch.max_num_logprobs)


def commit_tokens(token_ids, output_counts, rows, pos, tokens, count: bool = True) -> None:
    """The sampled ``tokens`` written at ``token_ids[rows, pos]`` (where the sampler did not
    commit them itself: ``SamplerOutput.committed``), and counted in ``output_counts`` with
    ``count`` (a penalty row in the step: only penalties read the counts)."""
    token_ids[rows, pos] = tokens
    if count:
        output_counts[rows, tokens] += 1


def _with_logprobs(out: SamplerOutput, raw: torch.Tensor, max_num_logprobs: int) -> SamplerOutput:
    """``out`` with the sampled tokens' logprobs and ranks under the unmodified logits ``raw``,
    and the top ``max_num_logprobs`` (none at -1)."""
    if max_num_logprobs >= 0:
        logp = raw.log_softmax(dim=-1)
        chosen = logp.gather(-1, out.token_ids[:, None])
        out.sampled_logprob = chosen[:, 0]
        out.sampled_rank = (logp > chosen).sum(dim=-1) + 1
        if max_num_logprobs > 0:
            out.top_logprobs, out.top_ids = logp.topk(max_num_logprobs, dim=-1)
    return out
