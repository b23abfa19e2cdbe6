"""Mixed-step CUDA graphs (prefill, mixed and uneven speculative steps, attention inside the
graph) give the eager forward's tokens, and those steps really replay them."""

import pytest
import ray

from tests.checkpoints import write_checkpoint

pytestmark = pytest.mark.gpu


def _eager_and_graphs(ckpt, prompts, params, max_num_batched_tokens: int):
    """Greedy tokens with ``enforce_eager`` and with graphs (float32, async, sync check on),
    and rank 0's stats of the graph run."""
    from cluster import LLM

    outs, stats = {}, None
    for eager in (True, False):
        llm = LLM(
            model=str(ckpt),
            dtype="float32",
            enforce_eager=eager,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=8,
            async_scheduling=True,
            sync_check="error",
        )
        try:
            outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if not eager:
                stats = ray.get([w.stats.remote() for w in llm.engine.executor.workers])[0]
        finally:
            llm.shutdown()
    return outs[True], outs[False], stats


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_step_graphs_match_eager(tmp_path, arch):
    from cluster import SamplingParams

    ckpt = write_checkpoint(
        tmp_path / arch, arch, hidden=256, heads=8, kv_heads=2, layers=4, vocab_size=1024, max_pos=1024
    )
    # prompts of many lengths under a small token budget: chunked prefill, mixed steps
    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 1000 + 2 for j in range(5 + 37 * i)]} for i in range(10)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eager, graphs, stats = _eager_and_graphs(ckpt, prompts, sp, 96)
    assert stats["mixed_graph_replays"] > 0
    # (every graph step's inputs from the stage, by its captured input kernel: workers.input_graphs)
    assert stats["input_graph_replays"] >= stats["mixed_graph_replays"], stats
    assert graphs == eager


def test_every_length_bucket_replays_eagers_tokens(tmp_path):
    """Sequences that start below the 512-token bucket and cross it, of staggered lengths:
    after the prefill's mixed-step graphs, decode graphs of both length buckets and batch
    sizes 8 down to 1 replay from one pool, each reading back logits whose memory the others
    reuse (workers/cuda_graphs.py), and the tokens are the eager forward's."""
    from cluster import SamplingParams

    ckpt = write_checkpoint(
        tmp_path / "m", "llama", hidden=256, heads=8, kv_heads=2, layers=4, vocab_size=1024, max_pos=1024
    )
    prompts = [{"prompt_token_ids": [(11 * i + 5 * j) % 1000 + 2 for j in range(440 + 8 * i)]} for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=40 + 5 * i, ignore_eos=True) for i in range(8)]
    eager, graphs, stats = _eager_and_graphs(ckpt, prompts, params, 256)
    assert stats["mixed_graph_replays"] > 0 and stats["decode_graph_buckets"] == [512, 1024], stats
    assert graphs == eager
