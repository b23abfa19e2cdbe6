"""Placement groups for TP x PP layouts: rank assignment, stage spreading, bounded waits."""

import time

import pytest

from placement.placement_groups import (
    Layout,
    NodeView,
    PlacementError,
    assign_ranks,
    describe_shortfall,
    place_workers,
    stage_targets,
)


def test_layout_ranks():
    lay = Layout(4, 2)
    assert lay.world_size == 8
    assert [lay.stage_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.tp_rank_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert lay.stage_ranks(1) == [4, 5, 6, 7]
    with pytest.raises(ValueError):
        Layout(0, 1)


def test_ranks_are_stable_by_node():
    ips = {"nA": "10.0.0.12", "nB": "10.0.0.3", "nC": "10.0.0.7"}
    lay = Layout(2, 3)
    groups = [["nA", "nA"], ["nB", "nB"], ["nC", "nC"]]
    # driver on nC: its stage gets ranks 0-1, then the others by IP (10.0.0.3 < 10.0.0.12)
    slots = assign_ranks(groups, ips, "nC", lay)
    assert [(s.rank, s.stage, s.tp_rank, s.node_id) for s in slots] == [
        (0, 0, 0, "nC"),
        (1, 0, 1, "nC"),
        (2, 1, 0, "nB"),
        (3, 1, 1, "nB"),
        (4, 2, 0, "nA"),
        (5, 2, 1, "nA"),
    ]
    # the same landing in a different creation order gives the same ranks per node
    again = assign_ranks([groups[2], groups[0], groups[1]], ips, "nC", lay)
    assert [(s.rank, s.node_id, s.bundle_index) for s in again] == [(s.rank, s.node_id, s.bundle_index) for s in slots]
    # bundles keep index order inside a TP group
    assert [s.bundle_index for s in slots[:2]] == [0, 1]
    with pytest.raises(ValueError):
        assign_ranks(groups[:2], ips, None, lay)


def test_stages_are_hinted_onto_distinct_nodes():
    nodes = [NodeView("a", "10.0.0.1", 8, 8), NodeView("b", "10.0.0.2", 8, 8), NodeView("c", "10.0.0.3", 8, 2)]
    assert stage_targets(Layout(4, 2), nodes, "b") == ["b", "a"]  # driver's node first
    # c cannot hold a TP group of 4: no third distinct node, Ray chooses
    assert stage_targets(Layout(4, 3), nodes, "b") == ["b", "a", None]
    assert stage_targets(Layout(2, 1), nodes, None)[0] in ("a", "b")


def test_shortfall_messages():
    nodes = [NodeView("a", "10.0.0.1", 4, 4), NodeView("b", "10.0.0.2", 4, 1)]
    assert describe_shortfall(Layout(4, 1), "GPU", nodes) is None
    msg = describe_shortfall(Layout(8, 1), "GPU", nodes)
    assert "no node has 8 GPU" in msg and "must fit in one node" in msg and "10.0.0.2: 1 free of 4" in msg
    msg = describe_shortfall(Layout(4, 2), "GPU", nodes)
    assert "room for 1 of the 2 group(s)" in msg and "1 group(s) of 4 missing" in msg


def test_cpu_placement_in_ray(ray_local):
    p = place_workers(Layout(2, 1), "cpu", timeout_s=30)
    try:
        assert len(p.groups) == 1 and [s.rank for s in p.slots] == [0, 1]
        assert len({s.node_id for s in p.slots}) == 1  # STRICT_PACK: one node per TP group
        assert p.scheduling_strategy(1).placement_group_bundle_index == 1
    finally:
        p.remove()


def test_missing_resources_fail_within_the_bound(ray_local):
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as e:
        place_workers(Layout(64, 1), "cpu", timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert "not ready after 1 s" in msg and "no node has 64 CPU" in msg
    # the failed attempt left nothing reserved
    p = place_workers(Layout(2, 1), "cpu", timeout_s=30)
    p.remove()


def test_engine_reports_missing_resources(ray_local, ckpt_dir):
    from cluster import LLM

    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="tensor_parallel_size=32"):
        LLM(model=str(ckpt_dir("llama")), tensor_parallel_size=32, worker_start_timeout_s=1.0)
    assert time.monotonic() - t0 < 30
