"""Report every Triton kernel variant a worker needs after start-up.

Triton compiles (or loads from its disk cache) a kernel the first time a process launches
it with a new specialisation: other constexprs, or a pointer or integer argument whose
16-byte divisibility differs. Compiling takes 0.5-2 s on the GPU host, inside whatever
step launched it. Start-up (graph capture, ``ModelRunner.warm_up``) should leave nothing
to compile, so after it every new variant is logged as a warning naming the kernel and
its specialisation, and counted (``WorkerActor.stats``): a regression such as a
batch-parity-dependent pointer alignment (docs/decisions.md) shows up as a log line
instead of a slow first minute of serving.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Installs itself as Triton's JIT cache hook (chaining any earlier hook)."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.variants: list[str] = []
        self._lock = threading.Lock()
        self._previous = None
        self._installed = False

    def install(self) -> bool:
        """False where this Triton has no JIT cache hook (nothing is watched then)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        self._previous = runtime.jit_cache_hook
        runtime.jit_cache_hook = self._hook
        self._installed = True
        return True

    def uninstall(self) -> None:
        if self._installed:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._previous
            self._installed = False

    def _hook(self, *args: Any, **kwargs: Any):
        what = describe_variant(kwargs)
        with self._lock:
            self.variants.append(what)
        logger.warning(
            "rank %d: Triton kernel variant needed after start-up (compiled or loaded mid-serving): %s", self.rank, what
        )
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None  # never skip the compile


def describe_variant(kwargs: dict[str, Any]) -> str:
    """What tells this variant apart: the kernel's name, launch options, constexpr values and
    the arguments *not* specialised as 16-divisible, read from the hook's ``compile`` record.
    (Triton's own ``repr`` zips the parameters with a string key in 3.6-3.9, so its argument
    list is garbage.) Falls back to that ``repr``, then to the function's name."""
    fn = kwargs.get("fn")  # triton's JitFunctionInfo(module, name, jit_function)
    name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", fn), "__qualname__", None)
    compiled = kwargs.get("compile")
    if isinstance(compiled, dict) and isinstance(compiled.get("signature"), dict):
        return _describe_compile(str(name or "<unknown kernel>"), compiled)[:1200]
    text = kwargs.get("repr")
    if text:
        return str(text)[:600]
    return str(name or "<unknown kernel>")


def _describe_compile(name: str, compiled: dict[str, Any]) -> str:
    names = list(compiled["signature"])
    types = compiled["signature"]

    def arg(path) -> str:
        path = tuple(path) if isinstance(path, (tuple, list)) else (path,)
        base = names[path[0]] if path and isinstance(path[0], int) and path[0] < len(names) else "?"
        return base + "".join(f"[{i}]" for i in path[1:])

    consts = sorted(f"{arg(p)}={v}" for p, v in (compiled.get("constants") or {}).items())
    attrs = (compiled.get("configs") or [{}])[0] or {}
    divisible = {arg(p) for p, a in attrs.items() if any(x and x[0] == "tt.divisibility" for x in a)}
    loose = [
        n
        for n in names
        if types[n] != "constexpr" and n not in divisible and (types[n].startswith("*") or types[n][:1] in ("i", "u"))
    ]
    opts = ", ".join(f"{k}={compiled[k]}" for k in ("num_warps", "num_stages") if k in compiled)
    return f"{name}[{opts}] {' '.join(consts)}; not 16-divisible: {', '.join(loose) or '-'}"
