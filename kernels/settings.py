"""The kernel settings of this process: ``metadata.config.KernelConfig`` as the kernels use it.

A worker builds one immutable ``KernelSettings`` from its engine config when it builds its
model (``kernels.ops.build_kernel_settings``, tuning tables loaded then) and installs it;
launches read the installed object, never the environment. A process that installs none (a
test, a benchmark calling kernels directly) runs the defaults: ``KernelSettings()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Literal

import triton

TuningTable = Mapping[str, "dict | None"]

TRITON_INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether Triton runs kernels in its interpreter: the knob its ``triton.jit`` decides by (it
reads ``TRITON_INTERPRET``), asked once at import instead of at every launch."""


@dataclass(frozen=True)
class KernelSettings:
    """What the kernel dispatch decides by (see ``KernelConfig`` for each option)."""

    pdl: Literal["auto", "on", "off"] = "auto"
    pdl_max_tokens: int = 0
    rope_in_attention: bool = True
    norm_handoff: bool = True
    skinny_table: TuningTable | None = None
    """The decode-GEMM tuning entries; None: the packaged table (``kernels.skinny_gemm``)."""
    tile_table: TuningTable | None = None
    """The mid-batch GEMM tuning entries; None: the packaged table; empty: tile GEMM off."""


_DEFAULT = KernelSettings()
_installed: KernelSettings = _DEFAULT


def install_kernel_settings(settings: KernelSettings) -> None:
    """Make ``settings`` the ones every later launch in this process follows (a worker does
    this once, before it builds its model)."""
    global _installed
    if not isinstance(settings, KernelSettings):
        raise TypeError(f"expected KernelSettings, got {type(settings).__name__}")
    _installed = settings


def current() -> KernelSettings:
    """The installed settings (the defaults where none were installed)."""
    return _installed


@contextlib.contextmanager
def overridden(**changes) -> Iterator[KernelSettings]:
    """The installed settings with ``changes`` (fields by name) for the duration of the block,
    then the previous ones again (benchmarks and tests comparing kernel choices)."""
    before = _installed
    install_kernel_settings(replace(before, **changes))
    try:
        yield _installed
    finally:
        install_kernel_settings(before)
