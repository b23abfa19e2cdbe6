"""Launching a known Triton kernel variant without Triton's per-launch work.

``JITFunction.run`` costs the host about 44 us a launch on an H200 (triton 3.6, measured
in a decode step's launch): besides binding and specialising the arguments it renders its
compile options to a string for the cache key and reads several ``knobs`` (environment
reads) on every call. A decode step makes three to six such launches. ``FastLaunch`` wraps
a ``@triton.jit`` kernel that the host launches (``kernel[grid](...)``) and keeps the
compiled variant it got for each *specialisation key* of its own: per argument, what Triton
specialises on (a tensor's dtype and 16-byte alignment; an int's equality to 1, divisibility
by 16 and width; any other value's type; a constexpr's value) plus the launch options
(``num_warps``, ``launch_pdl``, ...). That key is at least as fine as Triton's, so a hit
launches exactly the variant Triton would pick: through ``CompiledKernel.run``, as
``JITFunction.run`` ends. A miss, an argument of another kind (a tuple, a descriptor), a
Triton before 3.6 and the interpreter go through Triton. Not honoured after a variant is
cached: Triton's ``debug`` and instrumentation knobs changed while the process runs.
"""

from __future__ import annotations

import torch

from kernels.settings import TRITON_INTERPRETED

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


class _Uncached(Exception):
    """An argument whose specialisation this module does not model: Triton's path."""


def _arg_key(v):
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    t = type(v)
    if t is int:  # (Triton: i32, i64 or u64 by range; == 1 and % 16 as attributes)
        return (v == 1, v % 16 == 0, _I32_MIN <= v <= _I32_MAX, v >= 2**63)
    if t is bool or t is float or v is None:
        return t
    raise _Uncached  # tuples, descriptors, enums...: Triton specialises on more than the type


def _launcher_known() -> bool:
    """Whether this Triton ends ``JITFunction.run`` with the launch replicated here: checked
    against 3.6 (the GPU image's) and 3.9; older ones take Triton's path."""
    import triton

    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 6)


class FastLaunch:
    """``FastLaunch(jit_fn)[grid](*args, **kwargs)`` launches like ``jit_fn[grid](...)``
    (see the module docstring); other attributes are the wrapped function's."""

    def __init__(self, fn):
        self.fn = fn
        try:  # (a Triton whose parameters say less: every launch takes Triton's path)
            params = fn.params
            self._names = [p.name for p in params]
            self._constexpr = [p.is_constexpr for p in params]
            self._defaults = [p.default for p in params]
            self._index = {n: i for i, n in enumerate(self._names)}
            self._direct = not TRITON_INTERPRETED and _launcher_known()
        except AttributeError:
            self._direct = False
        self._variants: dict = {}
        self.hits = 0  # launches that skipped Triton's path (tests, diagnostics)

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        if not self._direct:
            return self.fn[grid](*args, **kwargs)
        full = list(args)
        n = len(self._names)
        if len(full) < n:
            full.extend(self._defaults[len(full) :])
        options = []
        for k, v in kwargs.items():
            i = self._index.get(k)
            if i is None:
                options.append((k, v))
            else:
                full[i] = v
        first = next((v for v in full if isinstance(v, torch.Tensor)), None)
        if first is None or not first.is_cuda:
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        try:
            key = (tuple(v if c else _arg_key(v) for v, c in zip(full, self._constexpr)), tuple(options), device)
            kernel = self._variants.get(key)
        except (_Uncached, TypeError):  # (TypeError: an unhashable value)
            return self.fn[grid](*args, **kwargs)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            if kernel is not None:
                self._variants[key] = kernel
            return kernel
        from triton import knobs

        stream = torch._C._cuda_getCurrentRawStream(device)  # (what Triton's driver reads)
        if callable(grid):
            grid = grid(dict(zip(self._names, full)))
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = kernel.launch_metadata(grid, stream, *full)
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *full)
        self.hits += 1
        return kernel


def fast_launch(fn):
    """Decorator form: ``@fast_launch`` above ``@triton.jit`` (host-launched kernels only:
    a kernel other Triton code calls must stay a ``JITFunction``). Under the Triton
    interpreter the function is returned as it is."""
    return fn if TRITON_INTERPRETED else FastLaunch(fn)
