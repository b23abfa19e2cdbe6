"""Device dispatch of the speculative-decoding kernels: Triton on CUDA, the torch references
elsewhere (as ``kernels.ops``). Each keeps a step's launch count far below the device's
launch-queue depth: a launch that fills the queue waits for the device."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.ops import _use_triton


def verify_slots(*args, **kw):
    """Speculative verification of every draft slot (``kernels.spec_verify``): one launch on CUDA."""
    if _use_triton(args[0]):
        from kernels.spec_verify import verify_slots_triton

        return verify_slots_triton(*args, **kw)
    return reference.verify_slots_reference(*args, **kw)


def accept_commit(*args, **kw):
    """The accepted drafts plus one token a row, committed to the device state: one launch on CUDA."""
    if _use_triton(args[0]):
        from kernels.spec_verify import accept_commit_triton

        return accept_commit_triton(*args, **kw)
    return reference.accept_commit_reference(*args, **kw)


def draft_sample(*args, **kw):
    """The draft model's next token a row (``kernels.draft_sample``): one launch on CUDA."""
    if _use_triton(args[0]):
        from kernels.draft_sample import draft_sample_triton

        return draft_sample_triton(*args, **kw)
    return reference.draft_sample_reference(*args, **kw)


def ngram_propose(token_ids, rows, known, width: int, k: int, n_min: int, n_max: int) -> None:
    """Prompt-lookup drafts of the sampling ``rows`` (``known``: their device token counts),
    written into ``token_ids`` at ``known .. known + k - 1``: one launch on CUDA
    (``kernels.ngram``), ``reference.ngram_drafts_reference`` elsewhere. ``width``: a host
    bound on every ``known``."""
    if _use_triton(token_ids):
        from kernels.ngram import ngram_propose_triton

        return ngram_propose_triton(token_ids, rows, known, width, k, n_min, n_max)
    drafts = reference.ngram_drafts_reference(token_ids[rows, :width], known, k, n_min, n_max)
    pos = known.long()[:, None] + torch.arange(k, device=known.device)[None, :]
    keep = pos < token_ids.shape[1]  # (a draft past the table's last column is dropped)
    token_ids[rows[:, None].expand(-1, k)[keep], pos[keep]] = drafts[keep]


def draft_step_inputs(*args, **kw) -> None:
    """The draft lookahead loop's next step inputs, written into ``out`` (``kernels.draft_sample``)."""
    if _use_triton(args[0]):
        from kernels.draft_sample import draft_step_inputs_triton

        return draft_step_inputs_triton(*args, **kw)
    return reference.draft_step_inputs_reference(*args, **kw)
