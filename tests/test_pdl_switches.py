"""Host-side switches of ``kernels.pdl`` and the skinny GEMM's L2-prefetch sizing (CPU)."""

import pytest
import torch

from kernels import pdl
from kernels.skinny_gemm import _l2_prefetch_bytes


def test_auto_mode_is_the_default_and_covers_one_token_passes_only(monkeypatch):
    monkeypatch.delenv("SYNCLESS_PDL", raising=False)
    monkeypatch.delenv("SYNCLESS_PDL_MAX_TOKENS", raising=False)
    assert pdl.mode() == "auto"
    assert not pdl._token_limit_allows()  # outside a declared pass (the sampler): off
    with pdl.step_tokens(1):
        assert pdl._token_limit_allows()
    with pdl.step_tokens(8):
        assert not pdl._token_limit_allows()
    monkeypatch.setenv("SYNCLESS_PDL_MAX_TOKENS", "8")  # moves auto's limit
    with pdl.step_tokens(8):
        assert pdl._token_limit_allows()
    for raw, want in (("auto", "auto"), ("1", "on"), ("on", "on"), ("0", "off"), ("off", "off")):
        monkeypatch.setenv("SYNCLESS_PDL", raw)
        assert pdl.mode() == want
    monkeypatch.setenv("SYNCLESS_PDL", "auto")
    assert pdl._token_limit_allows("on")  # a mode read once by the caller wins over the env
    monkeypatch.setenv("SYNCLESS_PDL", "sometimes")
    with pytest.raises(ValueError, match="SYNCLESS_PDL must be auto, 1 or 0, got 'sometimes'"):
        pdl.mode()


def test_token_limit_scopes_pdl(monkeypatch):
    monkeypatch.setenv("SYNCLESS_PDL", "1")
    monkeypatch.delenv("SYNCLESS_PDL_MAX_TOKENS", raising=False)
    with pdl.step_tokens(512):
        assert pdl._token_limit_allows()  # unset: no limit
    monkeypatch.setenv("SYNCLESS_PDL_MAX_TOKENS", "1")
    assert pdl._token_limit_allows()  # no pass declared (direct kernel calls)
    with pdl.step_tokens(1):
        assert pdl._token_limit_allows()
        with pdl.step_tokens(8):
            assert not pdl._token_limit_allows()
        assert pdl._token_limit_allows()  # the outer scope is restored


@pytest.mark.parametrize("var", ["SYNCLESS_PDL_MAX_TOKENS", "SYNCLESS_L2_PREFETCH"])
def test_bad_switch_values_are_named(monkeypatch, var):
    monkeypatch.setenv(var, "-4")
    with pytest.raises(ValueError, match=f"{var} must be a non-negative integer, got '-4'"):
        pdl._token_limit_allows() if var.endswith("TOKENS") else pdl.l2_prefetch_row_bytes()


def test_l2_prefetch_sizing(monkeypatch):
    x, w = torch.zeros(1, 1000), torch.zeros(64, 1000)  # rows of 4000 bytes
    assert _l2_prefetch_bytes({"prefetch_l2": 2048}, x, w, 1000, False) == 0  # CPU: never
    monkeypatch.setattr(pdl, "bulk_prefetch_ok", lambda t: True)
    assert _l2_prefetch_bytes({"prefetch_l2": 2050}, x, w, 1000, False) == 2048  # 16-byte multiple
    assert _l2_prefetch_bytes({"prefetch_l2": True}, x, w, 1000, False) == 4000  # whole rows
    assert _l2_prefetch_bytes({"prefetch_l2": 10**6}, x, w, 1000, False) == 4000  # capped at a row
    odd = torch.zeros(64, 1001)[:, :1000]  # rows 4004 bytes apart: not 16-byte aligned
    assert _l2_prefetch_bytes({"prefetch_l2": True}, x, odd, 1000, False) == 0
    monkeypatch.setenv("SYNCLESS_L2_PREFETCH", "4096")
    assert _l2_prefetch_bytes({}, x, w, 1000, False) == 0  # the env only applies with PDL on
    assert _l2_prefetch_bytes({}, x, w, 1000, True) == 4000


def test_attention_preload_defaults_to_keys_and_values_and_rejects_bad_values(monkeypatch):
    monkeypatch.delenv("SYNCLESS_ATTN_PRELOAD", raising=False)
    assert pdl.attention_preload() == 2
    for raw, want in (("0", 0), ("1", 1), (" 2 ", 2)):
        monkeypatch.setenv("SYNCLESS_ATTN_PRELOAD", raw)
        assert pdl.attention_preload() == want
    monkeypatch.setenv("SYNCLESS_ATTN_PRELOAD", "3")
    with pytest.raises(ValueError, match="must be 0, 1 or 2, got 3"):
        pdl.validate_switches()
    monkeypatch.setenv("SYNCLESS_ATTN_PRELOAD", "keys")
    with pytest.raises(ValueError, match="SYNCLESS_ATTN_PRELOAD must be a non-negative integer"):
        pdl.attention_preload()
