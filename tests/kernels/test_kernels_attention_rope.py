"""Decode attention with the rope prologue fused in (``paged_attention_triton(rope=...)``)
under the interpreter, against ``rope_and_write_kv_reference`` followed by
``paged_attention_reference`` (run in an interpreted child pytest: see
``tests/interpreted.py``)."""

import pytest
import torch

from kernels import reference as ref
from tests.interpreted import INTERPRETED, delegate_all
from tests.kernels.test_kernels import TOL, cos_sin_cache

if INTERPRETED:
    from kernels import paged_attention as pa
    from kernels.rope_inline import DecodeRope
else:
    pa = DecodeRope = None  # only the child touches triton


def make_case(seq_lens, hq, hkv, d, dtype, qk_norm, pad_reqs=0, bs=16, seed=0, device="cpu"):
    """A decode step: one new token a request at position seq_len - 1, its slot in the
    request's last page; ``pad_reqs`` CUDA-graph padding requests (no query token) and a
    padded token with slot -1."""
    g = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    width = -(-(max(seq_lens) + 8) // bs) + 1
    num_blocks = (n + pad_reqs) * width + 2
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: (n + pad_reqs) * width]
    table = table.view(n + pad_reqs, width).to(torch.int32)
    qsl = torch.tensor([min(i, n) for i in range(n + pad_reqs + 1)], dtype=torch.int32)
    seq = torch.tensor(list(seq_lens) + [0] * pad_reqs, dtype=torch.int32)
    positions = torch.tensor([s - 1 for s in seq_lens] + [0], dtype=torch.int64)  # + a pad token
    slots = torch.tensor(
        [int(table[r, (s - 1) // bs]) * bs + (s - 1) % bs for r, s in enumerate(seq_lens)] + [-1], dtype=torch.int64
    )
    qkv = torch.randn(n + 1, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(n + 1, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n + 1, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n + 1, hkv, d)
    qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if qk_norm else None
    kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if qk_norm else None
    case = dict(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        table=table,
        qsl=qsl,
        seq=seq,
        positions=positions,
        slots=slots,
        cs=cos_sin_cache(max(seq_lens) + 8, d),
        qw=qw,
        kw=kw,
    )
    case = {name: t.to(device) if t is not None else None for name, t in case.items()}
    return dict(case, bound=max(seq_lens) + 5, scale=d**-0.5)


def expected(c):
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    q_rot = ref.rope_and_write_kv_reference(
        c["positions"], c["q"], c["k"], c["v"], c["cs"], kc, vc, c["slots"], c["qw"], c["kw"], 1e-6
    )
    out = ref.paged_attention_reference(
        q_rot, kc, vc, c["table"].clamp(min=0), c["seq"], c["qsl"], c["qsl"], c["bound"], c["scale"]
    )
    return out, kc, vc


def fused(c, num_splits=None, fused_reduce=None, positions=None, block_n=None, eager=False):
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    rope = DecodeRope(
        c["positions"] if positions is None else positions, c["k"], c["v"], c["cs"], c["slots"], c["qw"], c["kw"], 1e-6
    )
    out = pa.paged_attention_triton(
        c["q"],
        kc,
        vc,
        c["table"],
        c["seq"],
        c["qsl"],
        1,
        c["bound"],
        c["scale"],
        num_splits=num_splits,
        fused_reduce=fused_reduce,
        rope=rope,
        config=dict(block_n=block_n) if block_n else None,
        eager=eager,
    )
    return out, kc, vc


# lengths on and around page (16) and tile boundaries; the new token may open a page or be
# alone in its tile; 129 and 257 span several tiles of the default 128 keys
LENS = [1, 16, 17, 64, 65, 100, 129, 257]


def covering_cases() -> list[tuple]:
    """Every GQA ratio (1, 4, 8) with every split layout, each twice, with the binary factors
    (qk_norm: Llama / Qwen3; block_n 16: a tile a page, many tiles a split; the dtype) taken
    from complementary rows of a half fraction: every pair of factor values occurs in some
    case (18 cases instead of the full 72, under the interpreter)."""
    halves = [
        (False, None, torch.float32),
        (False, 16, torch.bfloat16),
        (True, None, torch.bfloat16),
        (True, 16, torch.float32),
    ]
    cases = []
    for k, ((hq, hkv), (splits, fused_reduce)) in enumerate(
        (g, s) for g in [(4, 4), (8, 2), (8, 1)] for s in [(1, None), (3, True), (3, False)]
    ):
        for qk_norm, block_n, dtype in (halves[k % 4], halves[(k + 2) % 4]):
            cases.append((qk_norm, hq, hkv, splits, fused_reduce, block_n, dtype))
    return cases


@pytest.mark.parametrize("qk_norm,hq,hkv,splits,fused_reduce,block_n,dtype", covering_cases())
def test_decode_attention_with_rope_matches_unfused_reference(qk_norm, hq, hkv, splits, fused_reduce, block_n, dtype):
    c = make_case(LENS, hq, hkv, 32, dtype, qk_norm, pad_reqs=2)
    out, kc, vc = fused(c, num_splits=splits, fused_reduce=fused_reduce, block_n=block_n)
    exp, kc_exp, vc_exp = expected(c)
    n = len(LENS)
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].float(), exp[:n].float(), **tol)
    torch.testing.assert_close(kc, kc_exp, **tol)  # the new keys, rotated, in their slots
    assert torch.equal(vc, vc_exp)  # values are copied; nothing else is touched


@pytest.mark.parametrize("lens,bound,splits", [(LENS, None, 1), (LENS, 600, 4), ([1, 129, 257], 2048, 16)])
def test_eager_decode_attention_shapes_match_reference(lens, bound, splits):
    """The eager one-token launch (``enforce_eager``: one fixed tile, power-of-four split
    counts from the bound) against the reference, at bounds far above the real lengths."""
    from kernels.attention_splits import launch_config

    c = make_case(lens, 8, 2, 32, torch.bfloat16, qk_norm=True, pad_reqs=1)
    exp, kc_exp, vc_exp = expected(c)  # at the table's own bound: keys past seq_len are masked
    c["bound"] = bound or c["bound"]
    n = len(lens)
    assert launch_config(n + 1, n + 1, 2, 4, 32, 1, c["bound"], eager=True).num_splits == splits
    out, kc, vc = fused(c, eager=True)
    torch.testing.assert_close(out[:n].float(), exp[:n].float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(kc, kc_exp, **TOL[torch.bfloat16])
    assert torch.equal(vc, vc_exp)


def test_decode_attention_with_rope_slot_minus_one_writes_nothing():
    """A real request whose new token has slot -1 (a draft lookahead past its capacity):
    no cache write anywhere, and its output still attends its fresh key."""
    c = make_case([20, 70], 8, 2, 32, torch.float32, qk_norm=True)
    exp, _, _ = expected(c)  # with the real slots: the fresh keys are attended
    c["slots"][1] = -1
    before_k, before_v = c["k_cache"].clone(), c["v_cache"].clone()
    _, kc_one, vc_one = expected(dict(c))  # the reference writes request 0's slot only
    out, kc, vc = fused(c, num_splits=2)
    torch.testing.assert_close(out[:2], exp[:2], **TOL[torch.float32])
    torch.testing.assert_close(kc, kc_one, **TOL[torch.float32])
    assert torch.equal(vc, vc_one)
    changed = (kc != before_k).flatten(1).any(1).sum() + (vc != before_v).flatten(1).any(1).sum()
    assert int(changed) == 2  # request 0's K and V rows: one cache row each


def test_decode_attention_with_rope_bound_below_seq_len():
    """A caller that breaks seq_len <= bound: keys past the bound do not exist (as in the
    reference), and the new K/V are still written."""
    c = make_case([70], 4, 2, 32, torch.float32, qk_norm=False)
    c["bound"] = 64
    out, kc, vc = fused(c, block_n=64)
    exp, kc_exp, vc_exp = expected(c)
    torch.testing.assert_close(out[:1], exp[:1], **TOL[torch.float32])
    torch.testing.assert_close(kc, kc_exp, **TOL[torch.float32])
    assert torch.equal(vc, vc_exp)


def test_ops_routes_small_decode_batches_into_attention(monkeypatch):
    """``ops.rope_and_attention`` (kernels on CPU tensors under the interpreter): up to
    ROPE_IN_ATTENTION_MAX_TOKENS tokens of one query token each take the fused launch,
    larger or multi-token batches, too many keys (tokens x bound) and the option off the two
    launches; all equal the reference."""
    from kernels import ops

    calls = []
    real = pa.paged_attention_triton

    def spy(*args, **kw):
        calls.append(kw.get("rope") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    monkeypatch.setattr(pa, "paged_attention_triton", spy)
    # key_cap: ROPE_IN_ATTENTION_MAX_TOKEN_KEYS as a multiple of this case's rows x bound
    from kernels.settings import overridden

    for n, on, key_cap, want in (
        (3, True, 1, True),
        (ops.ROPE_IN_ATTENTION_MAX_TOKENS + 1, True, None, False),
        (3, False, None, False),
        (3, True, 0.99, False),
    ):
        c = make_case([5 + 9 * i for i in range(n)], 4, 2, 32, torch.float32, qk_norm=True)
        if key_cap is not None:  # exactly at the cap (fused) or just under it (not)
            rows = c["q"].shape[0]  # padded rows count too
            monkeypatch.setattr(ops, "ROPE_IN_ATTENTION_MAX_TOKEN_KEYS", int(key_cap * rows * c["bound"]))
        exp, kc_exp, _ = expected(c)
        kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
        calls.clear()
        with overridden(rope_in_attention=on):  # the rope_in_attention option
            out = ops.rope_and_attention(
                c["positions"],
                c["q"],
                c["k"],
                c["v"],
                c["cs"],
                kc,
                vc,
                c["slots"],
                c["table"],
                c["seq"],
                c["qsl"],
                c["qsl"],
                1,
                c["bound"],
                c["scale"],
                c["qw"],
                c["kw"],
                1e-6,
            )
        assert calls == [want]
        torch.testing.assert_close(out[:n], exp[:n], **TOL[torch.float32])
        torch.testing.assert_close(kc, kc_exp, **TOL[torch.float32])


def test_decode_attention_with_rope_detects_wrong_positions():
    c = make_case([5, 40], 8, 2, 32, torch.float32, qk_norm=True)
    exp, kc_exp, _ = expected(c)
    out, kc, _ = fused(c, positions=c["positions"] + 1)
    assert not torch.allclose(out[:2], exp[:2], atol=1e-3, rtol=1e-3)
    assert not torch.allclose(kc, kc_exp, atol=1e-3, rtol=1e-3)


def test_decode_attention_with_rope_odd_head_dim():
    """head_dim 48: BLOCK_D 64 with masked columns; the rotation pairs d with d +- 24."""
    c = make_case([3, 33], 4, 2, 48, torch.float32, qk_norm=True)
    out, kc, vc = fused(c, num_splits=2)
    exp, kc_exp, vc_exp = expected(c)
    torch.testing.assert_close(out[:2], exp[:2], **TOL[torch.float32])
    torch.testing.assert_close(kc, kc_exp, **TOL[torch.float32])


def test_decode_attention_with_rope_needs_one_query_token():
    c = make_case([5], 4, 2, 32, torch.float32, qk_norm=False)
    rope = DecodeRope(c["positions"], c["k"], c["v"], c["cs"], c["slots"])
    with pytest.raises(AssertionError, match="one query token"):
        pa.paged_attention_triton(
            c["q"], c["k_cache"], c["v_cache"], c["table"], c["seq"], c["qsl"], 2, c["bound"], c["scale"], rope=rope
        )


delegate_all(globals(), __file__)
