"""Worker-side ubatches: sliced metadata equals a direct build, and split steps equal unsplit ones."""

import os
import socket

import pytest
import torch

from metadata.config import EngineConfig
from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan, decode_plan, encode
from workers.device_state import DeviceState
from workers.step_inputs import build_step_inputs
from workers.ubatch import should_split, slice_metadata, split_metadata, split_point

BS = 8
GREEDY = SamplingOptions(0.0, 1.0, 0, 0.0, 1, 1.0, 0.0, 0.0, 0, [], -1)
FIELDS = [
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "seq_lens_upper_bound",
    "block_table",
    "slot_mapping",
    "positions",
    "num_reqs",
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len_upper_bound",
    "bounds_are_exact",
]


def _state(spec):
    """spec: [(computed, q_len, upper_bound)] -> device state with those rows placed."""
    st = DeviceState(8, 64, 16, 50, torch.device("cpu"))
    for h, (computed, q, ub) in enumerate(spec):
        n = computed + q
        st.add(
            NewRequest.of(
                h, [3 + (h * 7 + i) % 40 for i in range(n)], [], GREEDY, [h * 8 + b for b in range((ub + BS - 1) // BS)]
            )
        )
        st.num_computed[st.row_of[h]] = computed
    return st


def _plan(rows):
    return StepPlan(step_id=1, rows=[ScheduledRow(h, q, ub, [], True) for h, q, ub in rows])


def _direct_slices(spec, cut):
    """Each half's plan built from scratch: the straddling request appears in both, with
    the first half's share ending at the cut and the second half's starting after it."""
    a_rows, b_rows, b_adv, start = [], [], {}, 0
    for h, (computed, q, ub) in enumerate(spec):
        end = start + q
        if start < cut:
            a_rows.append((h, min(end, cut) - start, ub - (end - min(end, cut))))
        if end > cut:
            first = max(start, cut)
            b_rows.append((h, end - first, ub))
            b_adv[h] = first - start  # tokens of this request already in the first half
        start = end
    return a_rows, b_rows, b_adv


def _assert_meta_equal(got, want):
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and torch.equal(g, w), f"{f}: {g} != {w}"
        else:
            assert g == w, f"{f}: {g} != {w}"


@pytest.mark.parametrize(
    "spec",
    [
        [(5, 7, 12), (0, 10, 10), (19, 1, 22)],  # a prefill chunk straddles; the decode row's bound is optimistic
        [(0, 4, 4), (0, 4, 4)],  # the cut falls on a request boundary
        [(3, 17, 21)],  # one request split in two
        [(9, 1, 10), (0, 12, 12), (30, 1, 31), (2, 3, 6)],
    ],
    ids=["straddle", "boundary", "single", "mixed"],
)
def test_sliced_metadata_equals_direct_build(spec):
    exact = all(computed + q == ub for computed, q, ub in spec)
    st = _state(spec)
    full = build_step_inputs(_plan([(h, q, ub) for h, (_, q, ub) in enumerate(spec)]), st, BS, exact).meta
    before = {f: getattr(full, f).clone() for f in ("seq_lens", "seq_lens_upper_bound", "query_start_loc")}
    cut, (a, b) = split_metadata(full, BS)
    assert cut == split_point(full.num_actual_tokens) == full.num_actual_tokens // 2
    a_rows, b_rows, b_adv = _direct_slices(spec, cut)
    _assert_meta_equal(a, build_step_inputs(_plan(a_rows), st, BS, exact).meta)
    st_b = _state(spec)  # the second half runs after the first half's tokens are computed
    for h, adv in b_adv.items():
        st_b.num_computed[st_b.row_of[h]] += adv
    _assert_meta_equal(b, build_step_inputs(_plan(b_rows), st_b, BS, exact).meta)
    for f, v in before.items():  # adjusted by cloning: the step's metadata is untouched
        assert torch.equal(getattr(full, f), v), f"{f} was mutated"


def test_split_decision():
    assert not should_split(100, None)
    assert not should_split(8, 8) and should_split(9, 8)
    assert not should_split(1, 0) and should_split(2, 1)
    meta = build_step_inputs(_plan([(0, 5, 5)]), _state([(0, 5, 5)]), BS, True).meta
    with pytest.raises(ValueError):
        slice_metadata(meta, 3, 3)


# ------------------------------------------------------------------ model steps
def _plans():
    """Prefills (one chunked across steps), then mixed decode + prefill steps."""
    blocks = lambda h: [h * 8 + i for i in range(8)]  # noqa: E731
    prompts = {1: list(range(3, 8)), 2: list(range(10, 23)), 3: list(range(30, 39)), 4: list(range(40, 60))}
    new = lambda h: NewRequest.of(h, prompts[h], [], GREEDY, blocks(h))  # noqa: E731
    L = {h: len(p) for h, p in prompts.items()}
    return [
        StepPlan(
            1, new_requests=[new(1), new(2), new(3)], rows=[ScheduledRow(h, L[h], L[h], [], True) for h in (1, 2, 3)]
        ),
        StepPlan(
            2,
            new_requests=[new(4)],
            rows=[
                ScheduledRow(1, 1, L[1] + 1, [], True),
                ScheduledRow(4, 12, 12, [], False),
                ScheduledRow(2, 1, L[2] + 1, [], True),
            ],
        ),
        StepPlan(
            3,
            rows=[
                ScheduledRow(4, 8, 20, [], True),
                ScheduledRow(3, 1, L[3] + 1, [], True),
                ScheduledRow(1, 1, L[1] + 2, [], True),
            ],
        ),
    ]


def _runner(model_dir, tp=None):
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    cfg = EngineConfig.from_options(num_kv_blocks=40, block_size=BS, max_num_seqs=8)
    r = ModelRunner(cfg, str(model_dir), torch.device("cpu"), tp or TPGroup(), 128)
    r.init_kv_cache(40)
    r.logits = []
    inner = r.model.compute_logits
    r.model.compute_logits = lambda h: r.logits.append(inner(h)) or r.logits[-1]
    return r


def _run_both(model_dir, plans, threshold, tp=None):
    plain, split = _runner(model_dir, tp), _runner(model_dir, tp)
    split.enable_ubatching(threshold)
    toks = {"plain": [], "split": []}
    for data in plans:
        for name, r in (("plain", plain), ("split", split)):
            res = r.execute(decode_plan(data))
            toks[name].append([(o.handle, o.token_ids) for o in res.outputs])
    return plain.logits, split.logits, toks, split.model.num_split_steps


def test_ubatched_step_equals_unsplit_step(ckpt_dir):
    torch.set_num_threads(1)
    plain, split, toks, n_split = _run_both(ckpt_dir("llama"), [encode(p) for p in _plans()], 8)
    assert n_split == 3  # 27, 14 and 10 tokens: every step passed the threshold
    assert toks["plain"] == toks["split"]
    for a, b in zip(plain, split):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


class _TPPair:
    """One rank of a TP=2 gloo group running the plans with and without ubatches."""

    def __init__(self, model_dir, rank, init):
        torch.set_num_threads(1)
        from workers.distributed import init_distributed

        self.tp = init_distributed("gloo", init, rank, 2, 2)
        self.model_dir = model_dir

    def run(self, plans, threshold):
        plain, split, toks, n = _run_both(self.model_dir, plans, threshold, self.tp)
        return [t.tolist() for t in plain], [t.tolist() for t in split], toks, n


def test_ubatched_step_equals_unsplit_step_tp2(ray_local, ckpt_dir):
    """With TP=2 the halves overlap (async all-reduce + turn taking); logits still match."""
    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cls = ray.remote(_TPPair).options(num_cpus=1, runtime_env={"env_vars": {"PYTHONPATH": root}})
    model = str(ckpt_dir("llama"))
    pair = [cls.remote(model, rank, init) for rank in (0, 1)]
    try:
        plans = [encode(p) for p in _plans()]
        out = ray.get([a.run.remote(plans, 8) for a in pair], timeout=120)
    finally:
        for a in pair:
            ray.kill(a)
    for plain, split, toks, n_split in out:
        assert n_split == 3 and toks["plain"] == toks["split"]
        for a, b in zip(plain, split):
            torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-5)
    assert out[0][2] == out[1][2]  # both ranks sampled the same tokens
