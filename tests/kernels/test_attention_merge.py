"""The decode attention's in-launch one-pass split merge (``kernels.attention_merge``), run
under the Triton interpreter against the plain-torch reference."""

import pytest
import torch

from tests.interpreted import INTERPRETED, delegate_all
from tests.kernels.test_kernels import DECODE_LENS, TOL, make_attention_case, run_attention

if INTERPRETED:
    from kernels import paged_attention as pa
else:
    pa = None  # only the child touches triton


@pytest.mark.parametrize("num_splits", [3, 8])  # 8 splits > tiles of the short rows: masked
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 1)])
def test_decode_merge_matches_reference(num_splits, hq, hkv):
    c = make_attention_case(
        [1] * (len(DECODE_LENS) + 1), DECODE_LENS + [200], hq, hkv, pad_tokens=2, bound_slack=40, seed=3
    )
    for _ in range(2):  # the second launch needs every counter re-armed by the first
        out, expect = run_attention(c, num_splits=num_splits, fused_reduce=True)
        torch.testing.assert_close(out, expect, **TOL[torch.float32])
        assert int(pa.arrival_counters(c["q"].device, 1).count_nonzero()) == 0


def test_merge_when_a_later_split_dominates():
    """Long rows whose keys grow with their position: each split's lse exceeds the ones
    before it, so a one-pass merge must rescale what it has summed at every split."""
    c = make_attention_case([1, 1, 1], [700, 1024, 1500], 4, 2, bs=16, seed=11)
    bt = c["block_table"]
    for r in range(bt.shape[0]):
        for j in range(bt.shape[1]):
            if bt[r, j] >= 0:
                c["k_cache"][bt[r, j]] *= 1.0 + 3.0 * j / bt.shape[1]
    out, expect = run_attention(c, num_splits=8, fused_reduce=True)
    torch.testing.assert_close(out, expect, **TOL[torch.float32])


def test_merge_with_splits_that_see_no_key():
    """Spec-verify rows (several query tokens a request): a row's early query tokens see no key
    in the last splits (lse -inf there), and an empty request. (Split 0 holds key 0, which
    every query sees: only masked rows start the running max at -inf.)"""
    c = make_attention_case([3, 1, 0, 4, 2], [40, 90, 7, 130, 3], 8, 2, bs=8, pad_tokens=3, bound_slack=9, seed=8)
    for splits in (3, 4):
        out, expect = run_attention(c, num_splits=splits, fused_reduce=True)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expect, **TOL[torch.float32])


def test_merge_in_bf16():
    c = make_attention_case([1] * 6, [33, 64, 65, 150, 17, 240], 8, 2, dtype=torch.bfloat16, bound_slack=16, seed=5)
    out, expect = run_attention(c, num_splits=6, fused_reduce=True)
    torch.testing.assert_close(out, expect, **TOL[torch.bfloat16])


delegate_all(globals(), __file__)  # parent process: each test reports its child run
