"""Engine config validation and the per-step wire structs."""

from __future__ import annotations

import re
import typing

import msgspec
import pytest

from metadata import wire
from metadata.config import ALL_OPTIONS, REMOVED_OPTIONS, ConfigError, EngineConfig
from metadata.wire import (
    NewRequest,
    SampledRow,
    SamplingOptions,
    ScheduledRow,
    StepPlan,
    StepResult,
    StepStats,
    TokenLogprobs,
    decode_plan,
    decode_result,
    encode,
)


# ------------------------------------------------------------------------- config
def test_defaults_and_round_trip():
    cfg = EngineConfig.from_options()
    assert cfg.scheduler.async_scheduling is False and cfg.sync_check == "off"
    cfg = EngineConfig.from_options(
        model="/m",
        block_size=32,
        async_scheduling=True,
        sync_check="error",
        max_num_seqs=7,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.5,
    )
    assert (
        cfg.model.model,
        cfg.cache.block_size,
        cfg.scheduler.async_scheduling,
        cfg.sync_check,
        cfg.scheduler.max_num_seqs,
        cfg.parallel.tensor_parallel_size,
    ) == ("/m", 32, True, "error", 7, 2)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    # what the driver ships to each actor's constructor
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineConfig) == cfg


def test_every_option_is_a_flat_keyword():
    defaults = EngineConfig().to_dict()
    flat = {}
    for key, value in defaults.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    assert sorted(flat) == ALL_OPTIONS
    cfg = EngineConfig.from_options(**flat)
    assert cfg == EngineConfig()


@pytest.mark.parametrize("name", sorted(REMOVED_OPTIONS))
def test_removed_options_name_the_replacement(name):
    for build in (
        lambda: EngineConfig.from_options(**{name: 1}),
        lambda: EngineConfig.from_dict({name: 1}),
        lambda: EngineConfig.from_dict({"cache": {name: 1}}),
    ):
        with pytest.raises(ConfigError) as info:
            build()
        msg = str(info.value)
        assert f"'{name}' was removed" in msg and REMOVED_OPTIONS[name] in msg


def test_replacements_named_by_removed_options_exist():
    for name, why in REMOVED_OPTIONS.items():
        named = re.findall(r"use (\w+)", why)
        for n in named:
            if n not in ("device",):
                assert n in ALL_OPTIONS or n in ("AttentionMetadata",), (name, n)


@pytest.mark.parametrize(
    "bad,close",
    [
        ("block_sise", "block_size"),
        ("max_num_seq", "max_num_seqs"),
        ("asyncscheduling", "async_scheduling"),
        ("xyzzy", None),
    ],
)
def test_unknown_options(bad, close):
    for build in (
        lambda: EngineConfig.from_options(**{bad: 1}),
        lambda: EngineConfig.from_dict({"scheduler": {bad: 1}}),
    ):
        with pytest.raises(ConfigError, match=f"unknown option '{bad}'") as info:
            build()
        msg = str(info.value)
        if close:
            assert f"did you mean '{close}'" in msg or f"'{close}'" in msg.split("(valid")[0]
        assert "valid options:" in msg


@pytest.mark.parametrize(
    "kw",
    [
        dict(block_size="16"),
        dict(block_size=True),
        dict(block_size=1.0),
        dict(gpu_memory_utilization="0.9"),
        dict(async_scheduling="yes"),
        dict(async_scheduling=1),
        dict(sync_check="loud"),
        dict(sync_check=True),
        dict(dtype="fp8"),
        dict(device="tpu"),
        dict(model=5),
        dict(max_num_batched_tokens=1.5),
        dict(worker_start_timeout_s="x"),
        dict(num_kv_blocks="8"),
        dict(enforce_eager="no"),
        dict(seed=None),
    ],
    ids=lambda kw: f"{list(kw)[0]}={list(kw.values())[0]!r}",
)
def test_wrong_types_name_the_option(kw):
    name = list(kw)[0]
    with pytest.raises(ConfigError, match=f"option '{name}'"):
        EngineConfig.from_options(**kw)


def test_literal_options_list_the_choices():
    with pytest.raises(ConfigError, match="'off', 'warn', 'error'"):
        EngineConfig.from_options(sync_check="loud")


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=24), "block_size"),
        (dict(block_size=2048), "block_size"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(seed=-1), "seed"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
        (dict(worker_start_timeout_s=0.0), "worker_start_timeout_s"),
        (dict(enable_chunked_prefill=False, max_model_len=512, max_num_batched_tokens=128), "max_num_batched_tokens"),
    ],
    ids=lambda x: str(x),
)
def test_ranges_name_the_option(kw, name):
    with pytest.raises(ConfigError, match=name):
        EngineConfig.from_options(**kw)


def test_nested_sections_must_be_mappings():
    with pytest.raises(ConfigError, match="option 'cache'"):
        EngineConfig.from_dict({"cache": 5})


def test_llm_refuses_before_starting_anything():
    """Option errors come from the config, before Ray or the model are touched."""
    from cluster import LLM

    with pytest.raises(ConfigError, match="unknown option 'nonsense'"):
        LLM(model="/does/not/exist", nonsense=True)
    with pytest.raises(ConfigError, match="'tp' was removed: use tensor_parallel_size"):
        LLM(model="/does/not/exist", tp=2)


# ------------------------------------------------------------------ kernel options
def test_kernel_options_are_flat_validated_and_shipped_with_the_config(tmp_path):
    cfg = EngineConfig.from_options(
        pdl="off", pdl_max_tokens=4, tile_gemm=False, rope_in_attention=False, norm_handoff=False, cpu_threads=3
    )
    k = cfg.kernels
    assert (k.pdl, k.pdl_max_tokens, k.tile_gemm, k.rope_in_attention, k.norm_handoff, k.cpu_threads) == (
        "off",
        4,
        False,
        False,
        False,
        3,
    )
    # the actors get the config as msgpack bytes: the section travels with it
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineConfig).kernels == k
    assert EngineConfig().kernels == EngineConfig.from_options().kernels  # defaults: auto, on, on
    table = tmp_path / "t.json"
    table.write_text('{"entries": {}}')
    assert EngineConfig.from_options(skinny_tuning=str(table)).kernels.skinny_tuning == str(table)
    for kw, msg in (
        (dict(pdl="1"), "option 'pdl'.*allowed: 'auto', 'on', 'off'"),
        (dict(pdl_max_tokens=-1), "pdl_max_tokens"),
        (dict(cpu_threads=0), "cpu_threads"),
        (dict(tile_gemm_tuning=str(tmp_path / "no.json")), "tile_gemm_tuning=.*no.json"),
        (dict(tile_gemm=False, tile_gemm_tuning=str(table)), "tile_gemm is false"),
    ):
        with pytest.raises(ConfigError, match=msg):
            EngineConfig.from_options(**kw)


@pytest.mark.parametrize(
    "name,says",
    [
        ("SYNCLESS_PDL", "no longer read: set the engine option pdl"),
        ("SYNCLESS_TILE_GEMM_TUNING", "option tile_gemm_tuning"),
        ("SYNCLESS_CPU_THREADS", "option cpu_threads"),
        ("SYNCLESS_DECODE_LAYER", "removed with the one-launch decoder layer"),
        ("SYNCLESS_TP_ALLREDUCE", "removed with the symmetric-memory TP all-reduce"),
        ("SYNCLESS_ATTN_MERGE", "removed with the two-pass split merge"),
    ],
)
def test_a_former_kernel_switch_in_the_environment_fails_config_building(monkeypatch, name, says):
    monkeypatch.setenv(name, "1")
    with pytest.raises(ConfigError, match=f"{name} .*{says}"):
        EngineConfig.from_options()
    monkeypatch.delenv(name)
    monkeypatch.setenv("SYNCLESS_API_KEY", "k")  # not a kernel switch: still allowed
    EngineConfig.from_options()


def test_no_kernel_module_reads_a_syncless_variable():
    """The kernels follow the installed settings only (the config's one environment check
    is ``metadata.config.reject_kernel_env``)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readers = [
        str(p.relative_to(root))
        for pkg in ("kernels", "workers")
        for p in (root / pkg).rglob("*.py")
        if "SYNCLESS_" in p.read_text()
    ]
    assert readers == []


# --------------------------------------------------------------------------- wire
def _opts(**kw):
    base = dict(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.0,
        seed=(1 << 62) + 3,
        repetition_penalty=1.1,
        presence_penalty=0.0,
        frequency_penalty=-0.5,
        min_tokens=2,
        min_tokens_stop_ids=[1, 7],
        num_logprobs=3,
    )
    base.update(kw)
    return SamplingOptions(**base)


def _plan():
    return StepPlan(
        step_id=42,
        new_requests=[NewRequest.of(handle=3, prompt=[5, 6, 7], outputs=[9], sampling=_opts(), block_ids=[0, 4])],
        rows=[
            ScheduledRow(handle=3, num_scheduled_tokens=4, seq_len_upper_bound=4, new_block_ids=[], sample=True),
            ScheduledRow(handle=1, num_scheduled_tokens=1, seq_len_upper_bound=17, new_block_ids=[8], sample=True),
        ],
        finished_handles=[2],
        preempted_handles=[0],
    )


def test_plan_and_result_round_trip():
    plan = _plan()
    back = decode_plan(encode(plan))
    assert back == plan and type(back.rows[0]) is ScheduledRow
    assert type(back.new_requests[0].sampling) is SamplingOptions
    assert back.new_requests[0].sampling.seed == (1 << 62) + 3
    assert back.new_requests[0].token_ids() == ([5, 6, 7], [9])  # (int64 words on the wire)
    res = StepResult(
        step_id=42,
        outputs=[
            SampledRow(
                handle=3,
                token_ids=[11],
                logprobs=[
                    TokenLogprobs(
                        sampled_logprob=-0.25, sampled_rank=1, top_token_ids=[11, 4], top_logprobs=[-0.25, -2.0]
                    )
                ],
            )
        ],
        rank=0,
        stats=StepStats(worker_time_s=0.01),
    )
    back = decode_result(encode(res))
    assert back == res and type(back.outputs[0].logprobs[0]) is TokenLogprobs
    assert decode_plan(encode(StepPlan(step_id=1))) == StepPlan(step_id=1)


def _raw(obj):
    return msgspec.to_builtins(obj, builtin_types=(bytes,))  # (token ids stay bytes, as msgpack carries them)


def test_plan_rejects_unknown_fields():
    raw = _raw(_plan())
    raw["seq_lens_cpu"] = [4, 17]
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        decode_plan(msgspec.msgpack.encode(raw))
    raw = _raw(_plan())
    raw["rows"][0].append(99)  # an array-like struct with one element too many
    with pytest.raises(msgspec.ValidationError):
        decode_plan(msgspec.msgpack.encode(raw))
    raw = _raw(_plan())
    raw["new_requests"][0][3].append(0.5)  # SamplingOptions grew a field
    with pytest.raises(msgspec.ValidationError):
        decode_plan(msgspec.msgpack.encode(raw))
    res = _raw(StepResult(step_id=1))
    res["exact_seq_lens"] = [1]
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        decode_result(msgspec.msgpack.encode(res))


@pytest.mark.parametrize(
    "path,value",
    [
        (("step_id",), "1"),
        (("rows", 0, 1), 1.5),
        (("rows", 0, 4), 1),
        (("rows", 0, 3), [1.0]),
        (("new_requests", 0, 1), "567"),
        (("new_requests", 0, 3, 4), 1.5),
        (("finished_handles",), [None]),
        (("rows", 0), {"handle": 3}),
    ],
    ids=str,
)
def test_plan_rejects_wrong_types(path, value):
    raw = _raw(_plan())
    obj = raw
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value
    with pytest.raises(msgspec.ValidationError):
        decode_plan(msgspec.msgpack.encode(raw))


def test_rows_need_all_fields():
    raw = _raw(_plan())
    raw["rows"][0] = raw["rows"][0][:4]  # drops `sample`, the last field without a default
    with pytest.raises(msgspec.ValidationError):
        decode_plan(msgspec.msgpack.encode(raw))


def _struct_types(root) -> set[type]:
    seen: set[type] = set()

    def walk(t):
        for arg in typing.get_args(t):
            walk(arg)
        if isinstance(t, type) and issubclass(t, msgspec.Struct) and t not in seen:
            seen.add(t)
            for hint in typing.get_type_hints(t).values():
                walk(hint)

    walk(root)
    return seen


def test_plan_carries_no_exact_cpu_sequence_length():
    types = _struct_types(StepPlan)
    assert {StepPlan, NewRequest, ScheduledRow, SamplingOptions} <= types
    for t in types:
        for f in t.__struct_fields__:
            if re.search(r"seq_?len|num_computed|context_len|num_tokens$", f):
                assert f == "seq_len_upper_bound", f"{t.__name__}.{f} looks like an exact CPU sequence length"
    assert "seq_len_upper_bound" in ScheduledRow.__struct_fields__
    for t in _struct_types(StepResult):
        assert not any(re.search(r"seq_?len", f) for f in t.__struct_fields__)
    assert "exact CPU" in (wire.__doc__ or "")


def test_attention_metadata_has_no_cpu_seq_lens_field():
    import dataclasses

    from metadata.attention_metadata import AttentionMetadata

    names = {f.name for f in dataclasses.fields(AttentionMetadata)}
    assert {"seq_lens", "seq_lens_upper_bound"} <= names
    assert not {n for n in names if "seq_len" in n and "upper" not in n and n != "seq_lens"}
