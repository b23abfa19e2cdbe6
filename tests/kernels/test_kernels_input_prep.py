"""The Triton step-input preparation (``kernels.input_prep``) under the interpreter against
``kernels.reference.prepare_inputs_reference`` (run in an interpreted child pytest: see
``tests/interpreted.py``)."""

import pytest
import torch

from kernels import reference as ref
from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import input_prep as ip
else:
    ip = None  # only the child touches triton


def make_case(q_lens, bs=4, seed=0, width_slack=3, short_capacity=False):
    """Random device state: starts, a token table, a block table that is a column slice of
    a wider one (row stride > width), capacities (optionally short: slots must be -1)."""
    g = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    max_rows, max_len = n + 5, 64
    rows = torch.randperm(max_rows, generator=g)[:n]
    starts = torch.randint(0, 40, (n,), generator=g, dtype=torch.int32)
    token_ids = torch.randint(0, 1000, (max_rows, max_len + 1), generator=g)
    q = torch.tensor(q_lens)
    qsl = torch.zeros(n + 1, dtype=torch.int64)
    qsl[1:] = q.cumsum(0)
    n_blk = (int((starts.long() + q).max()) + bs - 1) // bs
    wide = torch.randperm(n * (n_blk + width_slack) + 7, generator=g)[: n * (n_blk + width_slack)]
    block_table = wide.view(n, n_blk + width_slack).to(torch.int32)[:, :n_blk]
    capacity = (starts.long() + q) if not short_capacity else (starts.long() + q - 2).clamp(min=0)
    return (starts, rows, qsl, sum(q_lens), q, capacity, token_ids, block_table, bs)


def mixed_lens(n, seed):
    """``n`` query lengths, about half of them 1 (decode rows), the rest up to 9."""
    g = torch.Generator().manual_seed(seed)
    long = torch.randint(2, 10, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.5, 1, long).tolist()


@pytest.mark.parametrize(
    "q_lens,block,short", [([1], 256, False), ([1] * 7, 4, False), ([3, 1, 17, 5], 8, False), ([2, 9, 1], 256, True)]
)
def test_prepare_inputs_matches_reference(q_lens, block, short):
    case = make_case(q_lens, seed=len(q_lens), short_capacity=short)
    got = ip.prepare_inputs_triton(*case, block=block)
    want = ref.prepare_inputs_reference(*case)
    names = ("positions", "input_ids", "seq_lens", "slot_mapping", "query_start_loc")
    for name, g_, w in zip(names, got, want):
        assert g_.dtype == w.dtype, name
        assert torch.equal(g_, w), f"{name}: {g_.tolist()} != {w.tolist()}"
    if short:
        assert (got[3] == -1).any()  # positions at or past capacity write no KV


@pytest.mark.parametrize("n,block", [(2, 4), (3, 4), (5, 8), (17, 16), (33, 256), (37, 8), (37, 256), (2049, 256)])
def test_prepare_inputs_finds_each_tokens_request(n, block):
    """The kernel's binary search over the query starts: request counts just above and below
    powers of two, many mixed-length requests (mostly one token: neighbouring starts one
    apart), blocks that start mid-request."""
    case = make_case(mixed_lens(n, seed=n), seed=n)
    got = ip.prepare_inputs_triton(*case, block=block)
    for g_, w in zip(got, ref.prepare_inputs_reference(*case)):
        assert g_.dtype == w.dtype and torch.equal(g_, w)


@pytest.mark.parametrize(
    "q_lens", [[1] * 33, [1] * 30 + [2], [2] + [1] * 30, [1, 1, 3, 1, 1], [1] * 9 + [4] + [1] * 9, [5, 1, 1, 1, 1]]
)
def test_prepare_inputs_search_bounds_from_the_token_surplus(q_lens):
    """Every request has a token, so token t's request lies within t - (T - R) .. t: a uniform
    decode needs no search, a few extra tokens a short one, wherever the longer rows sit."""
    case = make_case(q_lens, seed=len(q_lens))
    got = ip.prepare_inputs_triton(*case, block=8)
    for g_, w in zip(got, ref.prepare_inputs_reference(*case)):
        assert torch.equal(g_, w)


def test_reference_per_token_requests_and_offsets():
    """The reference's token -> (request, offset) from the query starts alone, including a
    request without tokens (the Triton path never takes those)."""
    q_lens = [2, 0, 3, 1]
    starts, rows, qsl, n_tok, q, cap, token_ids, bt, bs = make_case(q_lens, seed=4)
    assert qsl.tolist() == [0, 2, 2, 5, 6] and n_tok == 6
    positions, input_ids, seq_lens, slots, qsl_out = ref.prepare_inputs_reference(
        starts, rows, qsl, n_tok, q, cap, token_ids, bt, bs
    )
    s = starts.tolist()
    assert positions.tolist() == [s[0], s[0] + 1, s[2], s[2] + 1, s[2] + 2, s[3]]
    req = [0, 0, 2, 2, 2, 3]
    assert input_ids.tolist() == [int(token_ids[rows[r], p]) for r, p in zip(req, positions.tolist())]
    assert seq_lens.tolist() == [a + b for a, b in zip(s, q_lens)] and qsl_out.tolist() == qsl.tolist()


def test_prepare_inputs_positions_past_the_token_table():
    """Lookahead positions past the table's width read its last column (clamped), as the
    reference does, instead of another row's tokens."""
    starts, rows, qsl, n_tok, q, cap, token_ids, bt, bs = make_case([3, 2], seed=3)
    starts = torch.tensor([token_ids.shape[1] - 2, 5], dtype=torch.int32)
    n_blk = (int((starts.long() + q).max()) + bs - 1) // bs
    bt = torch.arange(2 * n_blk, dtype=torch.int32).view(2, n_blk)
    case = (starts, rows, qsl, n_tok, q, starts.long() + q, token_ids, bt, bs)
    got = ip.prepare_inputs_triton(*case, block=4)
    for g_, w in zip(got, ref.prepare_inputs_reference(*case)):
        assert torch.equal(g_, w)


def test_prepare_inputs_reads_starts_from_num_computed_by_row():
    """``starts`` None: request r starts at ``num_computed[rows[r]]`` (rows are a permutation
    of a longer table, so indexing by request instead of by row would differ)."""
    starts, rows, qsl, n_tok, q, cap, token_ids, bt, bs = make_case([2, 1, 4], seed=5)
    num_computed = torch.randint(
        0, 30, (token_ids.shape[0],), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    )
    num_computed[rows] = starts
    got = ip.prepare_inputs_triton(
        None, rows, qsl, n_tok, q, cap, token_ids, bt, bs, block=4, num_computed=num_computed
    )
    want = ref.prepare_inputs_reference(starts, rows, qsl, n_tok, q, cap, token_ids, bt, bs)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)
    with pytest.raises(ValueError, match="num_computed"):
        ip.prepare_inputs_triton(None, rows, qsl, n_tok, q, cap, token_ids, bt, bs)
    with pytest.raises(ValueError, match="qsl"):  # the query starts without their end
        ip.prepare_inputs_triton(starts, rows, qsl[:-1], n_tok, q, cap, token_ids, bt, bs)


def test_prepare_inputs_writes_into_given_buffers():
    """``out`` (a CUDA graph's static inputs): the results land in those tensors, views of
    longer buffers, and nothing past them is touched; a wrong dtype is refused."""
    case = make_case([1] * 5, seed=9)
    n, t = 5, 5
    bufs = [
        torch.full((t + 3,), -7, dtype=torch.int64),
        torch.full((t + 3,), -7, dtype=torch.int64),
        torch.full((n + 3,), -7, dtype=torch.int32),
        torch.full((t + 3,), -7, dtype=torch.int64),
    ]
    out = (bufs[0][:t], bufs[1][:t], bufs[2][:n], bufs[3][:t])
    got = ip.prepare_inputs_triton(*case, block=4, out=out)
    for g_, o, w in zip(got, out, ref.prepare_inputs_reference(*case)):
        assert g_ is o and torch.equal(g_, w)
    assert all((b[-3:] == -7).all() for b in bufs)
    with pytest.raises(ValueError, match="contiguous"):
        ip.prepare_inputs_triton(*case, out=(out[0], out[1], out[2].long(), out[3]))


@pytest.mark.parametrize(
    "q_lens,pad_tokens,pad_reqs,block", [([3, 1, 5], 16, 6, 4), ([1] * 5, 8, 8, 256), ([2, 2], 40, 9, 8)]
)
def test_prepare_inputs_pads_a_graph_bucket(q_lens, pad_tokens, pad_reqs, block):
    """``pad`` (a mixed-step graph's bucket): the query starts land in the graph's buffer and
    the same launch pads the step (slots up to ``pad_tokens`` -1, query starts up to
    ``pad_reqs`` the token count) and copies its block table (into a wider table) and its
    sampled-token indices; nothing past them is touched. The torch path does the same."""
    from kernels.input_prep import GraphPad, prepare_inputs

    case = make_case(q_lens, seed=len(q_lens))
    n, t = len(q_lens), sum(q_lens)
    bt = case[7]
    want = ref.prepare_inputs_reference(*case)
    logits = torch.tensor([t - 1, 0, t // 2], dtype=torch.int64)
    for fn in (lambda *a, **k: ip.prepare_inputs_triton(*a, block=block, **k), prepare_inputs):
        bufs = [torch.full((pad_tokens + 3,), -7, dtype=torch.int64) for _ in range(2)]
        bufs += [torch.full((pad_reqs + 3,), -7, dtype=torch.int32)]
        bufs += [torch.full((pad_tokens + 3,), -7, dtype=torch.int64)]
        qsl_buf = torch.full((pad_reqs + 4,), -7, dtype=torch.int32)
        table = torch.full((pad_reqs, bt.shape[1] + 5), -7, dtype=torch.int32)
        li = torch.full((8,), -7, dtype=torch.int64)
        out = (bufs[0][:t], bufs[1][:t], bufs[2][:n], bufs[3][:t])
        got = fn(*case, out=out, pad=GraphPad(qsl_buf, pad_tokens, pad_reqs, table, logits, li))
        for g_, w in zip(got, want):
            assert torch.equal(g_, w)
        assert got[4].data_ptr() == qsl_buf.data_ptr()
        assert (bufs[3][t:pad_tokens] == -1).all() and (bufs[3][pad_tokens:] == -7).all()
        assert (qsl_buf[n + 1 : pad_reqs + 1] == t).all() and (qsl_buf[pad_reqs + 1 :] == -7).all()
        assert torch.equal(table[:n, : bt.shape[1]], bt)
        assert (table[:n, bt.shape[1] :] == -7).all() and (table[n:] == -7).all()
        assert torch.equal(li[:3], logits) and (li[3:] == -7).all()
    with pytest.raises(ValueError, match="pad"):
        ip.prepare_inputs_triton(*case, pad=GraphPad(qsl_buf, pad_tokens, pad_reqs))  # no out
    with pytest.raises(ValueError, match="block table"):
        ip.prepare_inputs_triton(*case, out=out, pad=GraphPad(qsl_buf, pad_tokens, pad_reqs, table[:, :1]))


@pytest.mark.parametrize("n,b,q,block", [(3, 8, 1, 4), (5, 16, 1, 256), (2, 4, 3, 8)])
def test_prepare_inputs_pads_a_decode_graph(n, b, q, block):
    """A decode (or verify) graph's padding (``DecodeGraphs.padding``): every row has ``q``
    tokens, the query starts are written into the graph's own (``arange * q``: the same
    values), rows ``n .. b - 1`` get length ``q`` and their ``b * q - n * q`` slots -1, the
    block table is copied in; the seq_lens buffer past ``b`` is not touched."""
    from kernels.input_prep import GraphPad, prepare_inputs

    case = make_case([q] * n, seed=n)
    t = n * q
    bt = case[7]
    want = ref.prepare_inputs_reference(*case)
    for fn in (lambda *a, **k: ip.prepare_inputs_triton(*a, block=block, **k), prepare_inputs):
        static_qsl = torch.arange(b + 1, dtype=torch.int32) * q
        seq = torch.full((b + 2,), -7, dtype=torch.int32)
        slots = torch.full((b * q + 2,), -7, dtype=torch.int64)
        toks = [torch.full((b * q,), -7, dtype=torch.int64) for _ in range(2)]
        table = torch.full((b, bt.shape[1] + 2), -7, dtype=torch.int32)
        out = (toks[0][:t], toks[1][:t], seq[:n], slots[:t])
        got = fn(*case, out=out, pad=GraphPad(static_qsl, b * q, n, table, seq_rows=b, seq_len=q))
        for g_, w in zip(got, want):
            assert torch.equal(g_, w)
        assert torch.equal(static_qsl, torch.arange(b + 1, dtype=torch.int32) * q)  # unchanged values
        assert (seq[n:b] == q).all() and (seq[b:] == -7).all()
        assert (slots[t : b * q] == -1).all() and (slots[b * q :] == -7).all()
        assert torch.equal(table[:n, : bt.shape[1]], bt) and (table[n:] == -7).all()


@pytest.mark.parametrize("n,block", [(1, 256), (7, 4), (40, 16)])
def test_commit_lengths_sets_each_rows_num_computed(n, block):
    """``commit_lengths`` (one token a request): each row's ``num_computed`` becomes its new
    length, the rows of no request keep theirs; the kernel and the torch path agree, and
    both refuse a step with a request of more tokens, or given starts."""
    from kernels.input_prep import prepare_inputs

    starts, rows, qsl, n_tok, q, cap, token_ids, bt, bs = make_case([1] * n, seed=n)
    base = torch.randint(0, 30, (token_ids.shape[0],), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    base[rows] = starts
    want = ref.prepare_inputs_reference(starts, rows, qsl, n_tok, q, cap, token_ids, bt, bs)
    expect = base.clone()
    expect[rows] = starts + 1
    for fn in (lambda *a, **k: ip.prepare_inputs_triton(*a, block=block, **k), prepare_inputs):
        num_computed = base.clone()
        got = fn(None, rows, qsl, n_tok, q, cap, token_ids, bt, bs, num_computed=num_computed, commit_lengths=True)
        for g_, w in zip(got, want):
            assert torch.equal(g_, w)
        assert torch.equal(num_computed, expect)
    case = make_case([1, 2], seed=3)
    for fn in (ip.prepare_inputs_triton, prepare_inputs):
        with pytest.raises(ValueError, match="one token a request"):
            fn(None, *case[1:], num_computed=torch.zeros(20, dtype=torch.int32), commit_lengths=True)
        with pytest.raises(ValueError, match="one token a request"):
            fn(*make_case([1, 1], seed=4), commit_lengths=True)  # starts given


delegate_all(globals(), __file__)  # parent process: each test reports its child run
