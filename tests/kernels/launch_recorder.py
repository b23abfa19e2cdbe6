"""Kernel launches recorded instead of run, keyed as Triton keys its compilations (CPU).

Triton specialises every int argument not in ``do_not_specialize`` on ``== 1`` and
``% 16 == 0``, and every tensor on its dtype and 16-byte alignment; constexprs and launch
options (``num_warps``, ...) select a variant too. Two launches with different keys compile
two variants: a key that follows the batch size compiles one mid-serving.
"""

from __future__ import annotations

import torch


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records."""

    def __init__(self, kernel):
        from triton.runtime.jit import JITFunction

        # the interpreter's kernel object has no parameter list: rebuild the compiled one's
        self.fn = JITFunction(kernel.fn, **kernel.kwargs) if hasattr(kernel, "kwargs") else kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))

    def variants(self) -> set:
        """The distinct ``launch_key`` of the recorded launches."""
        return {launch_key(self.fn, args, kwargs) for args, kwargs in self.calls}


def launch_key(fn, args: tuple, kwargs: dict) -> tuple[tuple, tuple, tuple]:
    """(constexprs, specialisations, launch options) of one launch of ``fn``."""
    names = {p.name for p in fn.params}
    values = {p.name: v for p, v in zip(fn.params, args)} | kwargs
    consts, spec = [], []
    for p in fn.params:
        v = values.get(p.name, p.default)
        if p.is_constexpr:
            consts.append((p.name, v))
        elif p.do_not_specialize:
            continue
        elif isinstance(v, torch.Tensor):  # (its alignment too, unless the kernel says not to)
            aligned = None if getattr(p, "do_not_specialize_on_alignment", False) else v.data_ptr() % 16 == 0
            spec.append((p.name, str(v.dtype), aligned))
        elif isinstance(v, int) and not isinstance(v, bool):
            spec.append((p.name, v == 1, v % 16 == 0))
        elif v is None:
            spec.append((p.name, None))
    opts = sorted((k, v) for k, v in kwargs.items() if k not in names)
    return tuple(consts), tuple(spec), tuple(opts)
