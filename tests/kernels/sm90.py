"""``triton.compile`` for sm_90 (Hopper) on the CPU, with the JIT's specialisations, and the
compiled kernel's resource usage: the compile checks of ``test_kernels_compile`` and the FP8
kernel tests share them."""

import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_sm90(
    fn,
    const: dict,
    ptrs: dict[str, str],
    default_ptr: str = "*bf16",
    floats: tuple[str, ...] = (),
    aligned_ints: tuple[str, ...] = (),
    options: dict | None = None,
):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptrs.get(name, default_ptr)
        else:
            sig[name] = "fp32" if name in floats else "i32"
        if fn.params[i].do_not_specialize:
            continue  # launched unspecialised: no divisibility known
        if name.endswith("_ptr") or name.startswith("stride") or name in aligned_ints:
            # as the JIT specialises them on the GPU (16-byte aligned tensors, strides that
            # are multiples of 16): vectorised loads, and the cp.async pipelines of dot paths
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn, sig, const, attrs), target=HOPPER, options=options)
    assert compiled.asm.get("cubin"), f"{fn.__name__}: no cubin"
    return compiled


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, spill stores in bytes) of a compiled kernel, read from its cubin
    by the bundled ``cuobjdump --dump-resource-usage`` (no device needed)."""
    import re
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/k.cubin"
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    spills = int(re.search(r"STACK:(\d+)", out).group(1))
    return regs, spills
