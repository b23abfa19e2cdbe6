"""Host side of kernels.l2_warm: which bytes a decode attention launch warms into L2, how many
programs do it, and the budget switch. (The kernel side: tests/test_kernels_compile.py
compiles it for sm_90 and checks the bulk prefetch is emitted; tests/test_kernels_gpu_decode.py
checks on the GPU that it leaves the attention's results bit-identical.)"""

import pytest
import torch

from kernels import l2_warm


def _weights():
    return [torch.empty(n, 64, dtype=torch.bfloat16) for n in (256, 512, 128)]  # 32, 64, 16 KB


def test_warm_set_takes_tensors_in_order_up_to_the_budget():
    ws = _weights()
    whole = l2_warm.warm_set(ws, 1 << 30)
    assert [n for _, n in whole.ranges] == [32768, 65536, 16384]
    base = ws[0].data_ptr()
    assert [off for off, _ in whole.ranges] == [w.data_ptr() - base for w in ws]
    assert whole.nbytes == 114688
    cut = l2_warm.warm_set(ws, 32768 + 1000)  # the second range cut short, to a 16-byte multiple
    assert cut.ranges == ((0, 32768), (ws[1].data_ptr() - base, 992))
    first = l2_warm.warm_set(ws, 100)
    assert first.ranges == ((0, 96),)


def test_warm_set_kernel_args_pad_missing_ranges():
    ws = _weights()
    args = l2_warm.warm_set(ws[:1], 1 << 20).kernel_args()
    assert args[0].dtype == torch.uint8 and args[0].data_ptr() == ws[0].data_ptr()
    assert args[1:] == (0, 32768, 0, 0, 0, 0)


def test_warm_set_refuses_what_is_not_one_range():
    ws = _weights()
    assert l2_warm.warm_set(ws, 0) is None
    assert l2_warm.warm_set(ws, 15) is None
    assert l2_warm.warm_set([], 1 << 20) is None
    assert l2_warm.warm_set([ws[0].t()] + ws[1:], 1 << 20) is None  # not contiguous


def test_budget_from_environment(monkeypatch):
    monkeypatch.delenv("SYNCLESS_L2_WARM_MB", raising=False)
    assert l2_warm.budget_bytes() == l2_warm.DEFAULT_BUDGET_MB << 20
    monkeypatch.setenv("SYNCLESS_L2_WARM_MB", "0")
    assert l2_warm.budget_bytes() == 0
    monkeypatch.setenv("SYNCLESS_L2_WARM_MB", " 16 ")
    assert l2_warm.budget_bytes() == 16 << 20
    for bad in ("-1", "1.5", "lots"):
        monkeypatch.setenv("SYNCLESS_L2_WARM_MB", bad)
        with pytest.raises(ValueError, match="SYNCLESS_L2_WARM_MB"):
            l2_warm.budget_bytes()


@pytest.mark.parametrize("busy,groups,sms,want", [
    (32, 8, 132, 13),     # batch 1, 8 KV heads, 4 splits: the 100 idle SMs, 13 a head
    (256, 64, 132, 1),    # a full GPU still gets an SM's worth of warm programs per 8 SMs
    (8, 8, 132, 16),
    (0, 0, 132, 132),
])
def test_warm_programs(busy, groups, sms, want):
    assert l2_warm.warm_programs(busy, groups, sms) == want


def test_not_usable_off_gpu():
    assert not l2_warm.usable(torch.zeros(1))


def test_decoder_layer_builds_its_warm_set_once_per_budget(monkeypatch):
    """o_proj, gate|up, down: the launches after attention, in that order."""
    from workers.distributed import TPGroup
    from workers.models.arch import ModelArch
    from workers.models.llama import DecoderLayer

    arch = ModelArch(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64,
                     intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                     max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False,
                     mlp_bias=False, qk_norm=False, eos_token_ids=(1,), bos_token_id=None,
                     torch_dtype="bfloat16")
    layer = DecoderLayer(arch, TPGroup(), torch.bfloat16)
    monkeypatch.setenv("SYNCLESS_L2_WARM_MB", "1")
    ws = layer.warm_set()
    want = [layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    assert [n for _, n in ws.ranges] == [w.numel() * 2 for w in want]
    assert layer.warm_set() is ws
    monkeypatch.setenv("SYNCLESS_L2_WARM_MB", "0")
    assert layer.warm_set() is None
