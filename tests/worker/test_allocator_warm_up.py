"""The allocator warm-up's sizes (``workers.allocator_warm_up``): every pinned block class a
step's packed copy can take, from the caching host allocator's rounding."""

import torch

from workers.allocator_warm_up import MAX_PINNED_BYTES, MIN_PINNED_BYTES, pinned_sizes, step_copy_bytes


def test_pinned_sizes_cover_every_rounded_request_up_to_the_bound():
    sizes = pinned_sizes(229_376)
    assert sizes[0] == 512 and sizes[-1] == 262_144
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    for request in (1, 511, 512, 513, 70_000, 229_376):  # the class the allocator rounds it to exists
        assert 1 << max(9, (request - 1).bit_length()) in sizes


def test_pinned_sizes_are_bounded_both_ways():
    assert pinned_sizes(10)[-1] == MIN_PINNED_BYTES
    assert pinned_sizes(1 << 40)[-1] == MAX_PINNED_BYTES


def test_step_copy_bytes_bounds_a_full_step_placement():
    """A step placing requests whose prompts fill its token budget: the placement's packed copy
    (``DeviceState.add_many``: tokens, rows, columns, and three words a request) fits."""
    max_tokens, n = 8192, 256
    placement = torch.empty(3 * max_tokens + 3 * n, dtype=torch.int64)
    assert placement.numel() * placement.element_size() <= step_copy_bytes(max_tokens, n)
