"""One line per cell of ``benchmarks.decode_roofline`` result files: the table a device run
prints last; or, with ``--base``, an A/B verdict against a baseline run of the same cells.

    python -m benchmarks.roofline_table OUT/rl-*.json
    python -m benchmarks.roofline_table --base OUT/ab-qwen3-0.6b-def.json OUT/ab-qwen3-0.6b-tfs1.json

A verdict line: the variant's label, batch, context, the baseline's and the variant's median
step, the change, and ``faster`` / ``slower`` only where the two runs' [min, max] step ranges
do not overlap (else ``noise``): a knob becomes a default only on ``faster`` cells.

A line: the file's label (its name without ``rl-`` and ``.json``), batch, context, median step,
ratio, and, for profiled cells, the kernel time a step and the part of it spent in
attention and rope kernels (0 where the cell was not profiled).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def attention_us(profile: dict[str, Any]) -> float:
    """Microseconds a step in the profile's top kernels named for attention or rope."""
    return sum(t["us_per_step"] for t in profile.get("top", []) if "attention" in t["name"] or "rope" in t["name"])


def cell_line(label: str, cell: dict[str, Any]) -> str:
    p = cell.get("profile", {})
    return (
        f"{label:24s} b{cell['batch_size']:<4d} ctx{cell['context_len']:<5d} "
        f"{cell['step_ms_median']:.3f} ms "
        f"ratio {cell['ratio']:.3f} kern {p.get('kernel_us_per_step', 0):7.1f} us "
        f"attn+rope {attention_us(p):6.1f}"
    )


def _cells(path: str) -> dict[tuple[int, int], dict[str, Any]]:
    """A result file's measured cells by (batch, context), in file order; skipped cells (e.g.
    a KV cache that does not fit) have no ratio and are left out."""
    return {(c["batch_size"], c["context_len"]): c for c in json.loads(Path(path).read_text())["cells"] if "ratio" in c}


def table(paths: list[str]) -> list[str]:
    return [
        cell_line(Path(path).stem.removeprefix("rl-"), cell) for path in sorted(paths) for cell in _cells(path).values()
    ]


def verdict(base: dict[str, Any], other: dict[str, Any]) -> str:
    """``faster`` / ``slower`` where the runs' [min, max] step ranges are apart, else ``noise``."""
    if other["step_ms_max"] < base["step_ms_min"]:
        return "faster"
    if other["step_ms_min"] > base["step_ms_max"]:
        return "slower"
    return "noise"


def compare(base_path: str, paths: list[str]) -> list[str]:
    """One verdict line per cell that the baseline and a variant file both measured."""
    base = _cells(base_path)
    lines = []
    for path in paths:
        label = Path(path).stem.removeprefix("rl-").removeprefix("ab-")
        for key, cell in _cells(path).items():
            if key not in base:
                continue
            b = base[key]
            change = 100.0 * (cell["step_ms_median"] / b["step_ms_median"] - 1.0)
            lines.append(
                f"{label:24s} b{key[0]:<4d} ctx{key[1]:<5d} {b['step_ms_median']:.3f} -> "
                f"{cell['step_ms_median']:.3f} ms {change:+6.1f} % {verdict(b, cell)}"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.roofline_table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="+", metavar="JSON")
    p.add_argument("--base", metavar="JSON", help="an A/B verdict of FILES against this run")
    a = p.parse_args(argv)
    print("\n".join(compare(a.base, a.files) if a.base else table(a.files)))


if __name__ == "__main__":
    main()
