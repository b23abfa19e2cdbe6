"""New requests placed by the input kernel's own launch (``kernels.input_prep``'s ``place``)
under the interpreter, against placing them first (``DeviceState.place``) and the torch
reference of the inputs: the same inputs and the same device state (run in an interpreted
child pytest: see ``tests/interpreted.py``). The placement programs come after the input
programs, and the interpreter runs programs in order: an input program that read a placed
row's start or tokens from the state would read it stale here and fail."""

import numpy as np
import pytest
import torch

from kernels import reference as ref
from metadata.wire import NewRequest, SamplingOptions
from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import input_prep as ip
else:
    ip = None  # only the child (and the GPU test) touches triton

ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, BS = 12, 48, 12, 97, 4


def _opts(i: int, penalty: bool = False) -> SamplingOptions:
    return SamplingOptions(0.7 * (i % 2), 1.0, 0, 0.0, i, 1.3 if penalty else 1.0, 0.0, 0.0, 0, [], -1)


def _states(seed: int, device=torch.device("cpu")):
    """Two identical device states with five running rows (random lengths and tokens)."""
    from workers.device_state import DeviceState

    out = []
    for _ in range(2):
        st = DeviceState(ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, device)
        run = [NewRequest.of(h, [(h * 5 + i) % VOCAB for i in range(9 + h)], [], _opts(h), [h]) for h in range(5)]
        st.add_many(run)
        out.append(st)
    for st in out:  # (the same draws in both)
        g2 = torch.Generator().manual_seed(seed)
        st.num_computed[:5] = torch.randint(3, 9, (5,), generator=g2, dtype=torch.int32).to(device)
    return out


def _new(seed: int, penalty: bool):
    """New requests: a plain prompt, a prefix-cache hit, a resumed one with outputs (its
    scheduled tokens reach into them), a penalty one (the rows' clears)."""
    g = torch.Generator().manual_seed(seed + 100)
    p = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    reqs = [
        NewRequest.of(20, p(11), [], _opts(1), [5, 6, 7]),
        NewRequest.of(21, p(13), [], _opts(2), [8, 9, 10, 11], num_cached_tokens=8),
        NewRequest.of(22, p(6), p(5), _opts(3, penalty), [12, 13, 14], num_cached_tokens=4),
    ]
    # (scheduled: all uncached tokens, through the resumed request's outputs)
    return reqs, [11, 5, 7]


def _compare(seed: int, penalty: bool, block: int, device: torch.device) -> None:
    """The fused launch against placing first and the torch reference (see the docstring)."""
    from kernels import input_prep
    from workers.device_state import to_device

    a, b = _states(seed, device)
    reqs, q_new = _new(seed, penalty)
    staged_a, staged_b = a.stage(reqs), b.stage(reqs)
    assert staged_a.rows == staged_b.rows
    # the step: running rows 3, 0, 4 (decode, chunk, decode) around the new rows
    handles = [3, 20, 0, 21, 4, 22]
    q_lens = [1, q_new[0], 3, q_new[1], 1, q_new[2]]
    rows_cpu = [a.row_of[h] for h in handles]
    i64 = dict(dtype=torch.int64, device=device)
    rows = torch.tensor(rows_cpu, **i64)
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], **i64)
    n_tok = int(sum(q_lens))
    bt = torch.arange(len(handles) * MAX_BLOCKS, dtype=torch.int32, device=device).view(len(handles), MAX_BLOCKS)
    capacity = torch.full((len(handles),), MAX_BLOCKS * BS, **i64)
    words = to_device(torch.from_numpy(staged_a.words.copy()), device)
    j_of = {row: j for j, row in enumerate(staged_a.rows)}
    new_j = torch.tensor([j_of.get(r, -1) for r in rows_cpu], **i64)
    place = a.placement(staged_a, words, new_j)
    q = torch.tensor(q_lens, **i64)
    got = input_prep.prepare_inputs_triton(
        None, rows, qsl, n_tok, q, capacity, a.token_ids, bt, BS, block=block, num_computed=a.num_computed, place=place
    )
    b.place(staged_b, to_device(torch.from_numpy(staged_b.words), device))
    want = ref.prepare_inputs_reference(b.num_computed[rows], rows, qsl, n_tok, q, capacity, b.token_ids, bt, BS)
    for name, g_, w in zip(("positions", "input_ids", "seq_lens", "slot_mapping", "query_start_loc"), got, want):
        assert torch.equal(g_, w.to(g_.dtype)), f"{name}: {g_.tolist()} != {w.tolist()}"
    for name in ("token_ids", "num_computed", "prompt_len", "prompt_mask", "output_counts", "option_table"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("penalty", [False, True])
@pytest.mark.parametrize("block", [4, 256])
def test_placing_in_the_input_launch_matches_placing_first(seed, penalty, block):
    _compare(seed, penalty, block, torch.device("cpu"))


def test_a_step_without_tokens_still_places():
    from workers.device_state import to_device

    a, b = _states(2)
    reqs, _ = _new(2, True)
    staged_a, staged_b = a.stage(reqs), b.stage(reqs)
    row = torch.tensor([a.row_of[20]])
    place = a.placement(staged_a, torch.from_numpy(staged_a.words.copy()), torch.tensor([0]))
    table = torch.zeros(1, MAX_BLOCKS, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int64)
    qsl = torch.zeros(2, dtype=torch.int64)
    ip.prepare_inputs_triton(
        None, row, qsl, 0, zero, zero, a.token_ids, table, BS, num_computed=a.num_computed, place=place
    )
    b.place(staged_b, to_device(torch.from_numpy(staged_b.words), b.device))
    for name in ("token_ids", "num_computed", "prompt_len", "prompt_mask", "output_counts", "option_table"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_place_needs_the_rows_starts_and_no_commit():
    a, _ = _states(0)
    reqs, _ = _new(0, False)
    staged = a.stage(reqs)
    place = a.placement(staged, torch.from_numpy(staged.words.copy()), torch.tensor([-1, 0]))
    qsl = torch.tensor([0, 1, 12])
    args = (torch.tensor([a.row_of[3], a.row_of[20]]), qsl, 12, torch.tensor([1, 11]), torch.full((2,), 48))
    with pytest.raises(ValueError, match="place: needs num_computed"):
        ip.prepare_inputs_triton(
            torch.zeros(2, dtype=torch.int32),
            *args,
            a.token_ids,
            torch.zeros(2, 12, dtype=torch.int32),
            BS,
            place=place,
        )


delegate_all(globals(), __file__)  # parent process: each test reports its child run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_placing_in_the_input_launch_matches_placing_first():
    """On the device the placement and input programs of one launch run in any order."""
    for seed in range(4):
        for penalty in (False, True):
            for block in (4, 256):
                _compare(seed, penalty, block, torch.device("cuda"))
