"""How much the CUDA graphs cover: the length buckets decode and proposal graphs are captured
for, and the step the KV cache sizing measures (the largest a mixed-step graph is captured for)."""

import pytest


@pytest.mark.parametrize(
    "tokens,max_len,lens", [(8192, 1024, [1024] * 8), (2500, 1024, [1024, 1024, 452]), (100, 1024, [100])]
)
def test_memory_profile_covers_the_largest_captured_step(tokens, max_len, lens):
    """The KV cache is sized after a forward of the largest step a mixed graph is captured for,
    in requests no longer than the model's length (its rotary table)."""
    from workers.memory_profile import profile_request_lens

    assert profile_request_lens(tokens, max_len) == lens


@pytest.mark.parametrize(
    "max_len,buckets",
    [(2048, [512, 1024, 2048]), (2056, [512, 1024, 2056]), (3000, [512, 1024, 2048, 3000]), (300, [300])],
)
def test_decode_graph_length_buckets(max_len, buckets):
    """Decode and proposal graphs are captured per length bucket; a maximum barely past a
    power of two (a draft's 2k + 2 extra positions) replaces it instead of adding a bucket."""
    from workers.cuda_graphs import seq_buckets

    assert seq_buckets(max_len) == buckets


@pytest.mark.parametrize("batched,seqs,max_len", [(8192, 256, 1024), (2048, 4, 256), (512, 256, 4096)])
def test_the_profiled_step_is_the_top_mixed_bucket(batched, seqs, max_len):
    """The memory profile's step (``max_step_tokens``) is exactly the largest token bucket the
    mixed-step graphs capture, so capture never needs more than the profile measured."""
    from workers.memory_profile import profile_request_lens
    from workers.mixed_graphs import max_step_tokens, token_buckets

    n = max_step_tokens(batched, seqs, max_len)
    assert token_buckets(n)[-1] == n == sum(profile_request_lens(n, max_len))
    assert n <= batched and n <= seqs * max_len


def test_graph_output_reserve():
    """KV sizing reserves what the graphs keep: the logits graphs give their outputs back to
    the pool, so the largest one counts however many length buckets (kept apart, the 8B
    shape's fp32 logits at its 131,072-token limit held about 10 GB: nine buckets); graphs of
    hidden states (the draft's) keep one each, a batch-size sweep a bucket and query length."""
    from workers.cuda_graphs import capture_sizes, decode_graph_output_bytes, seq_buckets

    row = 128256 * 4
    top = 256 * row + 256 * 8  # 256 rows of logits and their argmax
    assert decode_graph_output_bytes(256, 512, (1,), row, True) == top
    assert decode_graph_output_bytes(256, 131072, (1,), row, True) == top
    assert decode_graph_output_bytes(256, 131072, (1, 4), row, True) == 4 * 256 * row
    hidden = 4096 * 2
    one = decode_graph_output_bytes(256, 512, (1,), hidden, False)
    assert one == sum(-(-b * hidden // 512) * 512 for b in capture_sizes(256))
    assert decode_graph_output_bytes(256, 131072, (1,), hidden, False) == len(seq_buckets(131072)) * one == 9 * one
    assert decode_graph_output_bytes(256, 131072, (1, 4), hidden, False) == 9 * one * 5


def test_borrowed_view_aliases_without_owning():
    """A logits graph's output view reads the graph's memory without keeping it allocated."""
    import torch

    from workers.cuda_graphs import borrowed_view

    t = torch.arange(24.0).reshape(4, 6)[:, 1:5]  # a strided view with an offset
    use = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    v = borrowed_view(t)
    assert (v.shape, v.stride(), v.storage_offset()) == (t.shape, t.stride(), t.storage_offset())
    assert v.data_ptr() == t.data_ptr() and torch.equal(v, t)
    t[2, 3] = -1.0  # the graph writes on replay: the view sees it
    assert v[2, 3] == -1.0
    assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == use  # no new owner
