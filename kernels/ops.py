"""Device dispatch: Triton kernels on CUDA, the torch references elsewhere."""

from __future__ import annotations

import torch

from kernels import reference


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if _use_triton(key):
        from kernels.kv_write import write_kv_triton

        return write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    return reference.write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc, query_start_loc_cpu,
    max_query_len: int, max_seq_len_upper_bound: int, scale: float,
) -> torch.Tensor:
    if _use_triton(q):
        from kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
            max_query_len, max_seq_len_upper_bound, scale,
        )
    return reference.paged_attention_reference(
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, query_start_loc_cpu,
        max_seq_len_upper_bound, scale,
    )


def rms_norm(x, weight, eps: float, residual=None):
    if _use_triton(x):
        from kernels.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return reference.rms_norm_reference(x, weight, eps, residual)


def rotary_embedding(positions, q, k, cos_sin_cache):
    if _use_triton(q):
        from kernels.rotary import rotary_embedding_triton

        return rotary_embedding_triton(positions, q, k, cos_sin_cache)
    return reference.rotary_embedding_reference(positions, q, k, cos_sin_cache)
