"""``kernels.fast_launch``: a known variant launched directly computes what Triton's path does,
a new specialisation (alignment, an int's class) takes Triton's path, and it records in graphs."""

import pytest
import torch

from kernels import argmax as am
from kernels.ops import argmax

pytestmark = pytest.mark.gpu


def _check(x):
    out = argmax(x)
    torch.cuda.synchronize()
    ref = x.float().argmax(dim=-1)
    assert torch.equal(out, ref), (out, ref)


def test_direct_launches_match_and_are_used():
    g = torch.Generator(device="cuda").manual_seed(0)
    kernel = am._argmax_partial_kernel
    before = kernel.hits
    base = torch.randn(9, 5000, device="cuda", generator=g)
    for _ in range(3):
        _check(base)
    assert kernel.hits > before, "repeated launches of one variant never took the direct path"
    # other specialisations: an unaligned view, a row count of 1, a vocabulary divisible by 16
    for x in (base[:, 1:], base[:1], base[:, :4096], torch.randn(3, 151_936, device="cuda", generator=g)):
        for _ in range(2):
            _check(x)


def test_direct_launch_inside_a_cuda_graph():
    x = torch.randn(4, 3000, device="cuda")
    for _ in range(2):
        _check(x)  # the variant is known: the capture takes the direct path
    hits = am._argmax_partial_kernel.hits
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax(x)
    assert am._argmax_partial_kernel.hits > hits
    x.copy_(torch.randn(4, 3000, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.argmax(dim=-1))
