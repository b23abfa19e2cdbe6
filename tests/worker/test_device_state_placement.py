"""``DeviceState.add_many``: same state as the original per-request ``add``, a number of
device operations independent of how many requests are placed, and all-or-nothing validation."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from metadata.wire import NewRequest, SamplingOptions
from workers.device_state import DeviceState, to_device

ROWS, MAX_LEN, MAX_BLOCKS, VOCAB = 20, 32, 8, 50
CPU = torch.device("cpu")


def _opts(seed: int = 0) -> SamplingOptions:
    return SamplingOptions(0.0, 1.0, 0, 0.0, seed, 1.1, 0.0, 0.0, 0, [], -1)


def _state() -> DeviceState:
    return DeviceState(ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, CPU)


def _reference_add(st: DeviceState, req: NewRequest) -> None:
    """The original per-request ``DeviceState.add`` (valid requests only)."""
    row = st.free_rows.pop()
    st.row_of[req.handle] = row
    prompt, outputs = req.token_ids()
    tokens = prompt + outputs
    st.token_ids[row, : len(tokens)] = to_device(torch.tensor(tokens, dtype=torch.int64), st.device)
    st.num_computed[row : row + 1].fill_(req.num_cached_tokens)
    st.prompt_len[row : row + 1].fill_(len(prompt))
    st.num_blocks_cpu[row] = 0
    if req.block_ids:
        st.block_table_cpu[row, : len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
        st.num_blocks_cpu[row] = len(req.block_ids)
    st.sampling[row] = req.sampling
    st.output_counts[row].zero_()
    st.prompt_mask[row].zero_()
    st.prompt_mask[row].index_fill_(0, st.token_ids[row, : len(prompt)], True)
    if outputs:
        out = st.token_ids[row, len(prompt) : len(tokens)]
        st.output_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))


def _req(h: int, n_prompt: int, outputs: list[int] = (), cached: int = 0, blocks: int = 0) -> NewRequest:
    prompt = [(h * 7 + i * 3) % VOCAB for i in range(n_prompt)]
    return NewRequest.of(h, prompt, list(outputs), _opts(h), [h * 10 + i for i in range(blocks)], cached)


def _snapshot(st: DeviceState) -> dict:
    return dict(
        token_ids=st.token_ids.clone(),
        num_computed=st.num_computed.clone(),
        prompt_len=st.prompt_len.clone(),
        output_counts=st.output_counts.clone(),
        prompt_mask=st.prompt_mask.clone(),
        block_table_cpu=st.block_table_cpu.clone(),
        num_blocks_cpu=list(st.num_blocks_cpu),
        row_of=dict(st.row_of),
        free_rows=list(st.free_rows),
        sampling=list(st.sampling),
    )


def _assert_same(a: DeviceState, b: DeviceState) -> None:
    sa, sb = _snapshot(a), _snapshot(b)
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k
        else:
            assert sa[k] == sb[k], k


def test_add_many_matches_per_request_add():
    first = [
        _req(1, 5),
        _req(2, 12, outputs=[3, 3, 9, 3, 40], cached=8, blocks=3),
        _req(3, 1, blocks=1),
        _req(4, 20, outputs=[7], cached=16, blocks=5),
        _req(5, 9, outputs=[1, 2, 1, 2, 1, 49, 0], blocks=4),
        _req(6, MAX_LEN - 2, outputs=[11, 11], cached=4, blocks=MAX_BLOCKS),
    ]
    second = [
        _req(7, 3, outputs=[5, 5], blocks=1),  # reuses a released row holding longer data
        _req(8, 15, cached=3, blocks=2),
        _req(9, 2, outputs=[8, 8, 8, 8]),
    ]
    ref, new, single = _state(), _state(), _state()
    for r in first:
        _reference_add(ref, r)
        single.add(r)
    new.add_many(first)
    _assert_same(ref, new)
    _assert_same(ref, single)
    released = {new.row_of[h] for h in (6, 2, 5)}
    for st in (ref, new, single):
        for h in (6, 2, 5):
            st.release(h)
    for r in second:
        _reference_add(ref, r)
        single.add(r)
    new.add_many(second)
    _assert_same(ref, new)
    _assert_same(ref, single)
    assert {new.row_of[h] for h in (7, 8, 9)} == released  # stale rows were cleared


class _OpCounter(TorchDispatchMode):
    """Counts aten ops that touch a tensor on ``device`` (on CPU: every tensor op)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten((args, kwargs, out))
        if any(isinstance(x, torch.Tensor) and x.device.type == self.device.type for x in leaves):
            self.ops.append(str(func))
        return out


def _count(place, reqs: list[NewRequest]) -> list[str]:
    st = _state()
    st.add_many([_req(100, 4)])  # rows previously held
    st.release(100)
    with _OpCounter(st.device) as counter:
        place(st, reqs)
    return counter.ops


def _batch(n: int) -> list[NewRequest]:
    return [_req(h, 3 + h % 5, outputs=[h % 4, 2, h % 4], cached=h % 3, blocks=1 + h % 3) for h in range(n)]


def test_add_many_op_count_is_independent_of_request_count():
    loop = lambda st, reqs: [_reference_add(st, r) for r in reqs]  # noqa: E731
    batched = lambda st, reqs: st.add_many(reqs)  # noqa: E731
    # the counter sees a per-request loop grow...
    assert len(_count(loop, _batch(16))) > len(_count(loop, _batch(1)))
    # ...and add_many not (2 vs 16: with one request the host-side index ops take other paths)
    two, many = _count(batched, _batch(2)), _count(batched, _batch(16))
    assert two and two == many
    assert _count(batched, []) == []


def test_placement_without_penalties_skips_the_clears_and_stale_counts_change_nothing():
    """A placement with no penalty request leaves a reused row's counts and prompt mask stale
    (two clears fewer); the sampler's penalties leave such a row's logits exactly as they are;
    a penalty request placed in the row later finds it clean."""
    from workers.sampler import PenaltyBatch, apply_penalties

    plain = SamplingOptions(0.0, 1.0, 0, 0.0, 0, 1.0, 0.0, 0.0, 0, [], -1)
    st = _state()
    st.add_many([_req(1, 6, outputs=[4, 4, 9])])  # (penalties: counts and prompt bits written)
    row = st.row_of[1]
    st.release(1)
    with _OpCounter(st.device) as counter:
        st.add_many([NewRequest.of(2, [3, 5], [], plain, [])])
    assert st.row_of[2] == row and not any("index_fill" in op for op in counter.ops)
    assert st.output_counts[row].sum() > 0  # stale, unread
    # row 0 penalised, row 1 (no penalties) holding the stale counts and mask: untouched
    logits = torch.randn(2, VOCAB)
    rows = torch.tensor([st.free_rows[-1], row])
    out = apply_penalties(
        logits.clone(),
        PenaltyBatch(
            repetition=torch.tensor([1.3, 1.0]),
            presence=torch.tensor([0.5, 0.0]),
            frequency=torch.tensor([0.2, 0.0]),
            output_counts=st.output_counts[rows],
            prompt_mask=st.prompt_mask[rows],
        ),
    )
    assert torch.equal(out[1], logits[1])
    st.release(2)
    ref, again = _state(), _req(3, 4, outputs=[7])  # penalties again: a clean row
    _reference_add(ref, again)
    st.add_many([again])
    assert st.row_of[3] == row
    assert torch.equal(st.output_counts[row], ref.output_counts[ref.row_of[3]])
    assert torch.equal(st.prompt_mask[row], ref.prompt_mask[ref.row_of[3]])


def test_invalid_input_places_nothing():
    st = _state()
    st.add_many([_req(1, 4, blocks=1), _req(2, 6, outputs=[3])])
    st.release(1)
    before = _snapshot(st)
    cases = [
        ([_req(10, 3), _req(11, 3), _req(10, 5)], "request handle 10 is already placed"),
        ([_req(10, 3), _req(2, 3)], "request handle 2 is already placed"),
        ([_req(10, 3), _req(11, MAX_LEN, outputs=[1])], f"request 11 has {MAX_LEN + 1} tokens > max_model_len"),
        ([_req(10 + i, 2) for i in range(ROWS)], "no free request rows on the worker"),
        ([_req(10, 3, blocks=MAX_BLOCKS + 1)], "block table overflow"),
        ([_req(10, 3), msgspec.structs.replace(_req(11, 3), prompt_words=b"\x05" * 7)], "not int64 words"),
    ]
    for reqs, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            st.add_many(reqs)
        after = _snapshot(st)
        for k in before:
            same = torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k]
            assert same, (msg, k)
    with pytest.raises(RuntimeError, match="request handle 2 is already placed"):
        st.add(_req(2, 3))
    assert st.row_of == before["row_of"] and st.free_rows == before["free_rows"]


def test_host_drafts_land_in_one_write_and_stop_at_the_last_column():
    """``write_host_drafts`` (``ngram_host``): every row's drafts at its start column, a draft
    past the table's last column dropped, the same operators for 2 rows as for 16."""
    st = _state()
    width = st.token_ids.shape[1]
    items = [(0, 5, [7, 8, 9]), (3, width - 2, [4, 5, 6]), (7, 0, [1])]
    want = st.token_ids.clone()
    want[0, 5:8] = torch.tensor([7, 8, 9])
    want[3, width - 2 :] = torch.tensor([4, 5])
    want[7, 0] = 1
    st.write_host_drafts(items)
    assert torch.equal(st.token_ids, want)
    st.write_host_drafts([])  # nothing to write: nothing happens
    assert torch.equal(st.token_ids, want)

    def write(st, n):
        st.write_host_drafts([(r, 2, [1, 2, 3]) for r in range(n)])

    assert _count(write, 2) == _count(write, 16)
