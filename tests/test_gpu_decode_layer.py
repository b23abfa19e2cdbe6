"""The one-launch decoder layer (``kernels.decode_layer``) on CUDA (``-m gpu``), at the
Qwen3-0.6B and Llama-3.1-8B layer shapes.

* One launch (grid barriers, PDL) equals the same kernel run one launch a phase, bit for bit
  (the Qwen3-0.6B shape at batch 1: each phased form is five more compiles):
  the programs do the same work in the same order, so any barrier that lets a phase read
  data before every program has stored it shows up as a difference.
* Both are within bf16 noise of the float64 reference; the new K/V land in their slots.
* A chain of layers, eager with PDL and captured in a CUDA graph replayed at other lengths,
  equals the phased chain; the counters end every launch re-armed (all zero).

Every call runs under ``torch.cuda.set_sync_debug_mode("error")``."""

import pytest
import torch

from tests.test_kernels_gpu import no_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = {  # hq, hk, head_dim, hidden, intermediate, q/k norm
    "qwen3-0.6b": (16, 8, 128, 1024, 3072, True),
    "llama-3.1-8b": (32, 8, 128, 4096, 14336, False),
}
BOUND, BS = 4096, 16
CHAIN_LENS = (300, 1, 2049, 4096)  # captured at the first, replayed at all
PHASED_SHAPE = "qwen3-0.6b"  # the shape also run one launch a phase


def _weights(shape, seed):
    from kernels.decode_layer import LayerWeights

    hq, hk, d, h, inter, qk = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(torch.bfloat16)

    gamma = lambda n: (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)  # noqa: E731
    return LayerWeights(gamma(h), rnd((hq + 2 * hk) * d, h, scale=h ** -0.5),
                        rnd(h, hq * d, scale=(hq * d) ** -0.5), gamma(h),
                        rnd(2 * inter, h, scale=h ** -0.5), rnd(h, inter, scale=inter ** -0.5),
                        1e-6, hq, hk, d, True, gamma(d) if qk else None,
                        gamma(d) if qk else None, 1e-6)


def _step(seq_lens, hk, d, n_layers, seed, bound=None):
    """Step inputs for one token a request at ``seq_lens`` (an int: one request), each
    request with its own blocks, and ``n_layers`` random KV caches (``bound``: the length
    bound, default ``BOUND``)."""
    bound = bound or BOUND
    seq_lens = [seq_lens] if isinstance(seq_lens, int) else list(seq_lens)
    m, per = len(seq_lens), bound // BS
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_blocks = m * per + 4
    caches = [(torch.randn(n_blocks, BS, hk, d, device="cuda", generator=g).to(torch.bfloat16),
               torch.randn(n_blocks, BS, hk, d, device="cuda", generator=g).to(torch.bfloat16))
              for _ in range(n_layers)]
    table = torch.randperm(n_blocks, device="cuda", generator=g)[: m * per]
    table = table.to(torch.int32).view(m, per).contiguous()
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    ang = torch.arange(bound, device="cuda").float()[:, None] * inv[None, :]
    step = dict(cos_sin_cache=torch.cat([ang.cos(), ang.sin()], -1), block_table=table,
                positions=torch.zeros(m, dtype=torch.int64, device="cuda"),
                slot_mapping=torch.zeros(m, dtype=torch.int64, device="cuda"),
                seq_lens=torch.zeros(m, dtype=torch.int32, device="cuda"),
                max_seq_len_upper_bound=bound, scale=d ** -0.5)
    _set_len(step, seq_lens)
    return step, caches


def _set_len(step, seq_lens):
    """In place (graph inputs): request ``r``'s token sits at ``seq_lens[r] - 1``."""
    seq_lens = [seq_lens] * step["seq_lens"].shape[0] if isinstance(seq_lens, int) else seq_lens
    pos = torch.tensor(seq_lens, device="cuda") - 1
    rows = torch.arange(len(seq_lens), device="cuda")
    page = step["block_table"][rows, pos // BS].to(torch.int64)
    step["positions"].copy_(pos)
    step["slot_mapping"].copy_(page * BS + pos % BS)
    step["seq_lens"].copy_(pos + 1)


def _chain(layers, x, res, step, caches, phased):
    from kernels.decode_layer import decode_layer_triton

    for w, (kc, vc) in zip(layers, caches):
        got = decode_layer_triton(x, res, w, k_cache=kc, v_cache=vc, phased=phased, **step)
        assert got is not None
        x, res = got
    return x, res


def _counters_zero():
    from kernels import grid_sync

    return all(int(b.abs().sum()) == 0 for b in grid_sync._COUNTERS.values())


LENGTHS = {1: [[1], [17], [519], [4000]],  # batch 1: first token, short, long
           3: [[1, 519, 4000]], 8: [[17, 4000, 1, 300, 2049, 64, 65, 1000]]}


# the default attention tiles (tensor cores), and the FMA tiles (att_dot=0) at batch 1 and 8
CASES = [(ls, 1) for v in LENGTHS.values() for ls in v] + [(LENGTHS[1][2], 0), (LENGTHS[8][0], 0)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seq_lens,att_dot", CASES,
                         ids=["-".join(map(str, ls)) + ("" if dot else "-fma") for ls, dot in CASES])
def test_one_launch_equals_phased_and_reference(shape, seq_lens, att_dot, monkeypatch):
    from kernels.decode_layer import decode_layer_triton
    from kernels.reference import decode_layer_reference

    monkeypatch.setenv("SYNCLESS_PDL", "1")
    w = _weights(shape, seed=sum(seq_lens))
    hq, hk, d, h = w.num_heads, w.num_kv_heads, w.head_dim, w.qkv.shape[1]
    m = len(seq_lens)
    step, caches = _step(seq_lens, hk, d, 1, seed=m + 1)
    kc, vc = caches[0]
    kc2, vc2, kc64, vc64 = kc.clone(), vc.clone(), kc.double(), vc.double()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
    # a small residual stream: the attention's part dominates r2 (at scale 1 a zeroed
    # attention passed the checks below at 4,000 keys, review 2026-12-05)
    x, res = (x.float() * 0.01).to(torch.bfloat16), (res.float() * 0.01).to(torch.bfloat16)
    cfg = dict(att_dot=att_dot)
    with no_sync():
        one = decode_layer_triton(x, res, w, k_cache=kc, v_cache=vc, phased=False, config=cfg,
                                  **step)
        if shape == PHASED_SHAPE and m == 1 and att_dot:  # five more compiles: batch 1
            phased = decode_layer_triton(x, res, w, k_cache=kc2, v_cache=vc2, phased=True,
                                         config=cfg, **step)
    torch.cuda.synchronize()
    if shape == PHASED_SHAPE and m == 1 and att_dot:
        assert torch.equal(one[0], phased[0]) and torch.equal(one[1], phased[1])
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert _counters_zero()

    w64 = w._replace(**{f: getattr(w, f).double() for f in
                        ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")
                        + (("q_norm", "k_norm") if w.q_norm is not None else ())})
    step64 = dict(step, cos_sin_cache=step["cos_sin_cache"].double())
    out64, r64 = decode_layer_reference(x.double(), res.double(), w64, k_cache=kc64,
                                        v_cache=vc64, **step64)
    for got, want in ((one[1], r64), (one[0], out64)):
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert err < 3e-2, (shape, seq_lens, err)
    r1 = x.double() + res.double()  # the attention's part of r2 (o_proj of it), on its own
    att_err = float((one[1].double() - r1 - (r64 - r1)).norm() / (r64 - r1).norm())
    assert att_err < 2e-2, (shape, seq_lens, att_err)
    slots = step["slot_mapping"]  # the new K/V (rounded once to bf16) in their slots
    k_new = kc.view(-1, hk, d)[slots].double()
    assert float((k_new - kc64.view(-1, hk, d)[slots]).abs().max()) < 5e-2


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_layer_chain_with_pdl_and_graph_replays(graph, batch, monkeypatch):
    """Four layers back to back (under PDL at batch 1: each waits for the one before); in a
    CUDA graph replayed at three other lengths (every request of the batch at it)."""
    monkeypatch.setenv("SYNCLESS_PDL", "1")
    layers = [_weights("qwen3-0.6b", seed=100 + i) for i in range(4)]
    hk, d, h = layers[0].num_kv_heads, layers[0].head_dim, layers[0].qkv.shape[1]
    step, caches = _step([CHAIN_LENS[0]] * batch, hk, d, 4, seed=9)
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(batch, h, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(batch, h, device="cuda", generator=g).to(torch.bfloat16)
    with no_sync():
        if graph:
            _chain(layers, x, res, step, [(k.clone(), v.clone()) for k, v in caches], False)
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                out = _chain(layers, x, res, step, caches, False)
    for seq_len in CHAIN_LENS if graph else CHAIN_LENS[:1]:
        _set_len(step, seq_len)
        mirror = [(k.clone(), v.clone()) for k, v in caches]
        with no_sync():
            if graph:
                cg.replay()
            else:
                out = _chain(layers, x, res, step, caches, False)
            want = _chain(layers, x, res, step, mirror, True)
        torch.cuda.synchronize()
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), seq_len
        assert all(torch.equal(a[0], b[0]) for a, b in zip(caches, mirror)), seq_len
        assert _counters_zero()


def test_a_grid_too_big_to_be_resident_trips_the_watchdog_instead_of_hanging():
    """Two programs an SM cannot all be resident (one fills an SM's registers): the first
    wave's barriers never fill. Each gives up after its spin budget, counts a timeout and
    goes on, so the launch ends (about 4 s)."""
    from kernels import grid_sync, pdl
    from kernels.decode_layer import decode_layer_triton

    w = _weights("qwen3-0.6b", seed=1)
    step, caches = _step(64, w.num_kv_heads, w.head_dim, 1, seed=2)
    x = torch.randn(1, w.qkv.shape[1], device="cuda").to(torch.bfloat16)
    dev = x.device
    before = grid_sync.barrier_timeouts(dev)
    got = decode_layer_triton(x, x, w, k_cache=caches[0][0], v_cache=caches[0][1], phased=False,
                              programs=2 * pdl.sm_count(dev), **step)
    torch.cuda.synchronize()
    assert got is not None and grid_sync.barrier_timeouts(dev) > before
    for buf in grid_sync._COUNTERS.values():
        buf.zero_()  # the counters of a broken launch are not trusted


def test_padded_rows_leave_real_rows_and_the_cache_alone(monkeypatch):
    """Sixteen rows as a padded CUDA graph runs them: ten real requests and six padding rows
    (length 1, slot -1, a stale block-table row and position). Two launches whose padding
    rows hold different garbage (NaN, then large random values) give the real rows and the
    cache bit for bit the same; the real rows are within bf16 noise of float64."""
    from kernels.decode_layer import decode_layer_triton
    from kernels.reference import decode_layer_reference

    monkeypatch.setenv("SYNCLESS_PDL", "auto")
    w = _weights("qwen3-0.6b", seed=3)
    hk, d, h = w.num_kv_heads, w.head_dim, w.qkv.shape[1]
    real = [17, 4000, 1, 300, 2049, 64, 65, 1000, 2, 513]
    step, caches = _step(real + [1] * 6, hk, d, 1, seed=4)
    step["slot_mapping"][10:] = -1
    step["positions"][10:] = 777
    step["block_table"][10:] = step["block_table"][0]
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(16, h, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(16, h, device="cuda", generator=g).to(torch.bfloat16)
    x2, res2 = x.clone(), res.clone()
    x[10:] = float("nan")
    x2[10:] = 1e4 * torch.randn(6, h, device="cuda", generator=g).to(torch.bfloat16)
    res2[10:] = -3.0
    kc, vc = caches[0]
    kc2, vc2, kc64, vc64 = kc.clone(), vc.clone(), kc.double(), vc.double()
    with no_sync():
        a = decode_layer_triton(x, res, w, k_cache=kc, v_cache=vc, **step)
        b = decode_layer_triton(x2, res2, w, k_cache=kc2, v_cache=vc2, **step)
    torch.cuda.synchronize()
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    for got, other in zip(a, b):
        assert not got[:10].isnan().any()
        assert torch.equal(got[:10], other[:10])
    step10 = {k: (v[:10] if torch.is_tensor(v) and k != "cos_sin_cache" else v)
              for k, v in step.items()}
    w64 = w._replace(**{f: getattr(w, f).double() for f in
                        ("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "q_norm",
                         "k_norm")})
    step64 = dict(step10, cos_sin_cache=step["cos_sin_cache"].double())
    out64, r64 = decode_layer_reference(x[:10].double(), res[:10].double(), w64, k_cache=kc64,
                                        v_cache=vc64, **step64)
    for got, want in ((a[1][:10], r64), (a[0][:10], out64)):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 3e-2
    assert _counters_zero()


def test_profile_stamps_are_ordered_and_change_nothing(monkeypatch):
    """``profile=``: every program's stamps (ns and cycles) are non-decreasing, the launch
    span is positive, and the outputs equal an unprofiled launch bit for bit."""
    from kernels import pdl
    from kernels.decode_layer import PROFILE_STAMPS, decode_layer_triton

    monkeypatch.setenv("SYNCLESS_PDL", "1")
    w = _weights("qwen3-0.6b", seed=12)
    step, caches = _step(700, w.num_kv_heads, w.head_dim, 1, seed=13)
    x = torch.randn(1, w.qkv.shape[1], device="cuda").to(torch.bfloat16)
    kc, vc = caches[0]
    kc2, vc2 = kc.clone(), vc.clone()
    prof = torch.zeros(pdl.sm_count(x.device), 32, dtype=torch.int64, device="cuda")
    with no_sync():
        plain = decode_layer_triton(x, x, w, k_cache=kc, v_cache=vc, **step)
        profiled = decode_layer_triton(x, x, w, k_cache=kc2, v_cache=vc2, profile=prof, **step)
    torch.cuda.synchronize()
    assert torch.equal(plain[0], profiled[0]) and torch.equal(plain[1], profiled[1])
    n = len(PROFILE_STAMPS)
    for cols in (slice(0, n), slice(16, 16 + n)):
        stamps = prof[:, cols]
        assert bool((stamps[:, 1:] >= stamps[:, :-1]).all()) and bool((stamps[:, 0] > 0).all())
    assert int(prof[:, n - 1].max() - prof[:, 0].min()) > 0


def test_a_context_too_long_to_prefetch_streams_its_keys():
    """Batch 1 at 12,000 keys (over the K/V prefetch budget of a 50 MB L2: about 5,500 keys
    for this shape): the attention items prefetch their own rows 256 keys ahead (the rolling
    path), within bf16 noise of float64."""
    from kernels.decode_layer import decode_layer_triton
    from kernels.reference import decode_layer_reference

    w = _weights("qwen3-0.6b", seed=21)
    step, caches = _step(12000, w.num_kv_heads, w.head_dim, 1, seed=22, bound=16384)
    x = torch.randn(1, w.qkv.shape[1], device="cuda").to(torch.bfloat16)
    kc, vc = caches[0]
    kc64, vc64 = kc.double(), vc.double()
    with no_sync():
        out, r2 = decode_layer_triton(x, x, w, k_cache=kc, v_cache=vc, **step)
    torch.cuda.synchronize()
    w64 = w._replace(**{f: getattr(w, f).double() for f in
                        ("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "q_norm",
                         "k_norm")})
    out64, r64 = decode_layer_reference(x.double(), x.double(), w64, k_cache=kc64,
                                        v_cache=vc64,
                                        **dict(step, cos_sin_cache=step["cos_sin_cache"].double()))
    for got, want in ((r2, r64), (out, out64)):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 3e-2
    assert _counters_zero()
