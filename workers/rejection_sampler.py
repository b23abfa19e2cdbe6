"""Verification of speculative drafts on the device (Leviathan et al. 2023).

A row carrying ``k`` drafts ``d_1..d_k`` gets target logits at ``k + 1``
positions. Slot ``j < k`` checks draft ``d_{j+1}``:

* greedy rows accept iff ``argmax(target_j) == d_{j+1}`` and otherwise emit that
  argmax, so the output equals plain greedy decoding token for token;
* sampled rows accept with probability ``min(1, p(d) / q(d))`` and on rejection
  draw from ``norm(max(0, p - q))``; ``q`` is the draft model's distribution or,
  for n-gram proposals, a point mass on the draft. The emitted tokens then
  follow the target distribution exactly.

The first rejected slot ``a`` emits its recovered token; when every draft
passes, the bonus token comes from the ordinary sampler at slot ``k`` (which
the caller runs anyway). All shapes are fixed by host-known draft counts, so
nothing here waits on the device; randomness is the counter hash of
``workers.sampler`` on separate streams, so seeded requests stay reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ops import exponential_race, uniform_rows
from workers.sampler import sampling_probs

# XOR-ed into a request seed to give each random stream its own key
STREAM_ACCEPT = 0x5EC0_0001
STREAM_RECOVER = 0x5EC0_0002
STREAM_DRAFT = 0x5EC0_0003


@dataclass
class SpecRows:
    """The speculative rows of one step, padded to ``K`` = the step's largest draft count."""

    logits: torch.Tensor  # float32 [R, K, V]: target logits at slots 0..K-1
    draft_tokens: torch.Tensor  # int64 [R, K]
    num_drafts: torch.Tensor  # int64 [R] on the device (host-known values)
    draft_probs: torch.Tensor | None  # float32 [R, K, V] (draft model, sampled rows) or None: point mass
    temperature: torch.Tensor  # float32 [R]
    top_k: torch.Tensor  # int64 [R]
    top_p: torch.Tensor  # float32 [R]
    min_p: torch.Tensor  # float32 [R]
    seeds: torch.Tensor  # int64 [R]
    positions: torch.Tensor  # int64 [R]: position of slot 0's token (first draft's position)
    all_greedy: bool
    any_top_k_top_p: bool
    any_min_p: bool


def _flat(x: torch.Tensor, k: int) -> torch.Tensor:
    return x[:, None].expand(-1, k).reshape(-1)


def verify_drafts(rows: SpecRows, bonus_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(tokens [R, K + 1], num_accepted [R])``: the first ``num_accepted + 1``
    tokens of a row are its output (accepted drafts, then the recovered or bonus token)."""
    R, K, V = rows.logits.shape
    dev = rows.logits.device
    slot = torch.arange(K, device=dev)[None, :]
    valid = slot < rows.num_drafts[:, None]
    target_argmax = rows.logits.argmax(dim=-1)  # [R, K]
    greedy_accept = target_argmax == rows.draft_tokens
    if rows.all_greedy:
        accept, recovered = greedy_accept, target_argmax
    else:
        accept, recovered = _sampled_verify(rows, K, V)
        is_greedy = (rows.temperature == 0)[:, None]
        accept = torch.where(is_greedy, greedy_accept, accept)
        recovered = torch.where(is_greedy, target_argmax, recovered)
    accept = accept & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepted slots
    tokens = torch.cat([rows.draft_tokens, bonus_tokens[:, None]], dim=1)  # [R, K + 1]
    at = torch.arange(K + 1, device=dev)[None, :]
    fallback = torch.cat([recovered, bonus_tokens[:, None]], dim=1)
    # slot a: recovered token if a < k (a rejected draft), else the bonus token
    last = torch.where(num_accepted < rows.num_drafts, fallback.gather(1, num_accepted[:, None])[:, 0], bonus_tokens)
    tokens = torch.where(at == num_accepted[:, None], last[:, None], tokens)
    return tokens, num_accepted


def _sampled_verify(rows: SpecRows, K: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    R_K = rows.logits.shape[0] * K
    flat_logits = rows.logits.reshape(R_K, V)
    p = sampling_probs(
        flat_logits,
        _flat(rows.temperature, K),
        _flat(rows.top_k, K),
        _flat(rows.top_p, K),
        _flat(rows.min_p, K),
        rows.any_top_k_top_p,
        rows.any_min_p,
    )
    p = p / p.sum(dim=-1, keepdim=True)  # min-p leaves the mass unnormalised
    d = rows.draft_tokens.reshape(R_K, 1)
    p_d = p.gather(1, d)[:, 0]
    seeds = _flat(rows.seeds, K)
    pos = (rows.positions[:, None] + torch.arange(K, device=p.device)[None, :]).reshape(-1)
    if rows.draft_probs is None:  # point mass on the draft
        q_d = torch.ones_like(p_d)
        residual = p.scatter(1, d, 0.0)
    else:
        q = rows.draft_probs.reshape(R_K, V)
        q_d = q.gather(1, d)[:, 0]
        residual = (p - q).clamp_min(0.0)
    # if p == q the residual is empty, but then rejection has probability 0: fall back to p
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    u = uniform_rows(seeds ^ STREAM_ACCEPT, pos)
    accept = u * q_d < p_d
    recovered = exponential_race(residual, seeds ^ STREAM_RECOVER, pos)
    return accept.reshape(-1, K), recovered.reshape(-1, K)


def reference_verify(
    p: torch.Tensor,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    num_drafts: int,
    bonus_p: torch.Tensor,
    gen: torch.Generator,
) -> list[int]:
    """Plain-python rejection sampling of one row (test oracle): ``p`` [K, V] normalised
    target probs, ``q`` [K, V] draft probs or None (point mass), ``bonus_p`` [V]."""
    out = []
    for j in range(num_drafts):
        d = int(drafts[j])
        qd = 1.0 if q is None else float(q[j, d])
        if torch.rand((), generator=gen).item() * qd < float(p[j, d]):
            out.append(d)
            continue
        res = p[j].clone()
        if q is None:
            res[d] = 0.0
        else:
            res = (p[j] - q[j]).clamp_min(0.0)
        if res.sum() <= 0:
            res = p[j]
        out.append(int(torch.multinomial(res / res.sum(), 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(bonus_p, 1, generator=gen)))
    return out
