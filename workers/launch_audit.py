"""Two hidden waits of a step that PyTorch's sync-debug mode does not report, audited while
the sync check is armed (``workers.sync_check``):

* **A full launch queue.** The device queues about 1,000 launches (measured on H100 and
  H200); a launch issued while the queue is full blocks until the device drains it, so a step
  that enqueues hundreds of small kernels outside its CUDA graphs waits for a busy device.
  The audit counts the step's device operations outside graphs (aten operators that run on
  the audited device, views and allocations excepted, and Triton launches) and the check
  refuses a step over ``LAUNCH_BUDGET``, naming the operators it issued most.
* **A pageable host-to-device copy.** The runtime stages it through a pinned buffer and waits
  for the stream first, even with ``non_blocking=True``. The audit reports a copy into device
  memory whose host source is not pinned, at the call site (outside ``sync_check.allow_sync``).

Counting goes through a ``TorchDispatchMode`` (a few microseconds an operator) and Triton's
launch hook, so it runs only while a step is armed, never with ``sync_check = "off"``.
"""

from __future__ import annotations

import collections
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Device operations one step may enqueue outside its graphs: well under the ~1,000-entry
# queue, which also still holds the previous step's work under async scheduling.
LAUNCH_BUDGET = 384

aten = torch.ops.aten
# operators that allocate or describe memory without launching device work
_NO_LAUNCH = frozenset(
    p._qualified_op_name
    for p in (aten.empty, aten.empty_strided, aten.empty_like, aten.detach, aten.alias, aten.lift_fresh, aten.set_)
)
_COPIES = (aten.copy_.default, aten._to_copy.default)

_local = threading.local()  # this thread's armed audit, and its count of deliberate waits
_hook_lock = threading.Lock()
_hook_installed = False


def _on_device(args, kwargs, device_type: str) -> bool:
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == device_type:
        return True
    return any(isinstance(x, torch.Tensor) and x.device.type == device_type for x in tree_leaves((args, kwargs)))


def _pageable_source(func, args, kwargs, device_type: str) -> bool:
    """Whether ``func`` copies a pageable host tensor into ``device_type`` memory."""
    if device_type == "cpu":
        return False  # host to host
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        into = dst.device.type == device_type
    else:  # _to_copy(src, *, device=...)
        src, dev = args[0], kwargs.get("device")
        into = dev is not None and torch.device(dev).type == device_type
    return into and src.device.type == "cpu" and src.numel() > 0 and not src.is_pinned()


def _triton_launch(metadata) -> None:
    audit = getattr(_local, "audit", None)
    if audit is not None:
        audit.launches += 1
        audit.by_op["triton"] += 1


def _install_triton_hook() -> None:
    """Counts Triton launches of audited threads (a global hook: installed once, inert elsewhere)."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        try:
            from triton import knobs
        except ImportError:  # no Triton (or an old one): aten operators only
            _hook_installed = True
            return
        runtime = knobs.runtime
        hooks = runtime.launch_enter_hook
        if hasattr(hooks, "add"):  # triton's own hook chain (3.5+): join it, keep it a chain
            hooks.add(_triton_launch)
        elif hooks is None:
            runtime.launch_enter_hook = _triton_launch
        else:

            def chained(metadata):
                _triton_launch(metadata)
                hooks(metadata)

            runtime.launch_enter_hook = chained
        _hook_installed = True


class LaunchAudit(TorchDispatchMode):
    """Counts one step's device operations on ``device_type`` (outside graphs: a replay is one
    call, not an operator) and passes a message to ``report`` (which may raise) at each
    pageable host-to-device copy."""

    def __init__(self, device_type: str, report):
        super().__init__()
        self.device_type, self.report = device_type, report
        self.launches = 0
        self.by_op: collections.Counter = collections.Counter()

    def __enter__(self):
        if self.device_type == "cuda":
            _install_triton_hook()
        self._outer = getattr(_local, "audit", None)
        _local.audit = self
        return super().__enter__()

    def __exit__(self, *exc):
        _local.audit = self._outer
        return super().__exit__(*exc)

    def top_ops(self, n: int = 5) -> str:
        return ", ".join(f"{name} x{count}" for name, count in self.by_op.most_common(n))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _COPIES and _pageable_source(func, args, kwargs, self.device_type):
            if not getattr(_local, "deliberate", 0):
                self.report(
                    "a host-to-device copy from pageable memory inside a step: the runtime waits for "
                    "the device before it, even with non_blocking=True; copy from pinned memory "
                    "(workers.device_state.to_device)"
                )
        if not func.is_view and func._overloadpacket._qualified_op_name not in _NO_LAUNCH:
            if _on_device(args, kwargs, self.device_type):
                self.launches += 1
                self.by_op[func._overloadpacket.__name__] += 1
        return func(*args, **kwargs)


def deliberate(delta: int) -> None:
    """``sync_check.allow_sync`` entering (+1) or leaving (-1) a deliberate wait."""
    _local.deliberate = getattr(_local, "deliberate", 0) + delta
