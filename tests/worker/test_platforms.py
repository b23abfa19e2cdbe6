"""Platform adapters: each one's device-visibility environment, backend and attention choice."""

import pytest

from placement.platforms import (
    NVLS_OFF_ENV,
    CpuPlatform,
    CudaPlatform,
    DeviceVisibilityError,
    RocmPlatform,
    actor_env_vars,
    select_platform,
)

CUDA_OFF = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
HIP_OFF = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}


def test_cuda_sets_cuda_visible_devices_from_rays_assignment():
    d = CudaPlatform().decide_visibility(["3"], dict(CUDA_OFF))
    assert d.set == {"CUDA_VISIBLE_DEVICES": "3"} and d.unset == () and d.notes == ()
    # a node started with a wider CUDA_VISIBLE_DEVICES is narrowed, and the narrowing is reported
    d = CudaPlatform().decide_visibility(["3"], {**CUDA_OFF, "CUDA_VISIBLE_DEVICES": "2,3"})
    assert d.set == {"CUDA_VISIBLE_DEVICES": "3"}
    assert "narrowed from '2,3'" in d.notes[0]
    # ROCm variables do not enter the CUDA decision
    d = CudaPlatform().decide_visibility(["1"], {**CUDA_OFF, "HIP_VISIBLE_DEVICES": "0"})
    assert d.set == {"CUDA_VISIBLE_DEVICES": "1"} and d.unset == ()


def test_rocm_sets_hip_visible_devices_and_never_uses_cuda_visible_devices():
    base = RocmPlatform().decide_visibility(["2"], dict(HIP_OFF))
    assert base.set == {"HIP_VISIBLE_DEVICES": "2"}
    assert "CUDA_VISIBLE_DEVICES" not in base.set
    for cuda in ("0", "5,6", "", "GPU-1234"):
        d = RocmPlatform().decide_visibility(["2"], {**HIP_OFF, "CUDA_VISIBLE_DEVICES": cuda})
        assert d.set == base.set, f"CUDA_VISIBLE_DEVICES={cuda!r} changed the ROCm decision"
        # removed (HIP would honour it as a second filter) and reported, never copied
        assert d.unset == ("CUDA_VISIBLE_DEVICES",)
        assert any("CUDA_VISIBLE_DEVICES" in n and "removed" in n for n in d.notes)


def test_rocm_apply_changes_only_its_own_variables():
    env = {**HIP_OFF, "CUDA_VISIBLE_DEVICES": "7", "OTHER": "x"}
    RocmPlatform().configure(["1"], env)
    assert env == {**HIP_OFF, "HIP_VISIBLE_DEVICES": "1", "OTHER": "x"}


def test_cpu_sets_nothing():
    env = {"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "1"}
    d = CpuPlatform().configure([], env)
    assert d.set == {} and d.unset == ()
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "1"}
    assert CpuPlatform().runtime_env_vars() == {}


@pytest.mark.parametrize(
    "platform,env,words",
    [
        (CudaPlatform(), {**CUDA_OFF, "CUDA_VISIBLE_DEVICES": "0,1"}, ["CUDA_VISIBLE_DEVICES='0,1'", "GPU 3"]),
        (RocmPlatform(), {**HIP_OFF, "HIP_VISIBLE_DEVICES": "0"}, ["HIP_VISIBLE_DEVICES='0'", "GPU 3"]),
        (RocmPlatform(), {**HIP_OFF, "ROCR_VISIBLE_DEVICES": "0,1"}, ["ROCR_VISIBLE_DEVICES='0,1'", "unset"]),
        (CudaPlatform(), {}, ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "two parties"]),
        (
            RocmPlatform(),
            {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"},
            ["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"],
        ),
    ],
    ids=["cuda-excludes-assigned", "hip-excludes-assigned", "rocr-set", "cuda-ray-on", "hip-ray-on"],
)
def test_conflicting_inherited_variables_are_reported(platform, env, words):
    with pytest.raises(DeviceVisibilityError) as e:
        platform.decide_visibility(["3"], env)
    for w in words:
        assert w in str(e.value)


def test_gpu_without_an_assigned_device_is_an_error():
    with pytest.raises(DeviceVisibilityError, match="assigned no GPU"):
        CudaPlatform().decide_visibility([], dict(CUDA_OFF))


def test_backends_and_attention_per_platform():
    assert (CudaPlatform.collective_library, CudaPlatform.collective_backend) == ("NCCL", "nccl")
    assert (RocmPlatform.collective_library, RocmPlatform.collective_backend) == ("RCCL", "nccl")
    assert (CpuPlatform.collective_library, CpuPlatform.collective_backend) == ("gloo", "gloo")
    assert CudaPlatform.attention_backend == RocmPlatform.attention_backend == "triton"
    assert CpuPlatform.attention_backend == "torch-reference"


def test_selection_and_actor_env():
    assert isinstance(select_platform("cpu"), CpuPlatform)
    assert isinstance(select_platform("cuda", is_hip=False), CudaPlatform)
    assert isinstance(select_platform("cuda", is_hip=True), RocmPlatform)
    assert isinstance(select_platform("rocm"), RocmPlatform)
    with pytest.raises(ValueError, match="unknown device kind"):
        select_platform("tpu")
    gpu = actor_env_vars("cuda")
    # Ray's own visibility setting off for both GPU kinds; NVLink multicast off (mandatory)
    assert gpu["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert gpu["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"
    assert NVLS_OFF_ENV == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    assert all(gpu[k] == v for k, v in NVLS_OFF_ENV.items())
    assert "CUDA_VISIBLE_DEVICES" not in gpu and "HIP_VISIBLE_DEVICES" not in gpu
    assert actor_env_vars("cpu") == {}


def test_cpu_actor_in_ray_sets_no_visibility(ray_local):
    """A real CPU worker actor: adapter chosen in the actor, nothing set, gloo, reference attention."""
    import ray

    from workers.actor import WorkerActor

    import msgspec

    from metadata.config import EngineConfig

    a = (
        ray.remote(WorkerActor)
        .options(num_cpus=1)
        .remote(msgspec.msgpack.encode(EngineConfig()), "/nonexistent", 0, 1, 16, "cpu")
    )
    try:
        info = ray.get(a.describe.remote(), timeout=60)
    finally:
        ray.kill(a)
    assert info["platform"] == "cpu" and info["visibility"] == {} and info["collective"] == "gloo"
    assert info["attention"] == "torch-reference" and info["gpu_ids"] == []


def test_pdl_never_applies_off_gpu(monkeypatch):
    """Programmatic dependent launch is a Hopper feature: CPU tensors (and so the Triton
    interpreter) always get the plain launch, whatever the pdl option says."""
    import torch

    from kernels import pdl
    from kernels.settings import overridden

    for value in ("on", "off", "auto"):
        with overridden(pdl=value), pdl.step_tokens(1):
            assert pdl.launch_kwargs(torch.zeros(1)) == {"USE_PDL": False}
