"""Pipeline parallelism on GPUs over NCCL: PP=2 (and PP=2 x TP=2 where the host has four
GPUs) gives the same greedy tokens as one GPU, and both agree with transformers.

fp32 keeps the comparison exact: a stage boundary only moves where the hidden states and
the residual live, not how they are computed. Runs with async scheduling (P + 2 plans
queued) and the sync check in ``error`` mode, so a stage transfer or the sampled tokens'
device-to-device return that synchronised a host would fail the run.
"""

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.parallel.test_gpu_tensor_parallel import MAX_NEW, _generate, _gpus
from tests.worker.test_gpu_engine import _hf_greedy, _prompts, assert_greedy_equal

pytestmark = pytest.mark.gpu

LAYERS = 4


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return write_checkpoint(
        tmp_path_factory.mktemp("gpu-pp-llama"),
        "llama",
        hidden=256,
        heads=8,
        kv_heads=2,
        layers=LAYERS,
        vocab_size=96,
        max_pos=1024,
    )


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "pp2xtp2"])
def test_pp2_greedy_matches_one_gpu(ray_local, llama_ckpt, tp):
    if _gpus() < 2 * tp:
        pytest.skip(f"PP=2 x TP={tp} needs {2 * tp} GPUs, this host has {_gpus()}")
    prompts = _prompts()
    one, _ = _generate(llama_ckpt, prompts, tp=1)
    got, info = _generate(llama_ckpt, prompts, tp, pipeline_parallel_size=2)
    assert got == one
    expected, hf_logits = _hf_greedy(llama_ckpt, prompts, MAX_NEW, dtype=torch.float32)
    assert_greedy_equal(prompts, got, expected, hf_logits, torch.float32, LAYERS)
    assert [i["pp_stage"] for i in info] == [0] * tp + [1] * tp
    assert all(i["collective"] == "nccl" for i in info), info
    assert len({g for i in info for g in i["gpu_ids"]}) == 2 * tp  # one GPU per rank
    first, last = info[0], info[tp]
    assert first["pp_sent_hidden"] == last["pp_received_hidden"] > 0
    assert last["pp_sent_tokens"] == first["pp_received_tokens"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chained_stages_equal_the_whole_model_on_one_gpu(llama_ckpt, dtype):
    """The stage models' CUDA kernels, in one process: a stage boundary ends the norm handoff
    that runs between layers at batch 1 (the next stage starts from the plain hidden state and
    residual), so the logits agree up to rounding rather than bit for bit."""
    from tests.parallel.test_pipeline_parallel_stages import chained_vs_whole

    if not _gpus():
        pytest.skip("needs a CUDA device")
    for ref, got in chained_vs_whole(llama_ckpt, [2, 2], torch.device("cuda"), dtype, prompt_len=37):
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item()
        print(f"{dtype} max |diff| {err:.3g} of max |logit| {scale:.3g}")
        assert err <= (1e-5 if dtype == torch.float32 else 2**-6) * scale, (err, scale)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
