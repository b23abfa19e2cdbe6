"""Platform adapters, one per device kind (CUDA, ROCm, CPU), chosen inside each worker actor.

An adapter decides three things for its actor:

- **device visibility**, set explicitly before torch touches the device:
  ``CUDA_VISIBLE_DEVICES`` on NVIDIA, ``HIP_VISIBLE_DEVICES`` on ROCm, nothing on
  the CPU. The devices come from Ray's assignment to the actor (its ``{GPU: 1}``
  bundle), never from another vendor's variable: on ROCm,
  ``CUDA_VISIBLE_DEVICES`` is not copied, not read for the decision, and removed
  from the actor (HIP would otherwise apply it as a second filter). Ray's own
  visibility setting is switched off for GPU actors
  (``RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES=1`` in their runtime env), so
  exactly one party decides. Inherited variables that contradict the assignment
  raise ``DeviceVisibilityError`` naming the variable and the fix;
- the **collective backend** for ``torch.distributed`` (NCCL, RCCL, gloo);
- the **attention implementation** (Triton kernels on GPUs, the torch reference on the CPU).

``decide_visibility`` is a pure function of (assigned ids, inherited environment),
so every rule is unit-tested without a device.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping, Sequence

# Mandatory in every GPU actor on the shared GPU machines: NVLink multicast / NVLS off.
NVLS_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class DeviceVisibilityError(RuntimeError):
    """The actor's inherited environment contradicts the devices Ray assigned to it."""


@dataclass(frozen=True)
class VisibilityDecision:
    """What the adapter does to the actor's environment (``set``/``unset``) and why (``notes``)."""

    set: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def apply(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        for name in self.unset:
            env.pop(name, None)
        env.update(self.set)


def _ids(assigned: Sequence[str | int]) -> list[str]:
    return [str(i).strip() for i in assigned if str(i).strip()]


def _listed(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


class Platform:
    """Base adapter. Subclasses fill in the class attributes and the visibility rules."""

    name = "base"
    torch_device_type = "cpu"
    ray_resource: str | None = None  # the Ray resource one worker's bundle holds one unit of
    visibility_var: str | None = None
    ray_noset_var: str | None = None
    collective_backend = "gloo"  # torch.distributed backend name
    collective_library = "gloo"
    attention_backend = "torch-reference"

    def runtime_env_vars(self) -> dict[str, str]:
        """Environment the actor must be *created* with (Ray's runtime_env ``env_vars``)."""
        return {}

    def decide_visibility(self, assigned: Sequence[str | int], inherited: Mapping[str, str]) -> VisibilityDecision:
        return VisibilityDecision()

    def configure(
        self, assigned: Sequence[str | int], environ: MutableMapping[str, str] | None = None
    ) -> VisibilityDecision:
        """Decide and apply visibility in this process; must run before torch initialises the device."""
        env = os.environ if environ is None else environ
        torch = sys.modules.get("torch")
        if self.visibility_var and torch is not None and torch.cuda.is_initialized():
            raise DeviceVisibilityError(
                f"the device was initialised before the {self.name} adapter set {self.visibility_var}; "
                "configure the platform first thing in the actor"
            )
        decision = self.decide_visibility(assigned, env)
        decision.apply(env)
        return decision

    def torch_device(self):
        import torch

        return torch.device(self.torch_device_type, 0) if self.torch_device_type != "cpu" else torch.device("cpu")

    def describe(self) -> dict[str, str | None]:
        return {
            "platform": self.name,
            "collective": self.collective_library,
            "attention": self.attention_backend,
            "visibility_var": self.visibility_var,
        }

    # ------------------------------------------------------------ helpers
    def _require_ray_off(self, inherited: Mapping[str, str]) -> None:
        if inherited.get(self.ray_noset_var, "") not in ("1", "true", "True"):
            raise DeviceVisibilityError(
                f"Ray's own device-visibility setting is on for this {self.name} actor "
                f"({self.ray_noset_var} is not 1), so two parties would set {self.visibility_var}; "
                "create worker actors with runtime_env env_vars from placement.actor_env_vars()"
            )

    def _gpu_decision(self, assigned, inherited) -> tuple[str, list[str]]:
        self._require_ray_off(inherited)
        ids = _ids(assigned)
        if not ids:
            raise DeviceVisibilityError(
                f"Ray assigned no GPU to this {self.name} actor; it must be created with num_gpus=1 "
                "inside a {GPU: 1} placement-group bundle"
            )
        var, joined, notes = self.visibility_var, ",".join(ids), []
        prev = inherited.get(var)
        if prev is not None and prev != joined:
            missing = [i for i in ids if i not in _listed(prev)]
            if missing:
                raise DeviceVisibilityError(
                    f"{var}={prev!r} inherited by this actor does not contain GPU {','.join(missing)} that Ray "
                    f"assigned to it: the environment that started the Ray node disagrees with Ray's view of "
                    f"the node; restart the node (ray start) with {var} unset or consistent with its GPUs, "
                    "or drop it from the runtime env"
                )
            notes.append(f"{var} narrowed from {prev!r} to {joined!r} (Ray's assignment)")
        return joined, notes


class CudaPlatform(Platform):
    name = "cuda"
    torch_device_type = "cuda"
    ray_resource = "GPU"
    visibility_var = "CUDA_VISIBLE_DEVICES"
    ray_noset_var = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
    collective_backend = "nccl"
    collective_library = "NCCL"
    attention_backend = "triton"

    def runtime_env_vars(self) -> dict[str, str]:
        return {self.ray_noset_var: "1", **NVLS_OFF_ENV}

    def decide_visibility(self, assigned, inherited) -> VisibilityDecision:
        joined, notes = self._gpu_decision(assigned, inherited)
        return VisibilityDecision(set={self.visibility_var: joined}, notes=tuple(notes))


class RocmPlatform(Platform):
    name = "rocm"
    torch_device_type = "cuda"  # torch's HIP build keeps the "cuda" device type
    ray_resource = "GPU"
    visibility_var = "HIP_VISIBLE_DEVICES"
    ray_noset_var = "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"
    collective_backend = "nccl"  # torch's name for RCCL on ROCm builds
    collective_library = "RCCL"
    attention_backend = "triton"

    def runtime_env_vars(self) -> dict[str, str]:
        return {self.ray_noset_var: "1", **NVLS_OFF_ENV}

    def decide_visibility(self, assigned, inherited) -> VisibilityDecision:
        rocr = inherited.get("ROCR_VISIBLE_DEVICES")
        if rocr is not None:
            raise DeviceVisibilityError(
                f"ROCR_VISIBLE_DEVICES={rocr!r} is inherited by this ROCm actor: it filters devices below HIP, "
                "so HIP_VISIBLE_DEVICES (set here from Ray's assignment) would index a renumbered subset; "
                "unset ROCR_VISIBLE_DEVICES where the Ray node starts"
            )
        # CUDA_VISIBLE_DEVICES is deliberately not consulted: the decision comes from Ray only.
        joined, notes = self._gpu_decision(assigned, inherited)
        unset: tuple[str, ...] = ()
        cuda = inherited.get("CUDA_VISIBLE_DEVICES")
        if cuda is not None:
            unset = ("CUDA_VISIBLE_DEVICES",)
            notes.append(
                f"CUDA_VISIBLE_DEVICES={cuda!r} ignored and removed: HIP would apply it as a second "
                "filter; ROCm visibility is HIP_VISIBLE_DEVICES only"
            )
        return VisibilityDecision(set={self.visibility_var: joined}, unset=unset, notes=tuple(notes))


class CpuPlatform(Platform):
    name = "cpu"


PLATFORMS: dict[str, type[Platform]] = {"cuda": CudaPlatform, "rocm": RocmPlatform, "cpu": CpuPlatform}


def _torch_is_hip() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return getattr(torch.version, "hip", None) is not None


def select_platform(device_kind: str, is_hip: bool | None = None) -> Platform:
    """The adapter for this actor. ``device_kind`` is the engine's ("cpu" | "cuda" | "rocm");
    a "cuda" kind on a ROCm build of torch gets the ROCm adapter (importing torch does
    not initialise any device)."""
    if device_kind not in PLATFORMS:
        raise ValueError(f"unknown device kind {device_kind!r}; expected one of {', '.join(PLATFORMS)}")
    if device_kind == "cuda" and (_torch_is_hip() if is_hip is None else is_hip):
        device_kind = "rocm"
    return PLATFORMS[device_kind]()


def actor_env_vars(device_kind: str) -> dict[str, str]:
    """runtime_env ``env_vars`` for a worker actor of ``device_kind``, decided on the driver.

    The driver cannot tell NVIDIA from AMD nodes, so a GPU actor gets both adapters'
    variables; the adapter chosen inside the actor then sets visibility itself.
    """
    if device_kind == "cpu":
        return {}
    return {**CudaPlatform().runtime_env_vars(), **RocmPlatform().runtime_env_vars()}
