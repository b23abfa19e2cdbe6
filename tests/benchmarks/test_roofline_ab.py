"""``python -m benchmarks.roofline_table --base``: the A/B verdict a device run prints."""

import json


def _cell(b, ctx, med, lo, hi):
    return {
        "batch_size": b,
        "context_len": ctx,
        "step_ms_median": med,
        "step_ms_min": lo,
        "step_ms_max": hi,
        "ratio": med / 0.5,
    }


def test_verdict_calls_only_separated_ranges(tmp_path, capsys):
    from benchmarks.roofline_table import compare, main

    base = tmp_path / "ab-qwen3-0.6b-def.json"
    other = tmp_path / "ab-qwen3-0.6b-tfs1.json"
    base.write_text(
        json.dumps(
            {
                "cells": [
                    _cell(8, 512, 1.372, 1.358, 1.393),
                    _cell(16, 512, 1.626, 1.60, 1.65),
                    _cell(32, 512, 1.960, 1.95, 1.97),
                    _cell(128, 4096, 20.0, 19.9, 20.1),
                    {"batch_size": 256, "context_len": 4096, "skipped": "KV cache needs 129.0 GiB"},
                ]
            }
        )
    )
    other.write_text(
        json.dumps(
            {
                "cells": [
                    _cell(8, 512, 1.300, 1.29, 1.31),  # apart, below: faster
                    _cell(16, 512, 1.610, 1.59, 1.63),  # overlapping: noise
                    _cell(32, 512, 2.000, 1.99, 2.01),  # apart, above: slower
                    _cell(64, 512, 3.0, 2.9, 3.1),
                ]
            }
        )
    )  # not in the baseline: no line
    lines = compare(str(base), [str(other)])
    assert lines == [
        "qwen3-0.6b-tfs1          b8    ctx512   1.372 -> 1.300 ms   -5.2 % faster",
        "qwen3-0.6b-tfs1          b16   ctx512   1.626 -> 1.610 ms   -1.0 % noise",
        "qwen3-0.6b-tfs1          b32   ctx512   1.960 -> 2.000 ms   +2.0 % slower",
    ]
    main(["--base", str(base), str(other)])
    assert capsys.readouterr().out.splitlines() == lines
