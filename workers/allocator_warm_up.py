"""Allocator warm-up: the memory early serving steps would otherwise allocate on a launch's path.

A launch that grows a caching allocator pays a ``cudaHostAlloc`` (pinned host memory, the
packed host-to-device copies of ``workers.step_inputs`` and ``DeviceState.add_many``) or a
``cudaMalloc`` (the eager logits and sampling temporaries of a step no decode graph covers),
each far more host time than the launch itself. Both allocators keep what they create, so
creating it once before serving moves that cost to start-up.
"""

from __future__ import annotations

import torch

PINNED_COPIES = 4  # blocks a size: two copies a step (placement, inputs), two steps in flight
MIN_PINNED_BYTES = 1 << 16
MAX_PINNED_BYTES = 1 << 23


def pinned_sizes(max_bytes: int) -> list[int]:
    """The pinned block sizes to create: every power of two from 512 bytes (the caching host
    allocator rounds requests up to one) to ``max_bytes`` rounded up, within
    ``[MIN_PINNED_BYTES, MAX_PINNED_BYTES]``."""
    top = min(max(max_bytes, MIN_PINNED_BYTES), MAX_PINNED_BYTES)
    sizes, b = [], 512
    while b < top:
        sizes.append(b)
        b *= 2
    return sizes + [b]


def step_copy_bytes(max_tokens: int, max_num_seqs: int) -> int:
    """A bound on a common step's packed host-to-device copy: three int64 words a token (the
    placement's token ids, rows and columns) and a few a request. Larger copies (prompts
    far over the step's token budget) still allocate on first use."""
    return 8 * (3 * max_tokens + 16 * max_num_seqs)


def warm_pinned_blocks(max_bytes: int, copies: int = PINNED_COPIES) -> int:
    """Creates ``copies`` cached pinned blocks of each of ``pinned_sizes(max_bytes)``; returns
    their bytes. Released without a copy recorded on them, they are free at once."""
    held = [torch.empty(s, dtype=torch.uint8, pin_memory=True) for s in pinned_sizes(max_bytes) for _ in range(copies)]
    total = sum(t.numel() for t in held)
    del held
    return total


def warm_sampling_temporaries(draw_once, rows: int, vocab: int, device: torch.device) -> None:
    """One eager draw over ``rows`` logits rows (the largest logits batch a step samples): its
    temporaries' device segments stay cached for the steps that sample eagerly. KV sizing
    already left room for them (``workers.memory_profile`` profiles the same draw)."""
    draw_once(torch.zeros(rows, vocab, device=device))
