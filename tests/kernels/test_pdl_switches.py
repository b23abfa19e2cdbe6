"""``kernels.pdl``'s decision from the installed kernel settings, and the skinny GEMM's
L2-prefetch sizing (CPU)."""

import torch

from kernels import pdl
from kernels.settings import current, overridden


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
