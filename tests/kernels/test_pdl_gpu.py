"""Programmatic dependent launch (``kernels.pdl``) on the GPU (``-m gpu``).

A chain of decode-layer kernels (norm+QKV skinny GEMM, rope+KV write and paged
attention (one launch or two), o_proj, norm+gate|up+SiLU, down), each reading what the kernel just
before wrote, is captured in a CUDA graph with PDL on and replayed; the result
must equal, bit for bit, the same chain launched eagerly with PDL off. A kernel
that read its input before ``gdc_wait`` would read the previous replay's (or
garbage) values and differ. Imports on a CPU-only machine; every test is marked.
"""

import pytest
import torch

from kernels import ops, pdl
from tests.kernels.test_kernels_gpu import capture, use_kernel_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H, HQ, HKV, D, INTER, BS = 1024, 16, 8, 128, 3072, 16


def _weights(layers: int, g: torch.Generator):
    def r(*shape, scale):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    return [
        dict(
            qkv=r((HQ + 2 * HKV) * D, H, scale=H**-0.5),
            o=r(H, HQ * D, scale=(HQ * D) ** -0.5),
            gate_up=r(2 * INTER, H, scale=H**-0.5),
            down=r(H, INTER, scale=INTER**-0.5),
            n1=1 + r(H, scale=0.1),
            n2=1 + r(H, scale=0.1),
            qn=1 + r(D, scale=0.1),
            kn=1 + r(D, scale=0.1),
        )
        for _ in range(layers)
    ]


def _chain(x, ws, st):
    """Decode layers over ``st``'s static inputs; returns the last hidden state."""
    t = x.shape[0]
    h, residual = x, None
    for li, w in enumerate(ws):
        qkv, new_res = ops.linear(h, w["qkv"], residual=residual, norm_weight=w["n1"], eps=1e-6)
        residual = h if residual is None else new_res
        q = qkv[:, : HQ * D].view(t, HQ, D)
        k = qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D)
        v = qkv[:, (HQ + HKV) * D :].view(t, HKV, D)
        kc, vc = st["kv"][li]
        o = ops.rope_and_attention(
            st["pos"],
            q,
            k,
            v,
            st["cos_sin"],
            kc,
            vc,
            st["slots"],
            st["bt"],
            st["seq_lens"],
            st["qsl"],
            st["qsl_cpu"],
            1,
            st["bound"],
            D**-0.5,
            w["qn"],
            w["kn"],
            1e-6,
        )
        h = ops.linear(o.reshape(t, HQ * D), w["o"])[0]
        act, residual = ops.linear(
            h, w["gate_up"], residual=residual, norm_weight=w["n2"], eps=1e-6, act="silu_and_mul"
        )
        h = ops.linear(act, w["down"])[0]
    return h


# rope in attention: one launch, which with PDL prefetches its first K/V tile into L2 before
# its wait (1), or the rope + KV-write launch and then attention (0)
@pytest.mark.parametrize("rope_in_attention", [True, False])
@pytest.mark.parametrize("batch", [1, 8])
def test_pdl_graph_chain_equals_plain_launches(batch, rope_in_attention, monkeypatch):
    use_kernel_settings(monkeypatch, rope_in_attention=rope_in_attention)
    probe = torch.empty(1, device="cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9+")
    assert pdl.HAVE_GDC, "this triton has no gdc_wait: PDL would be silently off"
    g = torch.Generator(device="cuda").manual_seed(0)
    layers, bound = 4, 512
    # True must take the fused launch: within its token and key caps
    assert batch <= ops.ROPE_IN_ATTENTION_MAX_TOKENS
    assert batch * bound <= ops.ROPE_IN_ATTENTION_MAX_TOKEN_KEYS
    blocks_per = bound // BS + 1
    num_blocks = batch * blocks_per + 2
    ws = _weights(layers, g)
    seq = torch.randint(bound // 2, bound, (batch,), generator=g, device="cuda", dtype=torch.int32)
    bt = torch.arange(batch * blocks_per, device="cuda", dtype=torch.int32).view(batch, blocks_per)
    pos = (seq - 1).long()
    slots = bt.gather(1, (pos // BS).view(-1, 1).int()).view(-1).long() * BS + pos % BS
    qsl_cpu = torch.arange(batch + 1, dtype=torch.int32)
    from workers.models.rope import cos_sin_cache

    st = dict(
        pos=pos,
        slots=slots,
        bt=bt,
        seq_lens=seq,
        qsl=qsl_cpu.cuda(),
        qsl_cpu=qsl_cpu,
        bound=bound,
        cos_sin=cos_sin_cache(D, 2 * bound, 1e6, None, torch.float32).cuda(),
    )
    kv0 = [
        (
            torch.randn(num_blocks, BS, HKV, D, generator=g, device="cuda").to(torch.bfloat16),
            torch.randn(num_blocks, BS, HKV, D, generator=g, device="cuda").to(torch.bfloat16),
        )
        for _ in range(layers)
    ]
    x = torch.randn(batch, H, generator=g, device="cuda").to(torch.bfloat16)

    use_kernel_settings(monkeypatch, pdl="off")
    assert not pdl.enabled(probe)
    st["kv"] = [(k.clone(), v.clone()) for k, v in kv0]
    want = _chain(x, ws, st).clone()
    want_k = st["kv"][-1][0].clone()

    use_kernel_settings(monkeypatch, pdl="on")
    assert pdl.enabled(probe)
    st["kv"] = [(k.clone(), v.clone()) for k, v in kv0]
    xs = torch.zeros_like(x)
    graph, out = capture(lambda: _chain(xs, ws, st))  # the PDL variants compile outside it
    for _ in range(3):  # replays after garbage: a read before gdc_wait would see stale data
        out.fill_(float("nan"))
        xs.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(st["kv"][-1][0], want_k)
        xs.copy_(torch.randn_like(x))
        graph.replay()
    torch.cuda.synchronize()
