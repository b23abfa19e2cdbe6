"""Every decode-path Triton kernel compiles for the GPU target (sm_90, Hopper) on this CPU.

``triton.compile`` runs the whole pipeline (front end, LLVM, the bundled ``ptxas``) without
a device, so a kernel that the interpreter accepts but the compiler refuses (a plain
Python global, a loop variable that changes type, bad inline PTX) fails here, in CI,
instead of on the GPU machine. The constexpr sets are the ones the engine launches on a
Hopper GPU: PDL on, the L2 prefetches on, the fused split merge, the wide decode tiles."""

import pytest
import triton

from tests.kernels.sm90 import compile_sm90 as _compile
from tests.kernels.sm90 import resource_usage as _resource_usage


SKINNY = dict(
    HAS_NORM=True,
    HAS_RES=True,
    HAS_BIAS=False,
    ACT=1,
    BLOCK_M=1,
    BLOCK_N=4,
    BLOCK_K=1024,
    EVEN_K=True,
    IEEE=False,
    UPCAST=False,
    USE_PDL=True,
    PRELOAD=0,
    EPI_NORM=False,
    PRE_NORMED=False,
    BLOCK_P=1,
)


@pytest.mark.parametrize(
    "variant",
    [
        dict(USE_DOT=False, PREFETCH=True),  # batch 1, PDL
        dict(USE_DOT=True, PREFETCH=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256),
        dict(USE_DOT=False, PREFETCH=True, ACT=2, BLOCK_N=8),  # gate|up pairs
        # the shipped batch-1 configs under PDL: the first K chunk peeled before the wait
        dict(USE_DOT=False, PREFETCH=False, PRELOAD=1, ACT=2, BLOCK_N=8),
        dict(USE_DOT=False, PREFETCH=False, PRELOAD=2, ACT=2, BLOCK_N=8),
        dict(
            USE_DOT=False,
            PREFETCH=False,
            PRELOAD=2,
            ACT=0,
            HAS_RES=False,
            HAS_NORM=False,
            BLOCK_N=8,
            EVEN_K=False,
        ),
        dict(USE_DOT=True, PREFETCH=False, PRELOAD=1, ACT=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256),
        dict(USE_DOT=True, PREFETCH=False, ACT=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256),
        # the norm handoff at batch 1 under PDL: producer epilogue, pre-normed consumer
        dict(
            USE_DOT=False,
            PREFETCH=False,
            PRELOAD=1,
            ACT=0,
            HAS_RES=False,
            HAS_NORM=False,
            BLOCK_N=8,
            EPI_NORM=True,
        ),
        dict(
            USE_DOT=False,
            PREFETCH=False,
            PRELOAD=1,
            ACT=2,
            HAS_RES=False,
            HAS_NORM=False,
            BLOCK_N=8,
            PRE_NORMED=True,
            BLOCK_P=512,
        ),
    ],
)
def test_skinny_gemm_compiles(variant):
    from kernels.skinny_gemm_kernel import _skinny_kernel

    _compile(_skinny_kernel, {**SKINNY, **variant}, {"ss_ptr": "*fp32"}, floats=("eps",))


@pytest.mark.parametrize(
    "variant",
    [
        dict(HAS_NORM=True, HAS_RES=True, HAS_BIAS=False, ACT=True, USE_PDL=True),
        dict(HAS_NORM=False, HAS_RES=False, HAS_BIAS=True, ACT=False, USE_PDL=False),
    ],
)
def test_persistent_gemv_compiles(variant):
    from kernels.gemv import _gemv_kernel

    _compile(_gemv_kernel, dict(variant, BLOCK_N=4, BLOCK_K=1024), {"y_ptr": "*fp32"}, floats=("eps",))


@pytest.mark.parametrize(
    "decode,rope,head_dim,preload",
    [
        (True, False, 128, False),
        (True, True, 128, False),
        (True, True, 32, False),
        (False, False, 128, False),
        (True, True, 128, True),
    ],
)
def test_paged_attention_compiles(decode, rope, head_dim, preload):
    from kernels.paged_attention import row_lines
    from kernels.paged_attention_kernel import _paged_attention_kernel

    # head_dim 32 (test checkpoints): a K/V row is a quarter of a cache line
    lines = row_lines(head_dim, 2)
    assert lines["ROW_LINES"] >= 1 and lines["ROW_LINES"] * lines["LINE_ELEMS"] >= head_dim
    const = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=head_dim,
        KV_BLOCK_SIZE=16,
        GROUP=4,
        GROUP_P=4,
        IEEE=False,
        UPCAST=False,
        USE_PDL=True,
        ROPE=rope,
        Q_NORM=rope,
        K_NORM=rope,
        PRELOAD=preload,
        **lines,
    )
    if decode:  # one query token, 128-key tiles, fused split merge
        const.update(BLOCK_Q=1, BLOCK_M=16, BLOCK_N=128, NUM_SPLITS=8, ONE_QBLOCK_PER_REQ=True, FUSED_REDUCE=True)
    else:  # prefill: query blocks found by binary search
        const.update(BLOCK_Q=32, BLOCK_M=128, BLOCK_N=64, NUM_SPLITS=1, ONE_QBLOCK_PER_REQ=False, FUSED_REDUCE=False)
    i32 = {n: "*i32" for n in ("sem_ptr", "block_table_ptr", "seq_lens_ptr", "qsl_ptr")}
    ptrs = {**i32, "out_ptr": "*fp32", "lse_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "cs_ptr": "*fp32"}
    # PRELOAD (one tile a split: one stage) launches with 8 warps (K and V held across the
    # PDL wait spill with 4)
    options = dict(num_warps=8, num_stages=1) if preload else None
    c = _compile(_paged_attention_kernel, const, ptrs, floats=("scale_log2", "eps"), options=options)
    if preload or (decode and not rope):  # ... and the fused merge's unrolled loads
        assert _resource_usage(c.asm["cubin"])[1] == 0, "spills"


def test_sampling_kernels_compile():
    from kernels.argmax import _argmax_partial_kernel, _argmax_reduce_kernel
    from kernels.sampling import _race_partial_kernel, _race_reduce_kernel

    ints = {"idx_ptr": "*i32", "nan_ptr": "*i32", "seed_ptr": "*i64", "pos_ptr": "*i64", "out_ptr": "*i64"}
    _compile(_argmax_partial_kernel, dict(BLOCK=2048, USE_PDL=True), ints, default_ptr="*fp32")
    _compile(_argmax_reduce_kernel, dict(SPLITS=64, USE_PDL=True), ints, default_ptr="*fp32")
    _compile(_race_partial_kernel, dict(BLOCK=2048, USE_PDL=True), ints, default_ptr="*fp32")
    _compile(_race_reduce_kernel, dict(SPLITS=64, USE_PDL=True), ints, default_ptr="*fp32")


def test_spec_verify_kernels_compile():
    from kernels.spec_verify import _accept_commit_kernel, _verify_slots_kernel

    i64 = {n: "*i64" for n in ("spec_idx_ptr", "ids_ptr", "draft_idx_ptr", "nd_ptr", "seeds_ptr", "pos_ptr")}
    i64.update(q_rows_ptr="*i64", recovered_ptr="*i64", accept_ptr="*i8", logits_ptr="*bf16")
    i64.update(bonus_idx_ptr="*i64", bonus_ptr="*i64")
    for has_q in (False, True):
        for probs in (False, True):
            _compile(
                _verify_slots_kernel, dict(HAS_Q=has_q, PROBS=probs, BLOCK=2048), i64, "*fp32", aligned_ints=("vocab",)
            )
    i64 = {n: "*i64" for n in ("recovered_ptr", "ids_ptr", "draft_idx_ptr", "nd_ptr", "bonus_ptr", "pos_ptr")}
    i64.update(rows_ptr="*i64", tok_table_ptr="*i64", tokens_ptr="*i64", n_acc_ptr="*i64", known_ptr="*i64")
    i64.update(accept_ptr="*i8")
    for count in (False, True):
        _compile(_accept_commit_kernel, dict(COUNT=count), i64, default_ptr="*i32")
    from kernels.draft_sample import _draft_inputs_kernel, _draft_sample_kernel

    i64 = {n: "*i64" for n in ("tok_ptr", "pos_ptr", "cap_ptr", "pos_out_ptr", "ids_out_ptr", "slot_out_ptr")}
    _compile(_draft_inputs_kernel, dict(BS=16, BLOCK=128), i64, default_ptr="*i32")

    i64 = {n: "*i64" for n in ("seeds_ptr", "pos_ptr", "rows_ptr", "out_ptr", "table_ptr", "known_ptr")}
    for sampled in (False, True):
        kw = dict(default_ptr="*fp32", aligned_ints=("vocab",))
        _compile(_draft_sample_kernel, dict(SAMPLED=sampled, BLOCK=2048), i64 | {"logits_ptr": "*bf16"}, **kw)


def test_input_prep_and_rope_kv_compile():
    from kernels.input_prep import _prepare_inputs_kernel
    from kernels.rope_kv import _rope_kv_kernel

    i32 = {n: "*i32" for n in ("starts_ptr", "block_table_ptr", "seq_lens_ptr", "qsl_ptr")}
    for by_row in (False, True):
        _compile(
            _prepare_inputs_kernel,
            dict(KV_BLOCK_SIZE=16, BLOCK=256, USE_PDL=True, STARTS_BY_ROW=by_row, PLACE=False, WORDS=1),
            i32,
            default_ptr="*i64",
        )
    _compile(
        _rope_kv_kernel,
        dict(HALF=64, BLOCK_HQ=16, BLOCK_HK=8, BLOCK_HALF=64, KV_BLOCK_SIZE=16, Q_NORM=True, K_NORM=True, USE_PDL=True),
        {"pos_ptr": "*i64", "slot_ptr": "*i64", "cache_ptr": "*fp32"},
        floats=("eps",),
    )


@pytest.mark.parametrize("pairs", [False, True])
def test_silu_and_mul_compiles(pairs):
    from kernels.activation import _silu_and_mul_kernel

    _compile(_silu_and_mul_kernel, dict(BLOCK=2048, PAIRS=pairs, USE_PDL=True), {})


def _shipped_tile_variants():
    """Every (config, variant) the shipped tile-GEMM table can launch: a config's use is
    read from its key (logits: float32 out; gate|up: the pairs epilogue; add_norm: partials
    and the add+norm sum; a split: partials and the plain sum)."""
    import json
    from pathlib import Path

    table = json.loads(Path(__file__).resolve().parents[2].joinpath("kernels", "tile_gemm_tuning.json").read_text())
    out = []
    for key, cfg in table["entries"].items():
        if cfg is not None:
            n = int(key.rsplit("|", 1)[1].split("x")[0])
            out.append(pytest.param(key, cfg, id=key))
            assert n > 0
    return out


@pytest.mark.parametrize("key,cfg", _shipped_tile_variants())
def test_tile_gemm_shipped_configs_compile_without_spills(key, cfg):
    """The shipped table's configs compile for sm_90 within the shared memory of one SM and
    without register spills (a tuning table from another GPU could name one that does not)."""
    from kernels.tile_gemm import _split_sum_add_norm_kernel, _split_sum_kernel, _tile_gemm_kernel

    n = int(key.rsplit("|", 1)[1].split("x")[0])
    add_norm, logits, act = key.startswith("add_norm|"), n > 100_000, n == 6144
    partial = add_norm or cfg["split_k"] > 1
    const = dict(
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        PARTIAL=partial,
        ROUND_TO_X=logits and not partial,
        UPCAST=False,
        IEEE=False,
        ACT=act and not partial,
    )
    ptrs = {"out_ptr": "*fp32" if partial or logits else "*bf16"}
    # N, K and the K slice are multiples of 16 at every model shape, and the JIT specialises
    # on that: it is what lets the loads be 16-byte cp.async copies, software-pipelined.
    # (Without it nothing is pipelined and the [BLOCK, BLOCK_K] tiles live in registers:
    # 255 registers and spills at 64x64x128 with 4 warps.)
    compiled = _compile(
        _tile_gemm_kernel,
        const,
        ptrs,
        aligned_ints=("N", "K", "k_per_split"),
        options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
    )
    regs, spills = _resource_usage(compiled.asm["cubin"])
    assert spills == 0 and compiled.metadata.shared <= 227 * 1024, (regs, spills)
    assert "async_copy" in compiled.asm["ttgir"], "the K loop's loads are not pipelined"
    import triton.language as tl

    if add_norm:
        _compile(
            _split_sum_add_norm_kernel,
            dict(SPLIT_K=cfg["split_k"], BLOCK_C=1024, DT=tl.bfloat16),
            {"part_ptr": "*fp32"},
            floats=("eps",),
            options=dict(num_warps=4),
        )
    elif partial:
        _compile(
            _split_sum_kernel,
            dict(SPLIT_K=cfg["split_k"], BLOCK_R=16, BLOCK_C=128, ROUND_TO=tl.bfloat16, ACT=act),
            {"part_ptr": "*fp32"},
            options=dict(num_warps=4),
        )


@pytest.mark.parametrize("k,n_max", [(3, 3), (5, 16)])
def test_ngram_kernel_compiles(k, n_max):
    """``kernels.ngram``: runtime n loop with a data-dependent skip, a block loop inside."""
    from kernels import ngram

    const = dict(K=k, N_CAP=triton.next_power_of_2(n_max), BLOCK=256)
    _compile(ngram._ngram_kernel, const, dict(tok_ptr="*i64", rows_ptr="*i64", known_ptr="*i64"))


@pytest.mark.parametrize("table", [False, True], ids=["gathered", "option-table"])
def test_fused_sampler_compiles(table):
    """The fused temperature sampler's one launch, reading gathered options (float rows) or
    the option table's int64 words in place, its last slice of a row picking (and, from the
    table, committing) the row's token."""
    from kernels.sample_logits import _slice_race_kernel

    opt = "*i64" if table else "*fp32"
    pos = "*i32" if table else "*i64"  # (the lazy path passes the step's int32 lengths as they are)
    race = {"logits_ptr": "*fp32", "div_ptr": opt, "seed_ptr": "*i64", "pos_ptr": pos, "rows_ptr": "*i64"}
    race |= {"max_ptr": "*fp32", "best_ptr": "*fp32", "idx_ptr": "*i32", "temp_ptr": opt, "count_ptr": "*i32"}
    race |= {n: "*i64" for n in ("greedy_ptr", "out_ptr", "tok_ptr")}
    const = dict(SLICE=16384, BLOCK=2048, SLICES=64, FROM_TABLE=table, COMMIT=table, USE_PDL=True)
    _compile(_slice_race_kernel, const, race)


def test_input_prep_pads_a_decode_graph_compiles():
    """The input kernel as a decode-graph step launches it: the graph's padding (slots, query
    starts, padded rows' lengths) and its block table copied in the same launch."""
    from kernels.input_prep import _prepare_inputs_kernel

    i32 = {n: "*i32" for n in ("starts_ptr", "block_table_ptr", "seq_lens_ptr", "qsl_ptr", "bt_dst_ptr")}
    const = dict(KV_BLOCK_SIZE=16, BLOCK=256, USE_PDL=True, STARTS_BY_ROW=True, COPY_TABLE=True, COPY_LOGITS=False)
    const |= dict(PLACE=False, WORDS=1)
    for commit in (False, True):  # (a plain decode step also sets its rows' lengths)
        _compile(_prepare_inputs_kernel, const | dict(COMMIT_LENGTHS=commit), i32, default_ptr="*i64")


@pytest.mark.parametrize("table,logits", [(False, False), (True, False), (True, True)])
def test_input_prep_placing_new_requests_compiles(table, logits):
    """The input kernel with the placement programs (``PLACE``) in the forms a step with new
    requests takes: eager, a decode graph's (padding, block table), a mixed graph's (and
    its sampled-token indices)."""
    from kernels.input_prep import _prepare_inputs_kernel
    from workers.device_state import OPTION_WORDS

    ptrs = {n: "*i32" for n in ("starts_ptr", "block_table_ptr", "seq_lens_ptr", "qsl_ptr", "bt_dst_ptr")}
    ptrs |= {"prompt_len_ptr": "*i32", "counts_ptr": "*i32", "mask_ptr": "*i1"}
    const = dict(KV_BLOCK_SIZE=16, BLOCK=256, USE_PDL=True, STARTS_BY_ROW=True, COMMIT_LENGTHS=False)
    const |= dict(COPY_TABLE=table, COPY_LOGITS=logits, PLACE=True, WORDS=OPTION_WORDS)
    _compile(_prepare_inputs_kernel, const, ptrs, default_ptr="*i64")


@pytest.mark.parametrize("mixed", [False, True])
def test_input_prep_from_a_header_compiles(mixed):
    """The input kernel reading its step from the stage's header (``kernels.input_header``), in
    its two captured forms: a decode graph's (lengths committed) and a mixed graph's (new
    requests placed, sampled-token indices copied); the segment pointers are the stage's."""
    from kernels.input_prep import _prepare_inputs_kernel
    from workers.device_state import OPTION_WORDS

    ptrs = {n: "*i32" for n in ("starts_ptr", "seq_lens_ptr", "qsl_ptr", "bt_dst_ptr")}
    ptrs |= {"prompt_len_ptr": "*i32", "counts_ptr": "*i32", "mask_ptr": "*i1"} if mixed else {}
    const = dict(KV_BLOCK_SIZE=16, BLOCK=256, USE_PDL=False, STARTS_BY_ROW=True, COMMIT_LENGTHS=not mixed)
    const |= dict(COPY_TABLE=True, COPY_LOGITS=mixed, PLACE=mixed, WORDS=OPTION_WORDS if mixed else 1, HEADER=True)
    _compile(_prepare_inputs_kernel, const, ptrs, default_ptr="*i64")
    if mixed:  # (and the graph's second kernel: the rows' new lengths)
        from kernels.input_header import _commit_lengths_kernel

        _compile(_commit_lengths_kernel, dict(BLOCK=256), {"hdr_ptr": "*i64"}, default_ptr="*i32")
