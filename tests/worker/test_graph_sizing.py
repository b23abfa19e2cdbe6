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


def test_graph_output_reserve_grows_with_the_length_buckets():
    """Every decode graph keeps its own logits: the reserve KV sizing takes for them is one
    batch-size sweep a length bucket and query length (the 8B shape's fp32 logits at its
    131,072-token limit: nine buckets, about 10 GB, which had run capture out of memory)."""
    from workers.cuda_graphs import capture_sizes, decode_graph_output_bytes, seq_buckets

    row = 128256 * 4
    one = decode_graph_output_bytes(256, 512, (1,), row, False)
    assert one == sum(-(-b * row // 512) * 512 for b in capture_sizes(256))
    assert decode_graph_output_bytes(256, 131072, (1,), row, False) == len(seq_buckets(131072)) * one == 9 * one
    assert decode_graph_output_bytes(256, 131072, (1, 4), row, False) == 9 * one * 5
    assert 9 * one > 10e9
