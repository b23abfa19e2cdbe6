"""The decode-layer benchmark's profile summary (``kernels.bench_decode_layer``), on
synthetic timestamps: the GPU run only fills the buffer."""

import torch

from kernels.bench_decode_layer import summarize_profile
from kernels.decode_layer import PROFILE_STAMPS


def test_profile_summary_reports_each_stretch_and_the_launch_span():
    n = len(PROFILE_STAMPS)
    # two launches x three programs; program p of launch l starts at 1000 l + 10 p and
    # spends (k + 1) * 100 ns + p in the k-th stretch
    ns = torch.zeros(2, 3, n, dtype=torch.int64)
    for launch in range(2):
        for prog in range(3):
            t = 1000 * launch + 10 * prog
            for k in range(n):
                ns[launch, prog, k] = t
                t += (k + 1) * 100 + prog
    got = summarize_profile(ns)
    names = list(got["stretch_ns_median"])
    assert names[0] == "start -> waited" and names[-1] == "barrier 3 -> E done"
    assert len(names) == n - 1
    assert got["stretch_ns_median"]["start -> waited"] == 101  # programs add 0, 1, 2
    assert got["stretch_ns_max"]["A done -> barrier 0"] == 302
    last_end = 20 + sum((k + 1) * 100 + 2 for k in range(n - 1))
    assert got["span_ns_median"] == last_end  # from program 0's start to program 2's end
