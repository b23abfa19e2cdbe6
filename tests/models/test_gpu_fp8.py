"""FP8 weights and KV cache on the GPU (Triton FP8 GEMMs, FP8 attention), with CUDA graphs,
async scheduling, the sync check, speculative decoding and prefix caching on."""

from __future__ import annotations

import pytest
import torch

from tests.fp8_checkpoints import write_fp8_checkpoint
from tests.models.test_fp8_loading import _greedy
from tests.greedy_close import assert_greedy_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a GPU of compute capability 8.9+",
    ),
]

FP8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    from tests.checkpoints import write_checkpoint

    src = write_checkpoint(tmp_path_factory.mktemp("gpu-fp8-src"), "qwen3", hidden=128, heads=4, kv_heads=2)
    return write_fp8_checkpoint(src, tmp_path_factory.mktemp("gpu-fp8"), kv_scales=(0.5, 0.5))


def test_fp8_graphs_async_sync_check_equal_eager(ray_gpu, fp8_ckpt):
    """CUDA graphs + async scheduling + sync_check='error' compute what eager FP8 computes (the
    two may pick other attention split counts: equal up to a near-tie)."""
    fast_tops, eager_tops = [], []
    fast = _greedy(fp8_ckpt, fast_tops, dtype="bfloat16", async_scheduling=True, sync_check="error", **FP8)[0]
    eager = _greedy(fp8_ckpt, eager_tops, dtype="bfloat16", enforce_eager=True, **FP8)[0]
    parted = assert_greedy_close(fast, fast_tops, eager, eager_tops)
    assert parted.count(None) >= len(parted) - 1


def test_fp8_gpu_kernels_agree_with_the_cpu_references(ray_gpu, fp8_ckpt):
    gpu_tops, cpu_tops = [], []
    gpu = _greedy(fp8_ckpt, gpu_tops, dtype="float32", **FP8)[0]
    cpu = _greedy(fp8_ckpt, cpu_tops, dtype="float32", device="cpu", **FP8)[0]
    assert_greedy_close(gpu, gpu_tops, cpu, cpu_tops)


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_fp8_speculative_decoding_keeps_greedy_output(ray_gpu, fp8_ckpt, spec):
    extra = {"speculative_model": str(fp8_ckpt)} if spec == "draft_model" else {}
    plain_tops, spec_tops = [], []
    plain = _greedy(fp8_ckpt, plain_tops, dtype="bfloat16", async_scheduling=True, **FP8)[0]
    drafted = _greedy(
        fp8_ckpt,
        spec_tops,
        dtype="bfloat16",
        async_scheduling=True,
        speculative_method=spec,
        num_speculative_tokens=3,
        **FP8,
        **extra,
    )[0]
    assert_greedy_close(drafted, spec_tops, plain, plain_tops)


def test_fp8_accuracy_on_the_default_model_gpu(ray_gpu):
    """The embedded default in bf16 vs FP8 weights / KV cache / both, on the GPU."""
    from tests.models.test_fp8_accuracy import BOUNDS, check_accuracy

    check_accuracy(BOUNDS, device_args=["--dtype", "bfloat16"])
