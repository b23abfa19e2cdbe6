"""The decode benchmark at tensor-parallel size 2: two Ray actors over gloo on the CPU."""

import pytest

from benchmarks import decode_roofline, tp_scaling
from benchmarks.decode_tp import device_kind_for


def _run(tmp_path, tp: int) -> dict:
    out = tmp_path / f"tp{tp}.json"
    return decode_roofline.main(
        [
            "--shape",
            "tiny",
            "--batch-sizes",
            "1,2",
            "--context-lens",
            "16,64",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--bandwidth-mib",
            "16",
            "--cuda-graphs",
            "off",
            "--device",
            "cpu",
            "--placement",
            "ray",
            "--tensor-parallel-size",
            str(tp),
            "--output",
            str(out),
        ]
    )


def test_decode_benchmark_tp2_shards_per_rank(ray_local, tmp_path):
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    assert two["tensor_parallel_size"] == 2 and two["tp_rank"] == 0
    assert two["tp_all_reduce"] == "gloo" and one["tp_all_reduce"] == "none"
    assert two["placement"] == "2 Ray actors (1 CPU each), gloo"
    assert len(two["rank_bandwidth_bytes_per_s"]) == 2
    assert one["tensor_parallel_size"] == 1 and "rank_bandwidth_bytes_per_s" not in one
    cells1 = {(c["batch_size"], c["context_len"]): c for c in one["cells"]}
    cells2 = {(c["batch_size"], c["context_len"]): c for c in two["cells"]}
    assert set(cells1) == set(cells2) == {(1, 16), (2, 16), (1, 64), (2, 64)}
    for key, c2 in cells2.items():
        c1 = cells1[key]
        # each rank holds half the KV heads: half the KV bytes a step reads
        assert c2["kv_bytes"] * 2 == c1["kv_bytes"]
        # every matrix is sharded (norms are replicated, so a little over half)
        assert 0.5 * c1["weight_bytes"] < c2["weight_bytes"] < 0.6 * c1["weight_bytes"]
        assert len(c2["rank_step_ms_median"]) == 2 and all(t > 0 for t in c2["rank_step_ms_median"])
        assert c2["step_ms_median"] == c2["rank_step_ms_median"][0]
    assert two["engine_config"]["parallel"]["tensor_parallel_size"] == 2
    # the scaling table pairs TP=2 batch 2 with TP=1 batch 1 (the same per-GPU batch)
    rows = tp_scaling.decode_rows([one, two])
    assert {(r["context_len"], r["batch_size"], r["tp1_batch_size"]) for r in rows} == {(16, 2, 1), (64, 2, 1)}
    for r in rows:
        c1, c2 = cells1[(1, r["context_len"])], cells2[(2, r["context_len"])]
        assert r["efficiency"] == pytest.approx(c2["tokens_per_s"] / (2 * c1["tokens_per_s"]))
    lines = tp_scaling.report([str(tmp_path / "tp1.json"), str(tmp_path / "tp2.json")])
    assert any(line.strip().startswith("TP2 ctx16") and "(b1" in line for line in lines), lines


def _tput(tp, prompts, seqs, tok_s, engine_seqs=None):
    r = {
        "benchmark": "throughput",
        "output_tokens_per_second": tok_s,
        "args": {"tensor_parallel_size": None if tp == 1 else tp, "num_prompts": prompts, "max_num_seqs": seqs},
    }
    if engine_seqs is not None:  # what the engine ran with (its config: defaults applied)
        r["config"] = {"engine_config": {"scheduler": {"max_num_seqs": engine_seqs}}}
    return r


def test_tp_scaling_throughput_pairs_only_equal_per_gpu_load():
    rows = tp_scaling.throughput_rows(
        [_tput(1, 256, 256, 1000.0), _tput(2, 512, 512, 1500.0), _tput(4, 512, 512, 2000.0)]
    )
    by_tp = {r["tp"]: r for r in rows}
    assert by_tp[2]["efficiency"] == pytest.approx(1500 / 2000)
    assert "efficiency" not in by_tp[4] and "efficiency" not in by_tp[1]  # TP=4 ran 2x, not 4x, the load
    # neither run set --max-num-seqs: both ran the default 256, so TP=2's per-GPU load differs
    rows = tp_scaling.throughput_rows([_tput(1, 256, None, 1000.0, 256), _tput(2, 512, None, 1500.0, 256)])
    assert all("efficiency" not in r for r in rows)
    with pytest.raises(SystemExit, match="two results at TP=2"):
        tp_scaling.throughput_rows([_tput(2, 512, 512, 1.0), _tput(2, 512, 512, 2.0)])
    with pytest.raises(SystemExit, match="no TP=1"):
        tp_scaling.decode_rows([{"tensor_parallel_size": 2, "cells": []}])


def test_decode_tp_device_choice():
    assert device_kind_for({"device": "auto"}, 2, 2.0) == "cuda"
    assert device_kind_for({"device": "auto"}, 2, 1.0) == "cpu"
    assert device_kind_for({"device": "cpu"}, 2, 8.0) == "cpu"
    with pytest.raises(SystemExit, match="1 GPU"):
        device_kind_for({"device": "cuda"}, 2, 1.0)


def test_decode_tp_rejects_bad_sizes(tmp_path):
    with pytest.raises(SystemExit, match="must be >= 1"):
        decode_roofline.main(["--shape", "tiny", "--tensor-parallel-size", "0", "--output", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="drop --placement local"):
        decode_roofline.main(
            [
                "--shape",
                "tiny",
                "--tensor-parallel-size",
                "2",
                "--placement",
                "local",
                "--output",
                str(tmp_path / "x.json"),
            ]
        )
