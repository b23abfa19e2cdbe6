"""Ray placement groups for a tensor-parallel x pipeline-parallel layout.

One bundle per worker (``{GPU: 1}``, or ``{CPU: 1}`` on the CPU). Each pipeline
stage is one tensor-parallel group, placed as its own ``STRICT_PACK`` placement
group so the TP group always shares a node (its all-reduces stay on NVLink /
PCIe); stages are hinted onto distinct nodes when the cluster has room, so
pipeline stages spread across nodes. Ranks are ``stage * tp + tp_rank`` and are
assigned by node, stably: the driver's node first, then by node IP, bundles in
index order. Waiting for the groups is bounded; on timeout the groups are
removed and ``PlacementError`` says what is missing, node by node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested layout (the message says what is missing)."""


@dataclass(frozen=True)
class Layout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"invalid layout {self}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def stage_ranks(self, stage: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(stage * tp, (stage + 1) * tp))


@dataclass(frozen=True)
class NodeView:
    node_id: str
    ip: str
    total: float  # units of the bundle resource on the node
    free: float


@dataclass(frozen=True)
class WorkerSlot:
    rank: int
    stage: int
    tp_rank: int
    group_index: int  # which placement group (one per stage)
    bundle_index: int
    node_id: str
    node_ip: str


@dataclass
class Placement:
    layout: Layout
    resource: str
    groups: list = field(default_factory=list)
    slots: list[WorkerSlot] = field(default_factory=list)

    def scheduling_strategy(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s = self.slots[rank]
        return PlacementGroupSchedulingStrategy(
            placement_group=self.groups[s.group_index],
            placement_group_bundle_index=s.bundle_index,
            placement_group_capture_child_tasks=False,
        )

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            try:
                remove_placement_group(g)
            except Exception:  # already removed, or Ray is shutting down
                pass
        self.groups = []


def bundle_resource(device_kind: str) -> str:
    return "CPU" if device_kind == "cpu" else "GPU"


def _ip_key(ip: str):
    try:
        return (0, tuple(int(p) for p in ip.split(".")))
    except ValueError:
        return (1, ip)


def assign_ranks(
    group_nodes: list[list[str]], node_ips: dict[str, str], driver_node: str | None, layout: Layout
) -> list[WorkerSlot]:
    """Slots in rank order. ``group_nodes[g][b]`` is the node of bundle b of stage group g.

    Groups are ordered by their node (driver's node first, then by IP, then creation
    order); within a group, by bundle index. The result depends only on where the
    bundles landed, so it is stable across restarts onto the same nodes.
    """
    if len(group_nodes) != layout.pipeline_parallel_size:
        raise ValueError(f"expected {layout.pipeline_parallel_size} groups, got {len(group_nodes)}")

    def key(g: int):
        node = group_nodes[g][0]
        return (node != driver_node, _ip_key(node_ips.get(node, "")), g)

    slots = []
    for stage, g in enumerate(sorted(range(len(group_nodes)), key=key)):
        nodes = group_nodes[g]
        if len(nodes) != layout.tensor_parallel_size:
            raise ValueError(f"group {g} has {len(nodes)} bundles, expected {layout.tensor_parallel_size}")
        for b, node in enumerate(nodes):
            slots.append(
                WorkerSlot(stage * layout.tensor_parallel_size + b, stage, b, g, b, node, node_ips.get(node, "?"))
            )
    return slots


def stage_targets(layout: Layout, nodes: list[NodeView], driver_node: str | None) -> list[str | None]:
    """A soft node hint per stage: distinct nodes with room for a whole TP group, the
    driver's node first. Stages without such a node get no hint (Ray chooses)."""
    tp = layout.tensor_parallel_size
    room = sorted((n for n in nodes if n.free >= tp), key=lambda n: (n.node_id != driver_node, -n.free, _ip_key(n.ip)))
    hints: list[str | None] = [n.node_id for n in room[: layout.pipeline_parallel_size]]
    return hints + [None] * (layout.pipeline_parallel_size - len(hints))


def describe_shortfall(layout: Layout, resource: str, nodes: list[NodeView]) -> str | None:
    """Why ``nodes`` cannot hold ``layout`` now, or None when they can."""
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    per_node = ", ".join(f"{n.ip}: {n.free:g} free of {n.total:g}" for n in nodes) or "no alive nodes"
    need = (
        f"{layout.world_size} workers (tensor_parallel_size={tp} x pipeline_parallel_size={pp}) need "
        f"{pp} group(s) of {tp} {resource} on one node each"
    )
    biggest = max((n.total for n in nodes), default=0)
    if biggest < tp:
        return (
            f"{need}, but no node has {tp} {resource} (largest: {biggest:g}); a tensor-parallel group "
            f"must fit in one node: lower tensor_parallel_size or add larger nodes [{resource} per node: "
            f"{per_node}]"
        )
    fits = sum(int(n.free // tp) for n in nodes)
    if fits < pp:
        total_free = sum(n.free for n in nodes)
        return (
            f"{need}; the cluster has room for {fits} of the {pp} group(s) now ({total_free:g} {resource} "
            f"free in all, {pp - fits} group(s) of {tp} missing): free {resource}s held by other jobs, add "
            f"nodes (ray up ray_cluster.yaml) or lower the parallel sizes [{resource} per node: {per_node}]"
        )
    return None


def cluster_nodes(resource: str) -> list[NodeView]:
    import ray

    try:
        from ray._private import state

        free = state.available_resources_per_node()
    except Exception:  # a private API: without it, report totals as free
        free = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        nid = n["NodeID"]
        out.append(
            NodeView(
                nid,
                n.get("NodeManagerAddress", "?"),
                float(n["Resources"].get(resource, 0)),
                float(free.get(nid, {}).get(resource, 0)),
            )
        )
    return out


def place_workers(layout: Layout, device_kind: str, timeout_s: float, name: str = "syncless") -> Placement:
    """Reserve the bundles for ``layout``; waits at most ``timeout_s`` seconds."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    resource = bundle_resource(device_kind)
    nodes = cluster_nodes(resource)
    driver_node = ray.get_runtime_context().get_node_id()
    short = describe_shortfall(layout, resource, nodes)
    if short:
        logger.warning("placement will wait up to %.0f s for the cluster to grow: %s", timeout_s, short)
    hints = stage_targets(layout, nodes, driver_node)
    placement = Placement(layout, resource)
    for stage, hint in enumerate(hints):
        placement.groups.append(
            placement_group(
                [{resource: 1}] * layout.tensor_parallel_size,
                strategy="STRICT_PACK",
                name=f"{name}-stage{stage}-{time.monotonic_ns()}",
                _soft_target_node_id=hint,
            )
        )
    ready, _ = ray.wait([g.ready() for g in placement.groups], num_returns=len(placement.groups), timeout=timeout_s)
    if len(ready) < len(placement.groups):
        placement.remove()
        why = (
            describe_shortfall(layout, resource, cluster_nodes(resource))
            or short
            or ("the resources looked free but were not granted (taken by other jobs meanwhile?)")
        )
        raise PlacementError(
            f"placement groups not ready after {timeout_s:.0f} s (worker_start_timeout_s; "
            f"{len(ready)} of {len(placement.groups)} placed): {why}"
        )
    ips = {n.node_id: n.ip for n in cluster_nodes(resource)}
    group_nodes = []
    for g in placement.groups:
        by_bundle = placement_group_table(g)["bundles_to_node_id"]
        group_nodes.append([by_bundle[b] for b in sorted(by_bundle)])
    placement.slots = assign_ranks(group_nodes, ips, driver_node, layout)
    return placement
