"""What the captured CUDA graphs keep on the device, and the KV sizing's reserve for it.

The logits graphs give their outputs back to the graph pool, so the memory capture takes does
not grow with the length buckets (with every graph's fp32 logits kept apart, the Qwen3-0.6B
shape at its 40,960-token limit ran an H100 out of memory at capture), and what stays
allocated is within the reserve ``workers.memory_profile`` takes from the KV budget."""

import pytest
import torch

from tests.checkpoints import write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", [{}, {"speculative_method": "ngram", "num_speculative_tokens": 3}])
def test_graph_outputs_share_the_pool(tmp_path, spec):
    from metadata.config import EngineConfig
    from workers.distributed import TPGroup
    from workers.memory_profile import graph_output_bytes
    from workers.model_runner import ModelRunner

    ckpt = write_checkpoint(
        tmp_path / "m", "llama", hidden=256, heads=8, kv_heads=2, layers=2, vocab_size=128000, max_pos=2048
    )
    cfg = EngineConfig.from_options(
        model=str(ckpt), dtype="bfloat16", num_kv_blocks=64, max_num_seqs=64, max_num_batched_tokens=256, **spec
    )
    runner = ModelRunner(cfg, str(ckpt), torch.device("cuda", 0), TPGroup(), 2048)
    runner.init_kv_cache()  # profiles a forward first (cuBLAS workspaces and the like stay allocated)
    reserve = graph_output_bytes(runner)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # as capture's first step does: the profile's cached blocks go
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    runner.capture_cuda_graphs()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - allocated
    grown = torch.cuda.memory_reserved() - reserved
    # 3 length buckets x 8 batch sizes x (1 or 2) query lengths of 128,000-entry fp32 logits:
    # kept apart, 269 MB a query length (q = 4: four times that)
    assert len(runner.graphs.graphs) == 24 * (2 if spec else 1)
    apart = sum(out.untyped_storage().nbytes() for _, out, _ in runner.graphs.graphs.values())
    assert apart > (1 if not spec else 5) * 260e6
    # The pool holds about the largest graph's logits, what the reserve counts (plus the
    # capture's intermediates, here at most a 16-bit copy of those logits, the capture
    # stream's cuBLAS workspace, 32 MiB on an H100, and static inputs), not every graph's
    assert grown < apart / 2, (grown, apart)
    assert grown <= 2 * reserve + (48 << 20), (grown, reserve)
    # what stays allocated (static inputs, workspaces, the mixed graphs' hidden states)
    assert kept <= reserve + (48 << 20), (kept, reserve)
