"""Prompt logprobs: the logits of every scheduled token of the rows a plan names
(``StepPlan.prompt_logprob_handles``), each scored against the token after it in the row's
token table (the prompt's next token), computed on the device in slices after an eager
forward and copied to the host with the step's sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from metadata.wire import PromptLogprobs, StepPlan, TokenLogprobs


@dataclass
class PromptLogprobsPart:
    """One step's prompt logprobs on the device: ``packed`` (float64) holds every scored
    token's logprob, then their ranks, then ``kmax`` top ids and top logprobs per token."""

    handles: list[int]
    counts: list[int]  # scored tokens per handle, in order
    ks: list[int]  # top logprobs each handle asked for
    kmax: int
    packed: torch.Tensor

    def entries(self, host: torch.Tensor) -> list[PromptLogprobs]:
        """The rows' ``PromptLogprobs`` from ``packed``'s host copy."""
        n = sum(self.counts)
        chosen, ranks = host[:n].tolist(), host[n : 2 * n].long().tolist()
        top_ids = host[2 * n : 2 * n + n * self.kmax].long().view(n, self.kmax).tolist()
        top_lps = host[2 * n + n * self.kmax :].view(n, self.kmax).tolist()
        out, at = [], 0
        for handle, count, k in zip(self.handles, self.counts, self.ks):
            rows = range(at, at + count)
            entries = [TokenLogprobs(chosen[i], ranks[i], top_ids[i][:k], top_lps[i][:k]) for i in rows]
            out.append(PromptLogprobs(handle, entries))
            at += count
        return out


def compute_prompt_logprobs(plan: StepPlan, inp, st, hidden: torch.Tensor, compute_logits, sched) -> PromptLogprobsPart:
    """Score each named row's scheduled tokens (``inp``: the step's ``StepInputs``; ``st``: the
    ``DeviceState`` whose token table holds each next token; ``hidden``: the eager forward's,
    one row a token in plan order) ``sched.max_num_seqs`` tokens at a time, so the logits never
    exceed what the sampler's own ``[max_num_seqs, vocab]`` needs. Every tensor-parallel rank
    runs this alike (``compute_logits`` gathers)."""
    q_lens, rows_cpu, positions, token_ids = inp.q_lens, inp.rows_cpu, inp.positions, st.token_ids
    slice_rows = sched.max_num_seqs
    index = {r.handle: i for i, r in enumerate(plan.rows)}
    starts = [0, *accumulate(q_lens)]
    spans = []  # (handle, first token, end, device row)
    for h in plan.prompt_logprob_handles:
        i = index[h]
        spans.append((h, starts[i], starts[i + 1], rows_cpu[i]))
    ks = [max(st.sampling[row].num_prompt_logprobs, 0) for _, _, _, row in spans]
    kmax = max(ks, default=0)
    chosen, ranks, top_ids, top_lps = [], [], [], []
    for _, s, e, row in spans:
        for a in range(s, e, slice_rows):
            b = min(a + slice_rows, e)
            logp = compute_logits(hidden[a:b]).float().log_softmax(dim=-1)
            target = token_ids[row, positions[a:b].long() + 1]
            c = logp.gather(-1, target[:, None])
            chosen.append(c[:, 0])
            ranks.append((logp > c).sum(dim=-1) + 1)
            if kmax:
                v, i = logp.topk(kmax, dim=-1)
                top_lps.append(v)
                top_ids.append(i)
    parts = [torch.cat(chosen).double(), torch.cat(ranks).double()]
    if kmax:
        parts += [torch.cat(top_ids).double().flatten(), torch.cat(top_lps).double().flatten()]
    return PromptLogprobsPart(
        handles=[h for h, _, _, _ in spans],
        counts=[e - s for _, s, e, _ in spans],
        ks=ks,
        kmax=kmax,
        packed=torch.cat(parts),
    )
