"""One line per cell of ``benchmarks.decode_roofline`` result files: the table a device run
prints last.

    python -m benchmarks.roofline_table OUT/rl-*.json

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
    return sum(t["us_per_step"] for t in profile.get("top", [])
               if "attention" in t["name"] or "rope" in t["name"])


def cell_line(label: str, cell: dict[str, Any]) -> str:
    p = cell.get("profile", {})
    return (f"{label:24s} b{cell['batch_size']:<4d} ctx{cell['context_len']:<5d} "
            f"{cell['step_ms_median']:.3f} ms "
            f"ratio {cell['ratio']:.3f} kern {p.get('kernel_us_per_step', 0):7.1f} us "
            f"attn+rope {attention_us(p):6.1f}")


def table(paths: list[str]) -> list[str]:
    lines = []
    for path in sorted(paths):
        label = Path(path).stem.removeprefix("rl-")
        for cell in json.loads(Path(path).read_text())["cells"]:
            if "ratio" in cell:  # skipped cells (e.g. a KV cache that does not fit) have none
                lines.append(cell_line(label, cell))
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.roofline_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="JSON")
    print("\n".join(table(p.parse_args(argv).files)))


if __name__ == "__main__":
    main()
