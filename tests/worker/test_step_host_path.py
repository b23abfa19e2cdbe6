"""The decode step's host path: one packed copy for the step inputs, reused sampling-option
tensors, and the sampler's precomputed greedy argmax (what a decode CUDA graph hands it)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import prepare_inputs_reference
from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
from workers import step_inputs
from workers.device_state import DeviceState
from workers.sampler import PenaltyBatch, SamplingBatch, apply_penalties, sample
from workers.sampling_inputs import build_sampling_batch
from workers.step_inputs import build_step_inputs

BS = 4
GREEDY = SamplingOptions(0.0, 1.0, 0, 0.0, 1, 1.0, 0.0, 0.0, 0, [], -1)


def _opts(**kw) -> SamplingOptions:
    base = dict(
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        seed=1,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
        min_tokens_stop_ids=[],
        num_logprobs=-1,
    )
    base.update(kw)
    return SamplingOptions(**base)


def _state(spec, max_blocks=9):
    """spec: [(computed, q_len, bound)]; block ids are distinct per row and position."""
    st = DeviceState(8, max_blocks * BS, max_blocks, 50, torch.device("cpu"))
    for h, (computed, q, ub) in enumerate(spec):
        st.add(
            NewRequest.of(
                h,
                [3 + (h * 5 + i) % 40 for i in range(computed + q)],
                [],
                GREEDY,
                [100 * (h + 1) + b for b in range(-(-ub // BS))],
            )
        )
        st.num_computed[st.row_of[h]] = computed
    return st


@pytest.mark.parametrize(
    "spec",
    [
        [(6, 1, 7)],  # 2 blocks: an even table width
        [(9, 1, 10), (3, 1, 4)],  # 3 blocks: odd, padded to a whole int64 word
        [(0, 5, 5), (30, 1, 31), (2, 3, 6)],  # mixed prefill + decode
        [(35, 1, 36)],  # 9 blocks = the whole table: the pad column lies past its end
    ],
    ids=["even", "odd", "mixed", "full-width"],
)
def test_packed_step_inputs_equal_the_reference(spec, monkeypatch):
    st = _state(spec)
    copies = []
    real = step_inputs.to_device
    monkeypatch.setattr(step_inputs, "to_device", lambda t, dev: copies.append(t.numel()) or real(t, dev))
    kernel_args = []
    real_prep = step_inputs.prepare_inputs
    monkeypatch.setattr(step_inputs, "prepare_inputs", lambda *a, **k: kernel_args.extend(a) or real_prep(*a, **k))
    plan = StepPlan(step_id=1, rows=[ScheduledRow(h, q, ub, [], True) for h, (_, q, ub) in enumerate(spec)])
    inp = build_step_inputs(plan, st, BS, True)
    assert len(copies) == 1, "rows, block table, lengths and indices travel in one copy"
    # every view of the packed copy starts on 16 bytes: Triton specialises kernels on pointer
    # alignment, so a batch-parity-dependent offset would compile new variants mid-serving
    views = [t for t in kernel_args if isinstance(t, torch.Tensor)] + [inp.window.capacity]
    assert len(views) >= 6 and all(t.data_ptr() % 16 == 0 for t in views), [t.data_ptr() % 16 for t in views]
    rows_cpu = [st.row_of[h] for h in range(len(spec))]
    assert inp.rows.tolist() == rows_cpu
    n_blk = -(-max(ub for _, _, ub in spec) // BS)
    want_table = st.block_table_cpu[rows_cpu, :n_blk]
    assert inp.meta.block_table.dtype == torch.int32
    assert torch.equal(inp.meta.block_table, want_table)
    q = torch.tensor([q for _, q, _ in spec])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)])
    # the query starts (not per-token lists) ship; the token count is a host int
    assert torch.equal(kernel_args[2], qsl) and type(kernel_args[3]) is int and kernel_args[3] == int(qsl[-1])
    cap = torch.tensor([st.num_blocks_cpu[r] * BS for r in rows_cpu])
    want = prepare_inputs_reference(
        st.num_computed[inp.rows].long(), inp.rows, qsl, int(qsl[-1]), q, cap, st.token_ids, want_table, BS
    )
    for got, ref in zip((inp.positions, inp.input_ids, inp.meta.seq_lens, inp.meta.slot_mapping), want):
        assert torch.equal(got, ref)
    ends = q.cumsum(0) - 1
    assert inp.logits_idx.tolist() == ends.tolist() and inp.sample_rows.tolist() == list(range(len(spec)))


def test_sampling_option_tensors_are_reused_only_for_the_same_requests(monkeypatch):
    st = DeviceState(4, 16, 4, 50, torch.device("cpu"))
    a, b = _opts(temperature=0.5, top_k=3, seed=7), _opts(repetition_penalty=1.3, seed=9)
    import workers.device_state as ds

    built = []
    real = ds.to_device
    monkeypatch.setattr(ds, "to_device", lambda *x, **k: built.append(1) or real(*x, **k))
    rows, pos = torch.tensor([0, 1]), torch.tensor([5, 6])
    first = build_sampling_batch([a, b], st, rows, pos)
    assert len(built) == 1, "one packed copy for every option"
    again = build_sampling_batch([a, b], st, rows, pos)
    assert len(built) == 1, "the same option objects: no new copy"
    assert again.temperature is first.temperature and again.top_k is first.top_k
    assert not again.all_greedy and again.any_top_k_top_p and again.penalties is not None
    swapped = build_sampling_batch([b, a], st, rows, pos)
    assert swapped.temperature.tolist() == [0.0, 0.5] and swapped.seeds.tolist() == [9, 7]
    assert swapped.top_k.tolist() == [0, 3] and swapped.top_p.tolist() == [1.0, 1.0]
    assert swapped.penalties.repetition.tolist() == pytest.approx([1.3, 1.0])
    equal_not_same = build_sampling_batch([_opts(), _opts()], st, rows, pos)  # new objects
    assert equal_not_same.all_greedy and equal_not_same.penalties is None
    assert equal_not_same.temperature.tolist() == [0.0, 0.0]
    assert build_sampling_batch([a], st, rows[:1], pos[:1]).temperature.tolist() == [0.5]


def _batch(n, **kw):
    base = dict(
        temperature=torch.zeros(n),
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        min_p=torch.zeros(n),
        seeds=torch.arange(n),
        positions=torch.zeros(n, dtype=torch.int64),
        all_greedy=True,
        any_top_k_top_p=False,
        any_min_p=False,
    )
    base.update(kw)
    return SamplingBatch(**base)


def test_sampler_takes_the_precomputed_argmax_only_for_unmodified_logits():
    logits = torch.randn(3, 11)
    marker = torch.full((3,), -1)  # no token id: shows which argmax was used
    assert sample(logits, _batch(3), raw_argmax=marker).token_ids.tolist() == [-1, -1, -1]
    assert torch.equal(sample(logits, _batch(3)).token_ids, logits.argmax(-1))
    forbid = torch.zeros(3, 11, dtype=torch.bool)
    forbid[:, logits.argmax(-1)] = True
    masked = sample(logits, _batch(3, min_tokens_mask=forbid), raw_argmax=marker).token_ids
    assert torch.equal(masked, logits.masked_fill(forbid, float("-inf")).argmax(-1))
    pen = PenaltyBatch(
        repetition=torch.full((3,), 2.0),
        presence=torch.zeros(3),
        frequency=torch.zeros(3),
        output_counts=torch.zeros(3, 11, dtype=torch.int32),
        prompt_mask=torch.ones(3, 11, dtype=torch.bool),
    )
    got = sample(logits, _batch(3, penalties=pen), raw_argmax=marker).token_ids
    assert torch.equal(got, apply_penalties(logits, pen).argmax(-1))


def test_step_inputs_built_into_the_decode_graph_buffers():
    """With graphs, a uniform decode step picks its graph from host values and its inputs are
    written into the graphs' static buffers (no copies before the replay); a prefill step
    picks none. The values equal a build without graphs."""
    from workers.cuda_graphs import DecodeGraphs

    spec = [(9, 1, 10), (3, 1, 4), (20, 1, 21)]
    graphs = DecodeGraphs(None, None, 8, 36, BS, 9, torch.device("cpu"), True)
    plan = StepPlan(step_id=1, rows=[ScheduledRow(h, q, ub, [], True) for h, (_, q, ub) in enumerate(spec)])
    got = build_step_inputs(plan, _state(spec), BS, True, graphs)
    want = build_step_inputs(plan, _state(spec), BS, True)
    assert got.graph_key == (4, graphs.buckets[0], 1) and want.graph_key is None
    # an eager pass takes the attention's fixed eager shapes; a graph keeps its tuned ones
    assert want.meta.eager and not graphs._meta(4, graphs.buckets[0], 1).eager
    for name, buf in (("positions", graphs.positions), ("input_ids", graphs.input_ids)):
        assert getattr(got, name).data_ptr() == buf.data_ptr()
        assert torch.equal(getattr(got, name), getattr(want, name))
    assert got.meta.seq_lens.data_ptr() == graphs.seq_lens.data_ptr()
    assert got.meta.slot_mapping.data_ptr() == graphs.slots.data_ptr()
    assert torch.equal(got.meta.seq_lens, want.meta.seq_lens)
    assert torch.equal(got.meta.slot_mapping, want.meta.slot_mapping)
    prefill = StepPlan(step_id=2, rows=[ScheduledRow(0, 5, 5, [], True)])
    assert build_step_inputs(prefill, _state([(0, 5, 5)]), BS, True, graphs).graph_key is None


def test_a_decode_graph_step_is_padded_by_its_input_kernel():
    """The step's build also pads the graph's rows (lengths, slots) and copies its block table
    into the static one (``DecodeGraphs.padding``), so ``load`` copies and fills nothing; the
    static buffers then hold what the copy-and-fill path of a build without padding left."""
    from workers.cuda_graphs import DecodeGraphs

    spec = [(9, 1, 10), (3, 1, 4), (20, 1, 21)]
    plan = StepPlan(step_id=1, rows=[ScheduledRow(h, q, ub, [], True) for h, (_, q, ub) in enumerate(spec)])
    padded = DecodeGraphs(None, None, 8, 36, BS, 9, torch.device("cpu"), True)
    copied = DecodeGraphs(None, None, 8, 36, BS, 9, torch.device("cpu"), True)
    for g in (padded, copied):  # stale contents from an earlier, larger step
        g.seq_lens.fill_(99)
        g.slots.fill_(1234)
        g.block_table.fill_(77)
    got = build_step_inputs(plan, _state(spec), BS, True, padded)
    assert got.meta.query_start_loc.data_ptr() == padded.qsl[1].data_ptr()
    assert (padded.seq_lens[3:4] == 1).all() and (padded.slots[3:4] == -1).all()
    assert torch.equal(padded.qsl[1], torch.arange(9, dtype=torch.int32))  # its values kept
    before = [t.clone() for t in (padded.seq_lens, padded.slots, padded.block_table)]
    padded.load(got, got.graph_key)  # nothing left to do
    assert all(torch.equal(a, b) for a, b in zip(before, (padded.seq_lens, padded.slots, padded.block_table)))
    import dataclasses

    ref = build_step_inputs(plan, _state(spec), BS, True, copied)
    ref_key = ref.graph_key
    copied.seq_lens[3:].fill_(99)  # undo the padding, then the copy-and-fill path (a build before it)
    copied.slots[3:].fill_(1234)
    copied.block_table.fill_(77)
    ref.meta = dataclasses.replace(ref.meta, query_start_loc=ref.meta.query_start_loc.clone())
    copied.load(ref, ref_key)
    b = ref_key[0]
    assert torch.equal(padded.seq_lens[:b], copied.seq_lens[:b])
    assert torch.equal(padded.slots[:b], copied.slots[:b])
    n_blk = got.meta.block_table.shape[1]
    assert torch.equal(padded.block_table[:3, :n_blk], copied.block_table[:3, :n_blk])


def test_pinned_pool_reuses_only_returned_buffers_of_the_same_size_and_dtype():
    from workers.pending_step import PinnedPool

    pool = PinnedPool()
    a, b = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.float64)
    pool.give(a, "ev-a")
    pool.give(b, "ev-b")
    assert pool.take(4, torch.int64) == (a, "ev-a")
    assert pool.take(4, torch.float64) == (b, "ev-b")
    assert not pool._free[(4, torch.int64)], "a buffer handed out is gone from the pool"
    for i in range(12):
        pool.give(torch.zeros(3), i)
    assert len(pool._free[(3, torch.float32)]) == 8


def test_packed_extras_come_back_whole_and_aligned():
    from workers.step_inputs import build_window

    st = _state([(9, 1, 10), (3, 2, 5), (0, 3, 3)])
    rows_cpu = [st.row_of[h] for h in range(3)]
    extras = [[7], [1, 2, 3], [4, 5], [9, 8, 7, 6, 5]]  # odd and even lengths
    win, back, rows = build_window(st, None, rows_cpu, [1, 2, 3], [10, 5, 3], None, BS, True, packed_extra=extras)
    assert [t.tolist() for t in back] == extras and rows.tolist() == rows_cpu
    assert all(t.data_ptr() % 16 == 0 for t in [*back, rows, win.capacity, win.block_table])


def test_int64_tensor_from_host_ints():
    """The array-backed list -> int64 conversion: concatenated parts, the empty case (which
    ``torch.frombuffer`` refuses), the int64 range's ends, and the array kept alive by the
    tensor alone (a CPU "copy" is that tensor itself)."""
    import gc

    from workers.device_state import int64_tensor, to_device

    big = [2**63 - 1, -(2**63), -1, 0, 2**40 + 3]
    t = int64_tensor(big)
    assert t.dtype == torch.int64 and t.tolist() == big
    assert int64_tensor([1, -2], [], range(3), (7,)).tolist() == [1, -2, 0, 1, 2, 7]
    for empty in (int64_tensor(), int64_tensor([]), int64_tensor([], [])):
        assert empty.dtype == torch.int64 and empty.shape == (0,)
    with pytest.raises(OverflowError):
        int64_tensor([2**63])
    kept = to_device(int64_tensor(list(range(-5, 1000))), torch.device("cpu"))
    gc.collect()
    _ = [list(range(1000, 2000)) for _ in range(50)]  # reuse freed memory, if it were freed
    assert kept.tolist() == list(range(-5, 1000))


def test_uniform_pads_rule():
    """Uneven rows pad to the smallest captured length that fits the longest; uniform rows,
    rows longer than every captured length, and padding past the rotary table: no padding."""
    from workers.step_inputs import uniform_pads

    assert uniform_pads([4, 2, 1], [30, 40, 50], (1, 4), 100) == [0, 2, 3]
    assert uniform_pads([3, 2], [30, 40], (1, 4, 6), 100) == [1, 2]
    assert uniform_pads([4, 4], [30, 40], (1, 4), 100) is None
    assert uniform_pads([5, 2], [30, 40], (1, 4), 100) is None
    assert uniform_pads([4, 2], [30, 99], (1, 4), 100) is None  # 99 + 2 > 100
    assert uniform_pads([4, 2], [30, 98], (1, 4), 100) == [0, 2]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_sampling_option_rows_start_on_16_bytes(n):
    """Every option row of the one packed copy starts on 16 bytes whatever the batch size: a
    kernel taking one (seeds, temperatures) is not recompiled for another alignment."""
    st = DeviceState(8, 16, 4, 50, torch.device("cpu"))
    opts = [_opts(temperature=0.1 * i, top_k=i, seed=100 + i) for i in range(n)]
    got = st.option_tensors.get(opts, st.device)
    for row in (*got.floats, *got.ints):
        assert row.data_ptr() % 16 == 0 and row.shape == (n,)
    assert got.ints[1].tolist() == [100 + i for i in range(n)] and got.ints[0].tolist() == list(range(n))
    assert got.floats[0].tolist() == pytest.approx([0.1 * i for i in range(n)])
    # the divisor sampling takes: the temperature, 1 for greedy rows (temperature 0)
    assert got.floats[6].tolist() == pytest.approx([1.0] + [0.1 * i for i in range(1, n)])


def test_placed_options_are_gathered_not_copied(monkeypatch):
    """Options written at placement are gathered by the step's rows: the same values as the
    packed copy (negative penalties, large seeds included), rows on 16 bytes, no copy; a
    request re-placed on another row (preemption) carries its options along."""
    import workers.device_state as ds

    st = DeviceState(8, 64, 4, 50, torch.device("cpu"))
    opts = [
        _opts(temperature=0.7, top_k=5, seed=2**40 + 3, presence_penalty=-0.5),
        _opts(top_p=0.9, min_p=0.05, seed=-7, frequency_penalty=0.25, repetition_penalty=1.2),
        _opts(temperature=1.3, min_tokens=4, seed=11),
    ]
    st.add_many([NewRequest.of(h, [1, 2, 3], [], o, [h]) for h, o in enumerate(opts)])
    rows = [st.row_of[h] for h in (2, 0, 1)]
    padded = torch.tensor(rows + [0], dtype=torch.int64)
    copies = []
    real = ds.to_device
    monkeypatch.setattr(ds, "to_device", lambda *x, **k: copies.append(1) or real(*x, **k))
    order = [opts[2], opts[0], opts[1]]
    got = ds.OptionTensors().get(order, st.device, st.option_table, padded)
    assert not copies, "gathered from the table: no host packing, no copy"
    want = ds.OptionTensors().get(order, st.device)
    assert len(copies) == 1
    for g, w in zip((*got.floats, *got.ints), (*want.floats, *want.ints)):
        assert torch.equal(g, w) and g.data_ptr() % 16 == 0 and g.shape == (3,)
    assert got.flags == want.flags
    st.release(0)  # preempted, then placed again: another row
    st.add_many([NewRequest.of(9, [1], [], _opts(temperature=0.2, seed=5), [7])])
    st.add_many([NewRequest.of(0, [1, 2, 3], [], opts[0], [6])])
    assert st.row_of[0] != rows[1]
    again = ds.OptionTensors().get([opts[0]], st.device, st.option_table, torch.tensor([st.row_of[0], 0, 0, 0]))
    assert again.ints[1].tolist() == [2**40 + 3] and again.floats[4].tolist() == [-0.5]
    assert again.floats[0].tolist() == pytest.approx([0.7]) and again.ints[0].tolist() == [5]


def test_a_mixed_steps_sampling_rows_come_with_its_inputs():
    """The sampling rows' device rows ride in the step's one copy (no index launch), padded
    to four entries with row 0; ``sampling_rows`` hands back the real ones."""
    st = DeviceState(8, 64, 8, 50, torch.device("cpu"))
    st.add_many([NewRequest.of(h, list(range(1, 8)), [], GREEDY, [h]) for h in range(3)])
    rows = [
        ScheduledRow(0, 7, 7, [], True),
        ScheduledRow(1, 4, 4, [], False),  # a prefill chunk: no sample
        ScheduledRow(2, 7, 7, [], True),
    ]
    inp = build_step_inputs(StepPlan(1, rows=rows), st, BS, True)
    want = [st.row_of[0], st.row_of[2]]
    assert inp.sample_device_rows.tolist() == want + [0, 0]
    s_rows, _ = step_inputs.sampling_rows(inp, inp.meta.seq_lens)
    assert s_rows.tolist() == want


@pytest.mark.parametrize(
    "spec, one_token",
    [([(9, 1, 10), (3, 1, 4), (20, 1, 21)], True), ([(0, 5, 5), (30, 1, 31)], False)],
    ids=["decode", "mixed"],
)
def test_commit_lengths_only_where_every_row_has_one_token(spec, one_token):
    """``commit_lengths``: a step of one token a row has its input kernel set the rows'
    ``num_computed`` (to the step's ``seq_lens``); a step with a longer row leaves it to the
    runner (its token programs read the starts the write would move)."""
    st = _state(spec)
    before = st.num_computed.clone()
    plan = StepPlan(step_id=1, rows=[ScheduledRow(h, q, ub, [], True) for h, (_, q, ub) in enumerate(spec)])
    inp = build_step_inputs(plan, st, BS, True, commit_lengths=True)
    assert inp.lengths_committed == one_token
    rows = [st.row_of[h] for h in range(len(spec))]
    if one_token:
        assert st.num_computed[rows].tolist() == inp.meta.seq_lens.tolist() == [c + 1 for c, _, _ in spec]
    else:
        assert torch.equal(st.num_computed, before)
    other = _state(spec)
    assert not build_step_inputs(plan, other, BS, True).lengths_committed  # (off unless asked)


def test_commit_lengths_only_in_launch_forms_start_up_compiled():
    """With graphs, only a step that replays a decode graph commits its lengths: a one-token
    step no decode graph takes (a row that does not sample: a prefill's last-but-one token)
    keeps the runner's update (its launch form, the mixed graph's or the eager one, is not
    compiled at start-up with the commit)."""
    from workers.cuda_graphs import DecodeGraphs

    spec = [(9, 1, 10), (3, 1, 4)]
    graphs = DecodeGraphs(None, None, 8, 36, BS, 9, torch.device("cpu"), True)
    rows = [ScheduledRow(0, 1, 10, [], True), ScheduledRow(1, 1, 4, [], True)]
    inp = build_step_inputs(StepPlan(step_id=1, rows=rows), _state(spec), BS, True, graphs, commit_lengths=True)
    assert inp.graph_key is not None and inp.lengths_committed
    rows[1] = ScheduledRow(1, 1, 4, [], False)  # no sampling: no decode graph
    inp = build_step_inputs(StepPlan(step_id=2, rows=rows), _state(spec), BS, True, graphs, commit_lengths=True)
    assert inp.graph_key is None and not inp.lengths_committed
