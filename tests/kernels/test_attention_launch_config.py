"""The decode attention launch's host-side choices (no kernel runs: the launch is recorded)."""

import pytest
import torch


@pytest.mark.parametrize(
    "reqs,hkv,bound,block_n,splits,stages",
    [
        (8, 8, 4124, 64, 9, 2),  # 64 (request, KV head) programs past SHORT_BOUND: 4 a SM
        (8, 8, 1024, 64, 5, 2),  # the same grid at a short bound: 2 a SM
        (4, 8, 4124, 128, 9, 2),  # 32 programs: wide tiles at any bound
        (1, 8, 1024, 128, 8, 1),  # batch 1: wide tiles, one a split: nothing to pipeline
        (1, 8, 8192, 128, 32, 2),  # batch 1, long bound: two tiles a split
        (32, 8, 4124, 64, 2, 2),  # 256 programs: narrow tiles, 2 a SM, as before
    ],
)
def test_decode_tiles_and_splits_from_cpu_bounds(monkeypatch, reqs, hkv, bound, block_n, splits, stages):
    """The one-query-token launch's tile width, split count (grid axis 2) and pipelining
    depth, from the batch shape and the length bound only."""
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
    pa.paged_attention_triton(q, cache, cache, table, seq, qsl, 1, bound, d**-0.5)
    ((grid, kw),) = launches
    assert (kw["BLOCK_N"], grid[2], kw["num_stages"]) == (block_n, splits, stages)


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


def _shape(lc):
    """What a launch compiles on (grid0 is a runtime size)."""
    return lc._replace(grid0=0)


@pytest.mark.parametrize("hkv,group_p", [(8, 4), (8, 2), (2, 4), (1, 8)])
def test_eager_launches_take_few_shapes(hkv, group_p):
    """Outside CUDA graphs every window of 2..DECODE_MAX_Q tokens takes the prefill shape, and
    one-token windows one tile and power-of-four split counts: the eager launches of every
    batch size and length bound fit a handful of compiled variants. Graph launches keep the
    tuned split counts (b8 at a 1,024 bound: 5)."""
    from kernels.attention_splits import DECODE_MAX_Q, launch_config

    prefill = _shape(launch_config(3, 300, hkv, group_p, 128, DECODE_MAX_Q + 1, 1024, eager=True))
    bounds = list(range(1, 9000, 37)) + [512, 1024, 2048, 2049, 4096, 4097, 8192]
    one_token = set()
    for reqs in range(1, 257):
        for q in range(2, DECODE_MAX_Q + 1):
            lc = launch_config(reqs, reqs * q, hkv, group_p, 128, q, 4096, eager=True)
            assert _shape(lc) == prefill, (reqs, q)
            assert lc.grid0 >= reqs * q // lc.block_q + reqs - 1  # covers every query block
        for bound in bounds:
            lc = launch_config(reqs, reqs, hkv, group_p, 128, 1, bound, eager=True)
            assert lc.num_splits in (1, 4, 16, 64), (reqs, bound, lc.num_splits)
            one_token.add(_shape(lc))
    # one tile width and depth x split counts 1, 4, 16, 64
    assert len({(s.block_n, s.num_stages, s.num_warps) for s in one_token}) == 1, one_token
    assert len(one_token) <= 4
    exact = {
        launch_config(8, 8, 8, 4, 128, 1, 1024).num_splits,
        launch_config(8, 8, 8, 4, 128, 1, 1024, eager=True).num_splits,
    }
    assert exact == {5, 4}


def test_eager_flag_reaches_the_attention_launch(monkeypatch):
    """``AttentionMetadata.eager`` of a pass decides the launch shape: a 6-token window in an
    eager pass launches the prefill shape, the same window in a graph capture one query block
    a request."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw))

    from kernels import ops
    from kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_paged_attention_kernel", Recorder())
    monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    reqs, q_len, hkv, d, bound = 2, 6, 2, 64, 100
    q = torch.zeros(reqs * q_len, 4 * hkv, d)
    cache = torch.zeros(16, 16, hkv, d)
    table = torch.zeros(reqs, 8, dtype=torch.int32)
    seq = torch.full((reqs,), bound, dtype=torch.int32)
    qsl = torch.arange(0, reqs * q_len + 1, q_len, dtype=torch.int32)
    for eager in (True, False):
        ops.paged_attention(q, cache, cache, table, seq, qsl, qsl, q_len, bound, d**-0.5, eager=eager)
    (g_eager, kw_eager), (g_graph, kw_graph) = launches
    assert not kw_eager["ONE_QBLOCK_PER_REQ"] and kw_eager["NUM_SPLITS"] == 1
    assert kw_graph["ONE_QBLOCK_PER_REQ"] and g_graph[0] == reqs


def test_one_token_depth_follows_split_overrides(monkeypatch):
    """The one-stage rule is judged on the tiles a split really gets: a batch-1 launch at a
    1,024 bound has one 128-key tile a split (1 stage) with its own 8 splits, two with 4."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw["num_stages"])

    from kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_paged_attention_kernel", Recorder())
    d, hkv, bound = 128, 8, 1024
    q = torch.zeros(1, 4 * hkv, d, dtype=torch.bfloat16)
    cache = torch.zeros(bound // 16 + 1, 16, hkv, d, dtype=torch.bfloat16)
    table = torch.zeros(1, bound // 16 + 1, dtype=torch.int32)
    seq, qsl = torch.full((1,), bound, dtype=torch.int32), torch.arange(2, dtype=torch.int32)
    for splits in (None, 4):
        pa.paged_attention_triton(q, cache, cache, table, seq, qsl, 1, bound, d**-0.5, num_splits=splits)
    assert launches == [1, 2]


def test_model_attention_passes_the_eager_flag(monkeypatch):
    """``Attention.attend_core`` hands ``AttentionMetadata.eager`` to the attention op."""
    from kernels import ops
    from metadata.attention_metadata import AttentionMetadata
    from workers.distributed import TPGroup
    from workers.models.arch import ModelArch
    from workers.models.llama import Attention

    arch = ModelArch(
        "LlamaForCausalLM",
        64,
        32,
        64,
        1,
        4,
        2,
        8,
        1e-6,
        10000.0,
        None,
        64,
        False,
        False,
        False,
        False,
        (1,),
        None,
        None,
    )
    attn = Attention(arch, TPGroup(), torch.float32)
    seen = []

    def record(positions, q, *args, eager=None, **kw):
        seen.append(eager)
        return q

    monkeypatch.setattr(ops, "rope_and_attention", record)
    for eager in (True, False):
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([1], dtype=torch.int32),
            seq_lens_upper_bound=torch.tensor([1], dtype=torch.int32),
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=torch.zeros(1, dtype=torch.int64),
            positions=torch.zeros(1, dtype=torch.int64),
            num_reqs=1,
            num_actual_tokens=1,
            max_query_len=1,
            max_seq_len_upper_bound=1,
            bounds_are_exact=True,
            eager=eager,
        )
        attn.attend_core(torch.zeros(1, (4 + 2 * 2) * 8), meta.positions, meta, (None, None), None)
    assert seen == [True, False]


@pytest.mark.parametrize("hkv,group_p,sms", [(8, 2, 132), (8, 4, 132), (2, 4, 132), (1, 8, 40), (4, 1, 8)])
def test_eager_one_token_cases_cover_every_shape(hkv, group_p, sms):
    """The start-up cases of ``enforce_eager`` (``workers.eager_warm_up``) reach every eager
    one-token launch variant -- its shape, with or without PDL, with or without rope inside
    -- that any batch of 1..max_num_seqs requests and any bound of 1..max_model_len reaches
    (brute force over every bound), one case each."""
    from kernels.attention_splits import eager_one_token_cases, launch_config

    max_seqs, max_len = 40, 2600

    def variant_of(reqs, bound):  # e.g. pdl_max_tokens=2; ops' rope limits, smaller
        return reqs <= 2, reqs <= 8 and reqs * bound <= 3000

    def key(reqs, bound):
        return (
            _shape(launch_config(reqs, reqs, hkv, group_p, 128, 1, bound, sms, eager=True)),
            variant_of(reqs, bound),
        )

    every = {key(r, b) for r in range(1, max_seqs + 1) for b in range(1, max_len + 1)}
    cases = eager_one_token_cases(hkv, group_p, 128, max_seqs, max_len, sms, variant_of)
    got = [key(r, b) for r, b in cases]
    assert set(got) == every
    assert len(got) == len(every)  # one pass per shape, none repeated
    assert all(1 <= r <= max_seqs and 1 <= b <= max_len for r, b in cases)
    assert len({k[0].num_splits for k in every}) > 1  # the grid spans several split counts


def test_eager_decode_cases_follow_the_model_heads():
    """``eager_decode_cases`` reads the model's per-rank heads and head size: with 4 KV heads a
    rank (a TP split) the one-request pass reaches more splits than with 8."""
    from kernels.attention_splits import launch_config
    from workers.eager_warm_up import eager_decode_cases, scratch_decode_meta

    def model(hq, hkv):
        attn = type("A", (), dict(num_heads=hq, num_kv_heads=hkv, head_dim=128))()
        return type("M", (), dict(layers=[type("L", (), dict(self_attn=attn))()]))()

    cpu = torch.device("cpu")
    wide = eager_decode_cases(model(16, 8), 64, 40960, cpu)
    narrow = eager_decode_cases(model(4, 2), 64, 40960, cpu)

    def splits(cases, hkv, g):
        return {launch_config(r, r, hkv, g, 128, 1, b, eager=True).num_splits for r, b in cases}

    assert splits(wide, 8, 2) == {1, 4, 16}
    assert splits(narrow, 2, 2) == {1, 4, 16, 64}
    meta = scratch_decode_meta(3, 700, 16, cpu)
    assert meta.block_table.shape == (3, 44) and meta.max_seq_len_upper_bound == 700
    assert bool((meta.slot_mapping == -1).all()) and meta.eager and meta.max_query_len == 1
