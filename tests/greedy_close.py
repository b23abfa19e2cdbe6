"""Greedy outputs of two correct implementations that round differently (16-bit, FP8, another
batch shape): equal up to a near-tie (vLLM's ``check_logprobs_close`` rule)."""

from __future__ import annotations


def assert_greedy_close(got, got_tops, expected, expected_tops) -> list[int | None]:
    """Equal up to each sequence's first difference, which must be a near-tie (each side's
    token in the other's top log-probabilities there); returns where each sequence parted."""
    parted: list[int | None] = []
    for n, (a, b) in enumerate(zip(got, expected, strict=True)):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        parted.append(i)
        if i is None:
            assert len(a) == len(b), (n, a, b)
            continue
        ours, theirs = got_tops[n][i], expected_tops[n][i]
        assert a[i] in theirs and b[i] in ours, (
            f"sequence {n} parts at token {i} on no near-tie: ours {a[i]} (transformers' top: {theirs}), "
            f"transformers' {b[i]} (our top: {ours})"
        )
    print("sequences parted at", parted)
    return parted
