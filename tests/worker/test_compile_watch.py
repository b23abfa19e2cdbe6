"""The post-start-up compile watch: installs as Triton's JIT cache hook, chains the hook it
replaced, records and logs every variant, and never skips a compile."""

import logging

from triton import knobs

from workers.compile_watch import CompileWatch, describe_variant


def test_watch_records_logs_and_chains(caplog):
    calls = []
    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *a, **k: calls.append(k) or None
    try:
        earlier = knobs.runtime.jit_cache_hook
        watch = CompileWatch(rank=3)
        assert watch.install() and knobs.runtime.jit_cache_hook == watch._hook
        with caplog.at_level(logging.WARNING):
            skip = knobs.runtime.jit_cache_hook(
                key="k",
                repr="_prepare_inputs_kernel[num_warps=4](rows_ptr: *i64:16)",
                fn=None,
                compile={},
                is_manual_warmup=False,
                already_compiled=False,
            )
        assert skip is None  # the compile goes ahead
        assert watch.variants == ["_prepare_inputs_kernel[num_warps=4](rows_ptr: *i64:16)"]
        assert "rank 3" in caplog.text and "_prepare_inputs_kernel" in caplog.text
        assert len(calls) == 1 and calls[0]["key"] == "k"  # the earlier hook still ran
        watch.uninstall()
        assert knobs.runtime.jit_cache_hook is earlier
    finally:
        knobs.runtime.jit_cache_hook = before


def test_variant_description_without_a_repr():
    from triton.runtime.jit import JitFunctionInfo

    info = JitFunctionInfo("kernels.rms_norm", "_rms_norm_kernel", None)
    assert describe_variant({"fn": info}) == "_rms_norm_kernel"
    assert describe_variant({}) == "<unknown kernel>"


def test_variant_description_from_a_real_compile_record():
    """The record a real compile passes the hook (compiling needs a GPU): names come from the
    signature, then the constexprs and the arguments not 16-divisible (what tells variants
    apart); Triton's own repr is ignored."""
    from triton.runtime.jit import JitFunctionInfo

    record = {
        "signature": {"x_ptr": "*bf16", "n": "i32", "stride": "i32", "BLOCK": "constexpr", "eps": "fp32"},
        "constants": {(3,): 64},
        "configs": [{(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}],
        "num_warps": 4,
        "num_stages": 2,
    }
    text = describe_variant({"fn": JitFunctionInfo("m", "_k", None), "compile": record, "repr": "_k[...](x_ptr: ()"})
    assert text == "_k[num_warps=4, num_stages=2] BLOCK=64; not 16-divisible: stride"
