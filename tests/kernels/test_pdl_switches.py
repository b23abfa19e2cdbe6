"""``kernels.pdl``'s decision from the installed kernel settings, and the skinny GEMM's
L2-prefetch sizing (CPU)."""

import torch

from kernels import pdl
from kernels.settings import current, overridden
from kernels.skinny_gemm import _l2_prefetch_bytes


def allows() -> bool:
    s = current()
    return pdl._token_limit_allows(s.pdl, s.pdl_max_tokens)


def test_auto_mode_is_the_default_and_covers_one_token_passes_only():
    assert current().pdl == "auto" and current().pdl_max_tokens == 0
    assert not allows()  # outside a declared pass (the sampler): off
    with pdl.step_tokens(1):
        assert allows()
    with pdl.step_tokens(8):
        assert not allows()
    with overridden(pdl_max_tokens=8), pdl.step_tokens(8):  # moves auto's limit
        assert allows()


def test_token_limit_scopes_pdl():
    with overridden(pdl="on"):
        with pdl.step_tokens(512):
            assert allows()  # 0: no limit
        with overridden(pdl_max_tokens=1):
            assert allows()  # no pass declared (direct kernel calls)
            with pdl.step_tokens(1):
                assert allows()
                with pdl.step_tokens(8):
                    assert not allows()
                assert allows()  # the outer scope is restored
    assert current().pdl == "auto"  # the override ended with its block


def test_off_mode_and_cpu_tensors_never_use_pdl():
    with overridden(pdl="off"), pdl.step_tokens(1):
        assert not pdl.enabled(torch.zeros(1))
    with overridden(pdl="on"), pdl.step_tokens(1):
        assert pdl.launch_kwargs(torch.zeros(1)) == {"USE_PDL": False}  # CPU: never


def test_l2_prefetch_sizing(monkeypatch):
    x, w = torch.zeros(1, 1000), torch.zeros(64, 1000)  # rows of 4000 bytes
    assert _l2_prefetch_bytes({"prefetch_l2": 2048}, x, w, 1000) == 0  # CPU: never
    monkeypatch.setattr(pdl, "bulk_prefetch_ok", lambda t: True)
    assert _l2_prefetch_bytes({"prefetch_l2": 2050}, x, w, 1000) == 2048  # 16-byte multiple
    assert _l2_prefetch_bytes({"prefetch_l2": True}, x, w, 1000) == 4000  # whole rows
    assert _l2_prefetch_bytes({"prefetch_l2": 10**6}, x, w, 1000) == 4000  # capped at a row
    odd = torch.zeros(64, 1001)[:, :1000]  # rows 4004 bytes apart: not 16-byte aligned
    assert _l2_prefetch_bytes({"prefetch_l2": True}, x, odd, 1000) == 0
    assert _l2_prefetch_bytes({}, x, w, 1000) == 0  # no entry: none
