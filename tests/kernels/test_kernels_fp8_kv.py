"""The FP8 (e4m3) KV cache: the KV writes, the fused rope + KV write, mixed / prefill / decode
attention with its split merge and the decode launch with the rope prologue inside, each with
a ``torch.float8_e4m3fn`` cache and per-tensor ``k_scale`` / ``v_scale``.

* Under the interpreter (an interpreted child pytest, see ``tests/interpreted.py``): each
  Triton path against its reference with the same FP8 cache (tight), the FP8 reference
  against the 16-bit-cache reference (loose, relative to the output's magnitude, with data
  that a scale of 1.0 would clip), the stored bytes against the reference's quantization, and
  a 16-bit cache ignoring the scales bit for bit.
* In this process (no device): the FP8 attention variants the engine's launches pick and the
  FP8 KV writes compile for sm_90 (no spills), and the scales never pick a variant.
* ``-m gpu``, at realistic shapes, under the sync check and in a CUDA graph:
  ``tests/kernels/test_kernels_fp8_kv_gpu.py``.
"""

import pytest
import torch

from kernels import reference as ref
from tests.interpreted import INTERPRETED, delegate_all
from tests.kernels.test_kernels import TOL
from tests.kernels.test_kernels_attention_rope import make_case

if INTERPRETED:
    from kernels import kv_write as kvw
    from kernels import paged_attention as pa
    from kernels import rope_kv as rkv
    from kernels.rope_inline import DecodeRope
else:
    kvw = pa = rkv = DecodeRope = None  # only the child touches triton

FP8 = torch.float8_e4m3fn
SCALES = [(2.0, 0.5), (0.5, 2.0)]  # (k_scale, v_scale)


def assert_keys_close(kc, kc_exp, max_unequal=0.02):
    """Rotated keys quantized by a kernel and by the reference: the rotation's terms may round
    an ulp of the model dtype apart (about 2^-8 of the largest key, where ``x1 cos - x2 sin``
    cancels), and then e4m3 one step apart; nearly every byte equal."""
    a, b = kc.float(), kc_exp.float()
    torch.testing.assert_close(a, b, rtol=2**-3, atol=float(b.abs().max()) * 2**-7)
    assert float(a.ne(b).float().mean()) < max_unequal


def quantize(x, scale):
    """The contract, written out: ``clamp(x / scale, -448, 448)`` in float32, to e4m3."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def as_bytes(t):
    return t.view(torch.uint8)


def attention_case(q_lens, seq_lens, hq, hkv, dtype, k_scale, v_scale, d=32, bs=16, slack=3, seed=0, device="cpu"):
    """Paged K/V drawn uniformly in ``+-400 x scale`` (so e4m3 holds them after the scale,
    and a scale of 1.0 would clip every value past 448 when the scale is 2), the FP8 caches
    quantized from them, and queries sized for scores of about unit spread. Unused
    block-table entries are -1."""
    g = torch.Generator().manual_seed(seed)
    ub = max(seq_lens) + slack
    width = -(-ub // bs) + 1
    num_blocks = len(q_lens) * width + 3
    shape = (num_blocks, bs, hkv, d)
    k_data = ((torch.rand(shape, generator=g) * 2 - 1) * (400 * k_scale)).to(dtype)
    v_data = ((torch.rand(shape, generator=g) * 2 - 1) * (400 * v_scale)).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: len(q_lens) * width].view(len(q_lens), width).to(torch.int32)
    for r, s in enumerate(seq_lens):
        table[r, -(-s // bs) :] = -1
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    k_std = 400 * k_scale / 3**0.5
    q = (torch.randn(int(qsl[-1]) + 2, hq, d, generator=g) * (1.5 / k_std)).to(dtype)  # + 2 padding rows
    tensors = dict(
        q=q,
        k_data=k_data,
        v_data=v_data,
        k_cache=quantize(k_data, k_scale),
        v_cache=quantize(v_data, v_scale),
        table=table,
        seq=torch.tensor(seq_lens, dtype=torch.int32),
        qsl=qsl,
    )
    tensors = {name: t.to(device) for name, t in tensors.items()}
    return dict(tensors, qsl_cpu=qsl, max_q=max(q_lens), bound=ub, scale=d**-0.5, k_scale=k_scale, v_scale=v_scale)


def reference_attention(c, k_cache=None, v_cache=None, **scales):
    kc = c["k_cache"] if k_cache is None else k_cache
    vc = c["v_cache"] if v_cache is None else v_cache
    scales = scales or dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
    n = int(c["qsl_cpu"][-1])
    out = ref.paged_attention_reference(
        c["q"], kc, vc, c["table"].clamp(min=0), c["seq"], c["qsl"], c["qsl_cpu"], c["bound"], c["scale"], **scales
    )
    return out[:n].float()


def triton_attention(c, k_cache=None, v_cache=None, num_splits=None, fused_reduce=None, **scales):
    scales = scales or dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
    out = pa.paged_attention_triton(
        c["q"],
        c["k_cache"] if k_cache is None else k_cache,
        c["v_cache"] if v_cache is None else v_cache,
        c["table"],
        c["seq"],
        c["qsl"],
        c["max_q"],
        c["bound"],
        c["scale"],
        num_splits=num_splits,
        fused_reduce=fused_reduce,
        **scales,
    )
    return out[: int(c["qsl_cpu"][-1])].float()


def rel_err(a, b):
    """The error's norm relative to ``b``'s."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def assert_close_scaled(out, expect, dtype):
    """``TOL[dtype]`` on both divided by ``expect``'s largest magnitude (outputs here are
    hundreds: absolute tolerances apply to the output's scale)."""
    m = expect.float().abs().max()
    torch.testing.assert_close(out.float() / m, expect.float() / m, **TOL[dtype])


DECODE = dict(q_lens=[1] * 7, seq_lens=[1, 16, 17, 64, 65, 100, 130])
MIXED = dict(q_lens=[1, 20, 1, 3, 33, 1, 0], seq_lens=[17, 20, 64, 50, 80, 1, 9])  # prefill-shaped
VERIFY = dict(q_lens=[4, 1, 2, 3], seq_lens=[4, 31, 33, 48])  # <= 16 query tokens a request


# ----------------------------------------------------------------- stores


@pytest.mark.parametrize("k_scale,v_scale", SCALES + [(1.0, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_the_reference_quantization(dtype, k_scale, v_scale):
    g = torch.Generator().manual_seed(4)
    nb, bs, h, d, t = 6, 16, 2, 32, 9
    # key/value: strided views of a fused projection, within +-400 x their scale (past 448 at 2)
    fused = torch.rand(t, 3 * h * d, generator=g) * 2 - 1
    fused[:, h * d : 2 * h * d] *= 400 * k_scale
    fused[:, 2 * h * d :] *= 400 * v_scale
    fused[0, h * d : h * d + 4] = torch.tensor([1e-3, -1e-3, 0.0, -0.0])  # subnormal, zeros
    fused = fused.to(dtype)
    key, value = fused[:, h * d : 2 * h * d].view(t, h, d), fused[:, 2 * h * d :].view(t, h, d)
    slots = torch.tensor([0, 15, 16, -1, 17, 47, -1, 95, 33], dtype=torch.int64)
    k_cache = quantize(torch.randn(nb, bs, h, d, generator=g), 1.0)
    v_cache = quantize(torch.randn(nb, bs, h, d, generator=g), 1.0)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    ref.write_kv_reference(key, value, k_exp, v_exp, slots, k_scale=k_scale, v_scale=v_scale)
    kvw.write_kv_triton(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert k_cache.dtype == v_cache.dtype == FP8  # the cache stays FP8
    assert torch.equal(as_bytes(k_cache), as_bytes(k_exp)) and torch.equal(as_bytes(v_cache), as_bytes(v_exp))
    ok = slots >= 0
    flat_k, flat_v = k_cache.view(nb * bs, h, d), v_cache.view(nb * bs, h, d)
    assert torch.equal(as_bytes(flat_k[slots[ok]]), as_bytes(quantize(key[ok], k_scale)))
    assert torch.equal(as_bytes(flat_v[slots[ok]]), as_bytes(quantize(value[ok], v_scale)))
    # dequantized within e4m3's half step of the data: the scale was applied (a scale of 1.0
    # clips the values past 448, a wrong one is off by its ratio)
    for flat, x, scale in ((flat_k, key, k_scale), (flat_v, value, v_scale)):
        torch.testing.assert_close(flat[slots[ok]].float() * scale, x[ok].float(), rtol=2**-4, atol=2**-9 * scale)
        if scale > 1.0:
            assert x.float().abs().max() > 448  # a scale of 1.0 would have clipped these
        if scale != 1.0:
            assert not torch.equal(as_bytes(flat[slots[ok]]), as_bytes(quantize(x[ok], 1.0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_kv_fp8(dtype):
    """The fused rope + KV write: the rotated k rounded to the model dtype, then quantized
    (within one e4m3 step of the reference's: the rotation may round differently); v and
    the untouched slots exactly."""
    k_scale, v_scale = 2.0, 0.5
    g = torch.Generator().manual_seed(10)
    t, hq, hk, d, nb, bs = 9, 8, 2, 32, 6, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    qkv[:, hq * d :] *= 300  # k and v past 448 (k_scale 2: within range after the scale)
    qkv[:, (hq + hk) * d :] /= 3
    q, k, v = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), qkv[:, (hq + hk) * d :]
    v = v.view(t, hk, d)
    positions = torch.tensor([0, 5, 17, 3, 63, 1, 40, 16, 15])
    slots = torch.tensor([0, 15, 16, -1, 17, 47, -1, 95, 33], dtype=torch.int64)
    from tests.kernels.test_kernels import cos_sin_cache

    cache = cos_sin_cache(64, d)
    k_cache, v_cache = quantize(torch.randn(nb, bs, hk, d, generator=g), 1.0), quantize(torch.zeros(nb, bs, hk, d), 1)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    q_exp = ref.rope_and_write_kv_reference(positions, q, k, v, cache, k_exp, v_exp, slots, **scales)
    q_out = rkv.rope_and_write_kv_triton(positions, q, k, v, cache, k_cache, v_cache, slots, **scales)
    assert k_cache.dtype == v_cache.dtype == FP8
    torch.testing.assert_close(q_out, q_exp, **TOL[dtype])
    assert_keys_close(k_cache, k_exp)
    assert torch.equal(as_bytes(v_cache), as_bytes(v_exp))
    written = k_cache.view(nb * bs, hk, d)[slots[slots >= 0]].float() * k_scale
    assert written.abs().max() > 448  # data a scale of 1.0 would have clipped, held


# ----------------------------------------------------------------- attention


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize(
    "shape,splits,fused_reduce",
    [("decode", 1, None), ("decode", 3, True), ("decode", 5, False), ("verify", 4, True), ("mixed", 1, None)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_fp8_matches_reference(dtype, shape, splits, fused_reduce, k_scale, v_scale):
    """Decode (split merged in the launch, by the reduce kernel, more splits than tiles), the
    <= 16-token verify rows and a prefill-shaped mixed batch, GQA 4, against the reference
    reading the same FP8 cache."""
    lens = dict(decode=DECODE, verify=VERIFY, mixed=MIXED)[shape]
    c = attention_case(lens["q_lens"], lens["seq_lens"], 8, 2, dtype, k_scale, v_scale, seed=len(shape))
    out = triton_attention(c, num_splits=splits, fused_reduce=fused_reduce)
    assert_close_scaled(out, reference_attention(c), dtype)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("shape", ["decode", "mixed"])
def test_fp8_reference_close_to_16_bit_cache(shape, k_scale, v_scale):
    """The FP8 cache's attention against the bf16 cache's (the data the FP8 cache quantized):
    e4m3's error, a few % of the output's magnitude. Quantized with a scale of 1.0 (clipping
    the data past 448) or read back with 1.0, it is far off: the scales are applied."""
    lens = dict(decode=DECODE, mixed=MIXED)[shape]
    c = attention_case(lens["q_lens"], lens["seq_lens"], 8, 2, torch.bfloat16, k_scale, v_scale, seed=3)
    exact = reference_attention(c, c["k_data"], c["v_data"])
    fp8 = reference_attention(c)
    assert rel_err(fp8, exact) < 0.06
    clipped = reference_attention(c, quantize(c["k_data"], 1.0), quantize(c["v_data"], 1.0), k_scale=1.0, v_scale=1.0)
    assert rel_err(clipped, exact) > 0.12
    assert rel_err(reference_attention(c, k_scale=1.0, v_scale=1.0), exact) > 0.3


def test_paged_attention_fp8_wrong_scales_detected():
    c = attention_case(DECODE["q_lens"], DECODE["seq_lens"], 4, 2, torch.float32, 2.0, 0.5)
    expect = reference_attention(c)
    for wrong in (dict(k_scale=1.0, v_scale=0.5), dict(k_scale=2.0, v_scale=1.0)):
        assert not torch.allclose(triton_attention(c, num_splits=2, **wrong), expect, atol=1e-2, rtol=1e-2)


def test_16_bit_cache_ignores_the_scales():
    """With a bf16 cache the scales change nothing, bit for bit: writes, rope + write, attention."""
    c = attention_case(MIXED["q_lens"], MIXED["seq_lens"], 8, 2, torch.bfloat16, 1.0, 1.0)
    kc, vc = c["k_data"] / 400, c["v_data"] / 400
    odd = dict(k_scale=3.0, v_scale=0.25)
    assert torch.equal(triton_attention(c, kc, vc, **odd), triton_attention(c, kc, vc, k_scale=1.0, v_scale=1.0))
    assert torch.equal(reference_attention(c, kc, vc, **odd), reference_attention(c, kc, vc, k_scale=1.0, v_scale=1.0))
    slots = torch.tensor([3, -1, 40], dtype=torch.int64)
    key, value = c["q"][:3, :2], c["q"][3:6, :2]
    caches = [(kc.clone(), vc.clone()) for _ in range(3)]
    kvw.write_kv_triton(key, value, *caches[0], slots, **odd)
    kvw.write_kv_triton(key, value, *caches[1], slots)
    ref.write_kv_reference(key, value, *caches[2], slots, **odd)
    assert all(torch.equal(a, b) for a, b in zip(caches[0] + caches[2], caches[1] * 2))
    from tests.kernels.test_kernels import cos_sin_cache

    cs, pos = cos_sin_cache(64, 32), torch.tensor([1, 2, 60])
    q1 = rkv.rope_and_write_kv_triton(pos, c["q"][:3], key, value, cs, *caches[0], slots, **odd)
    q2 = rkv.rope_and_write_kv_triton(pos, c["q"][:3], key, value, cs, *caches[1], slots)
    assert torch.equal(q1, q2) and all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))


# ----------------------------------------------------------------- decode with rope inside


def rope_case(
    dtype,
    k_scale=0.5,
    v_scale=2.0,
    lens=(1, 16, 17, 64, 65, 129),
    heads=(8, 2, 32),
    pad_reqs=1,
    device="cpu",
    bound=None,
):
    """``make_case`` (a decode step, padded requests and a padded token, Qwen3's q/k norm;
    ``heads`` = (q heads, KV heads, head dim)) with FP8 caches quantized with the scales;
    values about 150 x those of ``make_case`` (at ``v_scale`` 2, a scale of 1.0 would clip
    the largest). ``bound``: the launch's length bound (default the table's); the reference
    runs at the table's own (``ref_bound``: keys past ``seq_len`` are masked)."""
    c = make_case(list(lens), *heads, dtype, qk_norm=True, pad_reqs=pad_reqs, device=device)
    c["v"] = c["v"] * 150
    c["k_cache"] = quantize(c["k_cache"].float(), k_scale)
    c["v_cache"] = quantize(c["v_cache"].float() * 150, v_scale)
    return dict(c, k_scale=k_scale, v_scale=v_scale, bound=bound or c["bound"], ref_bound=c["bound"])


def rope_expected(c):
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
    q_rot = ref.rope_and_write_kv_reference(
        c["positions"], c["q"], c["k"], c["v"], c["cs"], kc, vc, c["slots"], c["qw"], c["kw"], 1e-6, **scales
    )
    table, qsl = c["table"].clamp(min=0), c["qsl"]
    out = ref.paged_attention_reference(
        q_rot, kc, vc, table, c["seq"], qsl, qsl.cpu(), c["ref_bound"], c["scale"], **scales
    )
    return out, kc, vc


def rope_fused(c, num_splits=None, fused_reduce=None):
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
    rope = DecodeRope(c["positions"], c["k"], c["v"], c["cs"], c["slots"], c["qw"], c["kw"], 1e-6, **scales)
    out = pa.paged_attention_triton(
        c["q"], kc, vc, c["table"], c["seq"], c["qsl"], 1, c["bound"], c["scale"],
        num_splits=num_splits, fused_reduce=fused_reduce, rope=rope, **scales,
    )  # fmt: skip
    return out, kc, vc


@pytest.mark.parametrize("splits,fused_reduce", [(1, None), (3, True), (3, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_with_rope_fp8(dtype, splits, fused_reduce):
    """The new K/V quantized in the launch and attended as stored, the cached tiles read and
    dequantized: as ``rope_and_write_kv_reference`` then ``paged_attention_reference``."""
    c = rope_case(dtype)
    out, kc, vc = rope_fused(c, splits, fused_reduce)
    exp, kc_exp, vc_exp = rope_expected(c)
    n = len(c["seq"]) - 1
    assert kc.dtype == vc.dtype == FP8
    assert_close_scaled(out[:n], exp[:n], dtype)
    assert_keys_close(kc, kc_exp)  # the new keys, rotated
    assert torch.equal(as_bytes(vc), as_bytes(vc_exp))
    changed = (as_bytes(vc) != as_bytes(c["v_cache"])).flatten(1).any(1).sum()
    assert int(changed) == n  # one new row a request: nothing else written


def test_decode_attention_with_rope_needs_the_launch_scales():
    c = rope_case(torch.float32, lens=(5,))
    rope = DecodeRope(c["positions"], c["k"], c["v"], c["cs"], c["slots"], k_scale=1.0, v_scale=2.0)
    with pytest.raises(AssertionError, match="scales differ"):
        pa.paged_attention_triton(
            c["q"], c["k_cache"], c["v_cache"], c["table"], c["seq"], c["qsl"], 1, c["bound"], c["scale"],
            rope=rope, k_scale=0.5, v_scale=2.0,
        )  # fmt: skip


@pytest.mark.parametrize("on_triton", [False, True])
def test_ops_pass_the_scales(monkeypatch, on_triton):
    """``ops.rope_and_attention`` (the fused decode launch, or the references), then a
    multi-token ``ops.rope_and_write_kv`` + ``ops.paged_attention`` on the same FP8 cache."""
    from kernels import ops

    monkeypatch.setattr(ops, "_use_triton", lambda t: on_triton)
    c = rope_case(torch.float32, lens=(3, 20, 40))
    exp, kc_exp, vc_exp = rope_expected(c)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    args = (c["positions"], c["q"], c["k"], c["v"], c["cs"], kc, vc, c["slots"], c["table"], c["seq"], c["qsl"])
    scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
    out = ops.rope_and_attention(*args, c["qsl"], 1, c["bound"], c["scale"], c["qw"], c["kw"], 1e-6, **scales)
    assert_close_scaled(out[:3], exp[:3], torch.float32)
    assert_keys_close(kc, kc_exp)
    m = attention_case(MIXED["q_lens"], MIXED["seq_lens"], 8, 2, torch.float32, 2.0, 0.5)
    n = int(m["qsl"][-1])
    out = ops.paged_attention(
        m["q"], m["k_cache"], m["v_cache"], m["table"].clamp(min=0), m["seq"], m["qsl"], m["qsl"], m["max_q"],
        m["bound"], m["scale"], k_scale=2.0, v_scale=0.5,
    )  # fmt: skip
    assert_close_scaled(out[:n], reference_attention(m), torch.float32)
    kc2, vc2 = m["k_cache"].clone(), m["v_cache"].clone()
    ops.write_kv(m["q"][:n, :2], m["q"][:n, 2:4] * 1e5, kc2, vc2, torch.arange(n), k_scale=2.0, v_scale=0.5)
    assert torch.equal(as_bytes(vc2.view(-1, 2, 32)[:n]), as_bytes(quantize(m["q"][:n, 2:4] * 1e5, 0.5)))


delegate_all(globals(), __file__)  # parent process: each test above reports its child run


# ----------------------------------------------------------------- in this process: no device


PTR_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    FP8: "*fp8e4nv",
}


def engine_fp8_attention_launches(monkeypatch):
    """The attention launches of a Llama-3.1-8B-shaped layer (32 q heads, 8 KV heads, head
    dim 128) on an FP8 cache, recorded, not run: graph decode steps of 1, 4 and 8 requests with
    the rope prologue and PDL (128- and 64-key tiles; one and two stages), an eager one, a
    decode without rope, a prefill-shaped step."""
    from kernels import paged_attention, pdl
    from kernels.rope_inline import DecodeRope
    from tests.kernels.launch_recorder import LaunchRecorder

    rec = LaunchRecorder(paged_attention._paged_attention_kernel)
    monkeypatch.setattr(paged_attention, "_paged_attention_kernel", rec)
    monkeypatch.setattr(pdl, "launch_kwargs", lambda t: {"USE_PDL": True, "launch_pdl": True})
    hq, hkv, d = 32, 8, 128
    for q_lens, bound, rope, eager in [
        ([1], 1024, True, False),
        ([1] * 4, 4096, True, False),
        ([1] * 8, 1024, True, False),
        ([1] * 3, 1024, True, True),
        ([1] * 2, 2048, False, False),
        ([40, 1], 512, False, True),
    ]:
        n = sum(q_lens)
        c = attention_case(q_lens, [bound - 8] * len(q_lens), hq, hkv, torch.bfloat16, 2.0, 0.5, d=d, slack=8)
        qkv = torch.randn(n, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
        k, v = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d), qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        scales = dict(k_scale=2.0, v_scale=0.5)
        rp = DecodeRope(torch.arange(n), k, v, torch.randn(bound, d), torch.arange(n), **scales) if rope else None
        paged_attention.paged_attention_triton(
            qkv[:, : hq * d].view(n, hq, d), c["k_cache"], c["v_cache"], c["table"], c["seq"], c["qsl"],
            max(q_lens), bound, c["scale"], rope=rp, eager=eager, **scales,
        )  # fmt: skip
    return rec.fn, rec.calls


@pytest.mark.skipif(INTERPRETED, reason="compiles for sm_90: the parent process")
def test_fp8_attention_launches_compile_for_hopper_without_spills(monkeypatch):
    """Every distinct FP8 attention variant the engine's launches above pick compiles for
    sm_90 (as ``test_kernels_compile``), the scales typed float32, and spills nothing."""
    from tests.kernels.test_kernels_compile import _compile, _resource_usage

    fn, calls = engine_fp8_attention_launches(monkeypatch)
    names = [p.name for p in fn.params]
    variants = {}
    for args, kwargs in calls:
        const = {k: v for k, v in kwargs.items() if k in names}
        options = {k: kwargs[k] for k in ("num_warps", "num_stages")}
        ptrs = {n: PTR_TYPES[a.dtype] for n, a in zip(names, args) if n.endswith("_ptr")}
        assert ptrs["k_ptr"] == ptrs["v_ptr"] == "*fp8e4nv" and not const["PRELOAD"]
        variants[repr(sorted(const.items())) + repr(sorted(options.items()))] = (const, ptrs, options)
    assert any(c["BLOCK_N"] == 128 and c["ROPE"] for c, _, _ in variants.values())  # the small-grid tile
    assert any(not c["ONE_QBLOCK_PER_REQ"] for c, _, _ in variants.values())  # and the prefill shape
    floats = ("scale_log2", "k_scale", "v_scale", "eps")
    for const, ptrs, options in variants.values():
        compiled = _compile(fn, const, ptrs, floats=floats, options=options)
        assert "f8E4M3FN" in compiled.asm["ttir"]
        regs, spills = _resource_usage(compiled.asm["cubin"])
        assert spills == 0, (const, options, regs)


@pytest.mark.skipif(INTERPRETED, reason="compiles for sm_90: the parent process")
def test_fp8_kv_writes_compile_for_hopper():
    from kernels.kv_write import _write_kv_kernel
    from kernels.rope_kv import _rope_kv_kernel
    from tests.kernels.test_kernels_compile import _compile

    fp8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "slot_ptr": "*i64"}
    _compile(_write_kv_kernel, dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, KV_BLOCK_SIZE=16), fp8, floats=SCALE_ARGS)
    const = dict(HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64, KV_BLOCK_SIZE=16, Q_NORM=True, K_NORM=True)
    ptrs = dict(fp8, pos_ptr="*i64", cache_ptr="*fp32")
    _compile(_rope_kv_kernel, dict(const, USE_PDL=True), ptrs, floats=("eps", *SCALE_ARGS))


SCALE_ARGS = ("k_scale", "v_scale")


@pytest.mark.skipif(INTERPRETED, reason="records launches: the parent process")
def test_scales_pick_no_variant(monkeypatch):
    """Every kernel that reads or writes the cache takes the scales as runtime float32
    arguments, never specialised: launches with scales 1.0, 0.5, 2 (an int) and 3.7 share
    one variant (``test_kernel_specialization``'s record of the launches)."""
    from kernels import kv_write, paged_attention, rope_kv
    from kernels.rope_inline import DecodeRope
    from tests.kernels.launch_recorder import LaunchRecorder
    from tests.kernels.test_kernel_specialization import _assert_one_variant_per_constexpr_set

    recs = {
        (paged_attention, "_paged_attention_kernel"): None,
        (kv_write, "_write_kv_kernel"): None,
        (rope_kv, "_rope_kv_kernel"): None,
    }
    for mod, name in recs:
        recs[(mod, name)] = LaunchRecorder(getattr(mod, name))
        monkeypatch.setattr(mod, name, recs[(mod, name)])
        params = {p.name: p for p in recs[(mod, name)].fn.params}
        assert all(params[a].do_not_specialize for a in SCALE_ARGS), name
    c = attention_case([1] * 4, [40, 300, 7, 64], 8, 2, torch.bfloat16, 1.0, 1.0)
    t = c["q"].shape[0]
    k, v, pos, slots = c["q"][:, :2], c["q"][:, 2:4], torch.arange(t), torch.arange(t)
    cs = torch.randn(400, 32)
    for k_scale, v_scale in ((1.0, 1.0), (0.5, 2), (2, 0.5), (3.7, 0.01)):
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        for rope in (None, DecodeRope(pos, k, v, cs, slots, **scales)):
            paged_attention.paged_attention_triton(
                c["q"], c["k_cache"], c["v_cache"], c["table"], c["seq"], c["qsl"], 1, c["bound"], c["scale"],
                num_splits=3, rope=rope, **scales,
            )  # fmt: skip
        kv_write.write_kv_triton(k, v, c["k_cache"], c["v_cache"], slots, **scales)
        rope_kv.rope_and_write_kv_triton(pos, c["q"], k, v, cs, c["k_cache"], c["v_cache"], slots, **scales)
    launches = [(rec.fn, call) for rec in recs.values() for call in rec.calls]
    assert len(launches) == 16
    for fn, (args, _) in launches:
        values = dict(zip([p.name for p in fn.params], args))
        assert all(type(values[a]) is float for a in SCALE_ARGS), fn.__name__  # typed fp32, not i32
    _assert_one_variant_per_constexpr_set(launches)
