"""Placement of worker actors: TP x PP placement groups, rank assignment, platform adapters."""

from placement.placement_groups import (
    Layout,
    Placement,
    PlacementError,
    WorkerSlot,
    assign_ranks,
    describe_shortfall,
    place_workers,
)
from placement.platforms import (
    NVLS_OFF_ENV,
    CpuPlatform,
    CudaPlatform,
    DeviceVisibilityError,
    Platform,
    RocmPlatform,
    VisibilityDecision,
    actor_env_vars,
    select_platform,
)

__all__ = [
    "Layout",
    "Placement",
    "PlacementError",
    "WorkerSlot",
    "assign_ranks",
    "describe_shortfall",
    "place_workers",
    "NVLS_OFF_ENV",
    "CpuPlatform",
    "CudaPlatform",
    "DeviceVisibilityError",
    "Platform",
    "RocmPlatform",
    "VisibilityDecision",
    "actor_env_vars",
    "select_platform",
]
