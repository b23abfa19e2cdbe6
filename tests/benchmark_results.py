"""Checks shared by the benchmark tests: every result file carries the record fields."""

from __future__ import annotations

import json
from pathlib import Path


def load(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


def check_record(res: dict, benchmark: str) -> None:
    assert res["benchmark"] == benchmark
    assert res["hardware"]["cpu_model"] and res["hardware"]["cpu_count"] >= 1
    for v in ("python", "torch", "ray", "triton"):
        assert v in res["versions"]
    assert res["args"]


def check_serve_result(res: dict, n: int) -> None:
    check_record(res, "serve")
    assert res["completed"] == n and res["failed"] == 0, res["errors"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99", "std"):
            assert f"{stat}_{m}_ms" in res, (stat, m)
    assert res["mean_ttft_ms"] > 0 and res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    for k in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert res[k] > 0
