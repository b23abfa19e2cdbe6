"""The input kernel reading its step from the stage's header (``workers.input_graphs``,
``kernels.input_header``) under the interpreter, against the same step built the usual way
(``build_window`` without an input graph: the torch reference on the CPU) into a second,
identical device state and set of graph buffers: every static buffer the graph reads,
every state tensor a placement writes and the rows' lengths must agree (run in an
interpreted child pytest: see ``tests/interpreted.py``). Uncaptured, ``InputGraphs.run``
launches the kernel itself: the captured graph replays that very launch."""

import pytest
import torch

from metadata.wire import NewRequest, SamplingOptions
from tests.interpreted import delegate_all

ROWS, MAX_LEN, VOCAB, BS = 12, 64, 97, 4
MAX_BLOCKS = MAX_LEN // BS + 1
STATE = ("token_ids", "num_computed", "prompt_len", "prompt_mask", "output_counts", "option_table")


def _opts(i: int, penalty: bool = False) -> SamplingOptions:
    return SamplingOptions(0.7 * (i % 2), 1.0, 0, 0.0, i, 1.3 if penalty else 1.0, 0.0, 0.0, 0, [], -1)


def _world(seed: int, dev=torch.device("cpu")):
    """A device state with five running rows and the (uncaptured) graphs' static buffers."""
    from workers.cuda_graphs import DecodeGraphs
    from workers.device_state import DeviceState
    from workers.mixed_graphs import MixedGraphs

    st = DeviceState(ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, dev)
    g = torch.Generator().manual_seed(seed)
    run = []
    for h in range(5):
        prompt = torch.randint(0, VOCAB, (9 + h,), generator=g).tolist()
        run.append(NewRequest.of(h, prompt, [], _opts(h), list(range(4 * h, 4 * h + 4))))
    st.add_many(run)
    st.num_computed[:5] = torch.randint(3, 12, (5,), generator=g, dtype=torch.int32).to(dev)
    decode = DecodeGraphs(None, None, ROWS, MAX_LEN, BS, MAX_BLOCKS, dev, True)
    mixed = MixedGraphs(None, None, 64, ROWS, MAX_LEN, MAX_BLOCKS, dev, True, logits_rows=ROWS)
    for graphs in (decode, mixed):  # (garbage: every value a step needs is written)
        for name in ("input_ids", "positions", "seq_lens", "slots", "block_table"):
            getattr(graphs, name).fill_(-7)
    mixed.qsl.fill_(-7)
    mixed.logits_idx.fill_(-7)
    return st, decode, mixed


def _new(seed: int, penalty: bool):
    """A plain prompt, a prefix-cache hit and a resumed request with outputs (and penalties)."""
    g = torch.Generator().manual_seed(seed + 100)
    p = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [
        NewRequest.of(20, p(11), [], _opts(1), [20, 21, 22]),
        NewRequest.of(21, p(13), [], _opts(2), [23, 24, 25, 26], num_cached_tokens=8),
        NewRequest.of(22, p(6), p(5), _opts(3, penalty), [27, 28, 29], num_cached_tokens=4),
    ], [11, 5, 7]


def _step(world, handles, q_lens, kind, graphs, new=None):
    """``build_window`` of one step on ``world``, through ``graphs`` (an ``InputGraphs``) or not."""
    from workers.step_inputs import build_window

    st, decode, mixed = world
    staged = st.stage(new) if new else None
    rows_cpu = [st.row_of[h] for h in handles]
    ubs = [MAX_LEN - 8] * len(handles)  # (bounds: no device read)
    n, t = len(handles), sum(q_lens)
    if kind == "decode":
        b = next(s for s in decode.sizes if s >= n)
        key = ("decode", b)
        out, pad = decode.static_inputs(n, t), decode.padding((b, 0, 1), n)
    else:
        key = ("mixed", mixed.bucket(t))
        out, pad = mixed.static_inputs(n, t), mixed.padding(t, 2)
    extra = [[t - 1, 0]] if kind == "mixed" else None
    win, back, rows = build_window(
        st, None, rows_cpu, q_lens, ubs, None, BS, True, packed_extra=extra, out=out, graph_pad=pad,
        placement=staged, commit_lengths=kind == "decode", input_graph=(graphs, key) if graphs else None,
    )  # fmt: skip
    if not win.lengths_committed:  # (what ModelRunner does after the forward)
        st.num_computed[rows] = win.meta.seq_lens
    return win, key


def _graphs(world):
    from workers.input_graphs import build_input_graphs

    st, decode, mixed = world
    ig = build_input_graphs(st, BS, decode, mixed, ROWS, MAX_BLOCKS, st.device)
    if st.device.type == "cuda":
        ig.capture()
    return ig


def _same(a, b, key):
    """Every buffer the step's graph reads, and the state, equal in worlds ``a`` and ``b``."""
    (sa, da, ma), (sb, db, mb) = a, b
    g_a, g_b = (da, db) if key[0] == "decode" else (ma, mb)
    names = ["input_ids", "positions", "seq_lens", "slots", "block_table"]
    names += ["logits_idx"] if key[0] == "mixed" else []
    for name in names:
        x, y = getattr(g_a, name), getattr(g_b, name)
        assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"
    qa, qb = (da.qsl[1], db.qsl[1]) if key[0] == "decode" else (ma.qsl, mb.qsl)
    assert torch.equal(qa, qb), f"qsl: {qa.tolist()} != {qb.tolist()}"
    for name in STATE:
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name


@pytest.mark.parametrize("n", [1, 3, 5])
def test_decode_step_from_the_header_matches_the_launch(n):
    """One token a row, padded to the graph's batch size; the rows' lengths committed."""
    a, b = _world(n), _world(n)
    ig = _graphs(a)
    handles = [4, 1, 0, 3, 2][:n]
    _, key = _step(a, handles, [1] * n, "decode", ig)
    _step(b, handles, [1] * n, "decode", None)
    assert ig.replays == 1
    _same(a, b, key)
    assert torch.equal(a[0].num_computed, b[0].num_computed)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("penalty", [False, True])
def test_mixed_step_placing_new_requests_from_the_header_matches_the_launch(seed, penalty):
    """Running rows (a decode row, a chunk) around new requests placed by the same launch."""
    a, b = _world(seed), _world(seed)
    ig = _graphs(a)
    reqs, q_new = _new(seed, penalty)
    handles = [3, 20, 0, 21, 4, 22]
    q_lens = [1, q_new[0], 3, q_new[1], 1, q_new[2]]
    win, key = _step(a, handles, q_lens, "mixed", ig, reqs)
    _step(b, handles, q_lens, "mixed", None, _new(seed, penalty)[0])
    assert ig.replays == 1 and key == ("mixed", 32)
    assert win.lengths_committed  # (by the graph's second kernel)
    _same(a, b, key)


def test_a_placement_past_the_graphs_capacity_is_placed_before_it(monkeypatch):
    """More staged tokens than the input graph's launch places: placed on their own first."""
    import workers.input_graphs as ig_mod

    monkeypatch.setattr(ig_mod, "place_tokens", lambda bucket: 8)
    a, b = _world(5), _world(5)
    ig = _graphs(a)
    assert ig.shapes[("mixed", 32)].place_tokens == 8
    reqs, q_new = _new(5, False)
    handles, q_lens = [0, 20, 21], [1, q_new[0], q_new[1]]
    _, key = _step(a, handles, q_lens, "mixed", ig, reqs[:2])
    _step(b, handles, q_lens, "mixed", None, _new(5, False)[0][:2])
    assert ig.replays == 1
    _same(a, b, key)


def test_a_step_too_large_for_the_stage_takes_the_launch():
    """A stage too small for the step: the input kernel's own launch, the same results."""
    from workers.input_graphs import InputGraphs

    a, b = _world(6), _world(6)
    full = _graphs(a)
    small = InputGraphs(a[0], BS, 40, torch.device("cpu"))
    small.shapes, small._launch = full.shapes, full._launch
    _, key = _step(a, [0, 1, 2], [1, 1, 1], "decode", small)
    _step(b, [0, 1, 2], [1, 1, 1], "decode", None)
    assert small.replays == 0
    _same(a, b, key)


def test_header_words_name_every_segment():
    from kernels.input_header import HEADER_WORDS, header_words, search_halvings

    words = header_words(10, 3, 4, 4, 16, 8, 8, 1, {"rows": 40, "new_j": 90})
    assert len(words) == HEADER_WORDS
    assert words[:13] == [10, 3, search_halvings(10, 3), 4, 4, 16, 8, 0, 8, 1, 0, 0, 0]
    assert words[13] == 40 and words[20] == 90 and words[14:20] == [0] * 6
    with pytest.raises(ValueError, match="unknown segments"):
        header_words(1, 1, 1, 2, 1, 1, 1, 1, {"table": 3})


delegate_all(globals(), __file__)  # parent process: each test reports its child run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_captured_input_graphs_match_the_launch():
    """On the device: the captured graphs replayed over the stage, against the input
    kernel's own launch; then three steps in a row through one stage (stream order alone
    keeps a step's words until its graph has read them)."""
    cuda = torch.device("cuda")
    for n in (1, 5):
        a, b = _world(n, cuda), _world(n, cuda)
        ig = _graphs(a)
        assert len(ig.graphs) == len(ig.shapes)
        handles = [4, 1, 0, 3, 2][:n]
        _, key = _step(a, handles, [1] * n, "decode", ig)
        _step(b, handles, [1] * n, "decode", None)
        _same(a, b, key)
    for seed in range(3):
        a, b = _world(seed, cuda), _world(seed, cuda)
        ig = _graphs(a)
        reqs, q_new = _new(seed, seed == 1)
        handles = [3, 20, 0, 21, 4, 22]
        q_lens = [1, q_new[0], 3, q_new[1], 1, q_new[2]]
        torch.cuda._sleep(50_000_000)  # (the device busy: the copies and replays queue behind it)
        _, key = _step(a, handles, q_lens, "mixed", ig, reqs)
        _step(b, handles, q_lens, "mixed", None, _new(seed, seed == 1)[0])
        _same(a, b, key)
        for w, graphs in ((a, ig), (b, None)):  # two decode steps after it, through the same stage
            for _ in range(2):
                _step(w, handles, [1] * 6, "decode", graphs)
        torch.cuda.synchronize()
        _same(a, b, ("decode", 8))
        assert ig.replays == 3
