"""Start-up compilation of the eager one-token decode passes (``enforce_eager``).

Without CUDA graphs every decode step runs eagerly, and its attention launch takes one of a
few shapes that depend on the batch size and the length bound
(``kernels.attention_splits.launch_config(eager=True)``). Each shape is a Triton variant
compiled the first time a step needs it: 1-2 s stalls in the first minutes of serving
(docs/decisions.md). ``warm_eager_decode`` runs one scratch decode pass for each shape
before serving starts instead.
"""

from __future__ import annotations

import logging
import time

import torch
import triton

from kernels import ops, pdl
from kernels.attention_splits import _device_sms, eager_one_token_cases
from metadata.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def scratch_decode_meta(num_reqs: int, bound: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """An eager one-token pass of ``num_reqs`` requests under length bound ``bound`` that
    writes nothing: every slot is -1 (the KV write skips it; the fused decode attention
    then attends the fresh key), and the block table points at block 0, which is only read."""
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=torch.ones(num_reqs, dtype=torch.int32, device=device),
        seq_lens_upper_bound=torch.full((num_reqs,), bound, dtype=torch.int32),
        block_table=torch.zeros(num_reqs, -(-bound // block_size), dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_reqs,), -1, dtype=torch.int64, device=device),
        positions=torch.zeros(num_reqs, dtype=torch.int64, device=device),
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs,
        max_query_len=1,
        max_seq_len_upper_bound=bound,
        bounds_are_exact=True,
        eager=True,
    )


def eager_decode_cases(model, max_num_seqs: int, max_model_len: int, device: torch.device) -> list[tuple[int, int]]:
    """The ``(num_reqs, bound)`` pairs whose passes compile every eager one-token attention
    variant ``model`` can reach on this device (its per-rank heads; PDL's token limit and
    the rope-in-attention limits also pick variants), then each batch size not yet among
    them at bound 1: the GEMM kernels pick their configs by row class."""
    attn = model.layers[0].self_attn
    probe = torch.empty(0, device=device)

    def variant_of(reqs: int, bound: int) -> tuple[bool, bool]:
        with pdl.step_tokens(reqs):
            return pdl.enabled(probe), ops.rope_in_attention_applies(reqs, 1, bound)

    cases = eager_one_token_cases(
        attn.num_kv_heads,
        triton.next_power_of_2(attn.num_heads // attn.num_kv_heads),
        max(16, triton.next_power_of_2(attn.head_dim)),
        max_num_seqs,
        max_model_len,
        _device_sms(device),
        variant_of,
    )
    sizes = {r for r, _ in cases}
    return cases + [(r, 1) for r in range(1, max_num_seqs + 1) if r not in sizes]


@torch.inference_mode()
def warm_eager_decode(
    model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device
) -> int:
    """Run one scratch eager decode pass (and its logits) for each case of
    ``eager_decode_cases``; returns how many ran. Every TP rank runs the same cases in the
    same order, so the passes' collectives pair up: the cases depend on the config, the
    per-rank heads and the card (SM count, PDL), which TP ranks share (one card model)."""
    t0 = time.perf_counter()
    cases = eager_decode_cases(model, max_num_seqs, max_model_len, device)
    for num_reqs, bound in cases:
        ids = torch.zeros(num_reqs, dtype=torch.int64, device=device)
        meta = scratch_decode_meta(num_reqs, bound, block_size, device)
        model.compute_logits(model(ids, meta.positions, meta, kv_caches))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info(
        "enforce_eager: ran %d scratch decode passes (every batch size; attention "
        "variants at batch/bound %s) in %.1f s",
        len(cases),
        [c for c in cases if c[1] > 1],
        time.perf_counter() - t0,
    )
    return len(cases)
