"""The decode attention launch's host-side choices (no kernel runs: the launch is recorded)."""

import pytest
import torch


@pytest.mark.parametrize("reqs,hkv,bound,block_n,splits", [
    (8, 8, 4124, 64, 9),     # 64 (request, KV head) programs past SHORT_BOUND: 4 a SM
    (8, 8, 1024, 64, 5),     # the same grid at a short bound: 2 a SM
    (4, 8, 4124, 128, 9),    # 32 programs: wide tiles at any bound
    (1, 8, 1024, 128, 8),    # batch 1: wide tiles, one a split
    (32, 8, 4124, 64, 2),    # 256 programs: narrow tiles, 2 a SM, as before
])
def test_decode_tiles_and_splits_from_cpu_bounds(monkeypatch, reqs, hkv, bound, block_n, splits):
    """The one-query-token launch's tile width and split count (grid axis 2), from the batch
    shape and the length bound only."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw))

    from kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_paged_attention_kernel", Recorder())
    d = 128
    q = torch.zeros(reqs, 4 * hkv, d, dtype=torch.bfloat16)
    cache = torch.zeros(reqs * (bound // 16 + 1), 16, hkv, d, dtype=torch.bfloat16)
    table = torch.zeros(reqs, bound // 16 + 1, dtype=torch.int32)
    seq = torch.full((reqs,), bound, dtype=torch.int32)
    qsl = torch.arange(reqs + 1, dtype=torch.int32)
    pa.paged_attention_triton(q, cache, cache, table, seq, qsl, 1, bound, d ** -0.5)
    (grid, kw), = launches
    assert (kw["BLOCK_N"], grid[2], kw["num_stages"]) == (block_n, splits, 2)


def test_launch_config_of_verify_and_prefill_batches():
    """Only the one-query-token decode launch takes the swept tiles; a spec-decode verify window
    (up to DECODE_MAX_Q tokens a request) keeps one query block a request, prefill splits never."""
    from kernels.attention_splits import DECODE_MAX_Q, launch_config

    verify = launch_config(8, 8 * 8, 8, 4, 128, 8, 4124)
    assert verify.one_qblock and verify.grid0 == 8 and verify.block_m == 32
    assert (verify.block_n, verify.num_stages) == (64, 3)
    prefill = launch_config(2, 1000, 8, 4, 128, DECODE_MAX_Q + 1, 4124)
    assert not prefill.one_qblock and prefill.num_splits == 1
    assert prefill.grid0 == 1000 // prefill.block_q + 2
