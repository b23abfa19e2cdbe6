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
On CUDA the whole verification and its commit are two launches
(``kernels.spec_verify``): a step's launch must stay far below the device's
launch-queue depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ops import argmax
from kernels.spec_ops import accept_commit, verify_slots
from workers.sampler import sampling_probs


@dataclass
class SpecRows:
    """The speculative rows of one step, ``K`` = the step's largest draft count."""

    logits: torch.Tensor  # [N, V] the step's target logits (any float dtype)
    spec_idx: torch.Tensor  # int64 [R, K]: row of ``logits`` of each draft slot (clamped)
    input_ids: torch.Tensor  # int64 [T]: the step's input tokens, drafts among them
    draft_idx: torch.Tensor  # int64 [R, K]: index in ``input_ids`` of each draft (clamped)
    num_drafts: torch.Tensor  # int64 [R] on the device (host-known values)
    positions: torch.Tensor  # int64 [R]: position of the row's sampled token (last draft's + 1)
    temperature: torch.Tensor  # float32 [R]
    top_k: torch.Tensor  # int64 [R]
    top_p: torch.Tensor  # float32 [R]
    min_p: torch.Tensor  # float32 [R]
    seeds: torch.Tensor  # int64 [R]
    draft_probs: torch.Tensor | None  # float32 [rows, >= K, V] (draft model, sampled rows) or None: point mass
    draft_rows: torch.Tensor | None  # int64 [R]: each row's entry of ``draft_probs``
    any_top_k_top_p: bool
    any_min_p: bool


def verify_slots_of(rows: SpecRows, bonus_idx: torch.Tensor | None = None):
    """``(accept int8 [R, K], recovered int64 [R, K], bonus [R] or None)``, one launch on CUDA;
    ``bonus_idx``: also sample each row's bonus token from ``logits[bonus_idx]`` (only for
    rows without top-k, top-p or min-p, which get their target distributions from
    ``sampling_probs`` first)."""
    if not (rows.any_top_k_top_p or rows.any_min_p):
        return verify_slots(
            rows.logits, rows.spec_idx, rows.input_ids, rows.draft_idx, rows.num_drafts, rows.temperature,
            rows.seeds, rows.positions, rows.draft_probs, rows.draft_rows, bonus_idx=bonus_idx,
        )  # fmt: skip
    if bonus_idx is not None:
        raise ValueError("top-k / top-p / min-p rows take their bonus token from workers.sampler.sample")
    R, K = rows.spec_idx.shape

    def flat(x):
        return x.repeat_interleave(K)

    x = rows.logits[rows.spec_idx.reshape(-1)].float()  # [R * K, V]: each slot's target logits
    p = sampling_probs(
        x,
        flat(rows.temperature),
        flat(rows.top_k),
        flat(rows.top_p),
        flat(rows.min_p),
        rows.any_top_k_top_p,
        rows.any_min_p,
    )
    idx = torch.arange(R * K, device=p.device).view(R, K)
    accept, recovered, _ = verify_slots(
        p, idx, rows.input_ids, rows.draft_idx, rows.num_drafts, rows.temperature, rows.seeds, rows.positions,
        rows.draft_probs, rows.draft_rows, probs=True,
    )  # fmt: skip
    # greedy rows check the argmax of the logits themselves, as plain greedy decoding does
    # (two logits may round to one probability, and then the lower id would win)
    greedy = argmax(x).view(R, K)
    valid = torch.arange(K, device=p.device)[None, :] < rows.num_drafts[:, None]
    is_greedy = (rows.temperature == 0)[:, None]
    hit = (greedy == rows.input_ids[rows.draft_idx]) & valid
    accept = torch.where(is_greedy, hit.to(accept.dtype), accept)
    return accept, torch.where(is_greedy & valid, greedy, recovered), None


def verify_and_commit(
    rows: SpecRows,
    bonus: torch.Tensor | None,
    state_rows: torch.Tensor,
    token_table: torch.Tensor,
    num_computed: torch.Tensor,
    output_counts: torch.Tensor | None,
    bonus_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verifies the drafts and commits each row's output on the device (``kernels.spec_verify``):
    ``(bonus [R], tokens [R, K + 1], num_accepted [R], known [R])``; the first
    ``num_accepted + 1`` tokens of a row are its output (accepted drafts, then the recovered or
    bonus token). ``bonus`` None: sampled in the verify launch from ``logits[bonus_idx]``."""
    accept, recovered, drawn = verify_slots_of(rows, bonus_idx if bonus is None else None)
    bonus = drawn if bonus is None else bonus
    return (bonus,) + accept_commit(
        accept, recovered, rows.input_ids, rows.draft_idx, rows.num_drafts, bonus, rows.positions, state_rows,
        token_table, num_computed, output_counts,
    )  # fmt: skip


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
