"""GPU prefix caching: cached prefixes give exactly the uncached greedy outputs (fp32),
with async scheduling, CUDA graphs, and the sync check on."""

import random

import pytest
import torch

from tests.checkpoints import write_checkpoint

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BLOCK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(
        tmp_path_factory.mktemp("gpu-prefix"),
        "llama",
        hidden=256,
        heads=8,
        kv_heads=2,
        layers=2,
        vocab_size=96,
        max_pos=1024,
    )


def _prompts():
    """A shared system prompt with own suffixes, repeats, and lengths on and just off block edges."""
    rng = random.Random(7)
    system = [rng.randrange(3, 96) for _ in range(5 * BLOCK + 3)]
    out = [system + [rng.randrange(3, 96) for _ in range(n)] for n in (1, 13, 29, 45, 2 * BLOCK - 3)]
    out += [[rng.randrange(3, 96) for _ in range(n)] for n in (4 * BLOCK, 4 * BLOCK + 1, 3 * BLOCK - 1)]
    return out + out[:3]


def _run(ckpt, caching: bool):
    from cluster import LLM, SamplingParams

    llm = LLM(
        model=str(ckpt),
        device="cuda",
        dtype="float32",
        sync_check="error",
        async_scheduling=True,
        max_model_len=512,
        max_num_seqs=8,
        num_kv_blocks=160,
        block_size=BLOCK,
        max_num_batched_tokens=96,
        enable_prefix_caching=caching,
    )
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    try:
        prompts = _prompts()
        batch = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        again = [llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0] for p in prompts[:4]]
        stats = llm.engine.scheduler.prefix_cache_stats()
        llm.engine.scheduler.blocks.check_all_free()
        return [o.outputs[0].token_ids for o in batch + again], stats
    finally:
        llm.shutdown()


@cuda
def test_prefix_caching_on_gpu_equals_no_caching(ray_local, ckpt):
    off, off_stats = _run(ckpt, caching=False)
    on, on_stats = _run(ckpt, caching=True)
    assert off_stats["hits"] == 0
    # the sequential repeats hit every full block of their prompt but the last token's
    assert on_stats["hits"] >= sum((len(p) - 1) // BLOCK * BLOCK for p in _prompts()[:4]), on_stats
    assert [len(t) for t in on] == [24] * len(on)
    assert on == off
