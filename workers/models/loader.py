"""Load a checkpoint into a model: a Hugging Face safetensors directory (sharded or not) or a
GGUF file (``workers.models.gguf_loader``), by the path's suffix."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from workers.distributed import TPGroup
from workers.models.arch import ModelArch, ModelLoadError, load_arch
from workers.models.gguf_arch import is_gguf
from workers.models.layers import MergedColumnLinear, fp8_layout, quantize_fp8
from workers.models.llama import LlamaForCausalLM
from workers.models.rope import cos_sin_cache
from workers.pipeline import WHOLE_MODEL, PipelineStage

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias|weight_scale|input_scale)$")
# FP8 checkpoints: a projection's static activation scale, an attention layer's KV-cache scales
_SCALAR_RE = re.compile(r"^(.*)\.(input_scale|k_scale|v_scale)$")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints load)")
    return files


def _shard(tensor: torch.Tensor, dim: int, rank: int, local: int) -> torch.Tensor:
    """This rank's slice along ``dim``; the last vocab shard is zero-padded."""
    start = rank * local
    avail = max(0, min(local, tensor.shape[dim] - start))
    part = tensor.narrow(dim, min(start, tensor.shape[dim]), avail)
    if avail < local:
        pad_shape = list(tensor.shape)
        pad_shape[dim] = local - avail
        part = torch.cat([part, tensor.new_zeros(pad_shape)], dim=dim)
    return part


def _expected_slots(model: torch.nn.Module, arch: ModelArch) -> set[tuple[str, int | None]]:
    """Every (parameter, fused part) the checkpoint must provide."""
    slots: set[tuple[str, int | None]] = set()
    fused = {n for n, m in model.named_modules() if isinstance(m, MergedColumnLinear)}
    for name, param in model.named_parameters(remove_duplicate=False):
        if arch.tie_word_embeddings and name == "lm_head.weight":
            continue
        owner = name.rsplit(".", 1)[0]
        if owner in fused:
            n_parts = len(dict(model.named_modules())[owner].parts)
            slots.update((name, i) for i in range(n_parts))
        else:
            slots.add((name, None))
    return slots


def load_model(
    model_path: str | Path,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "safetensors",
    stage: PipelineStage = WHOLE_MODEL,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, ModelArch]:
    """A checkpoint directory (safetensors) or a ``.gguf`` file, chosen by the path's suffix;
    ``load_format='dummy'`` takes only the shapes and initialises random weights.
    ``quantization='fp8'`` quantizes the decoder projections after loading, unless the
    checkpoint already stores them in FP8 (which loads as is, whatever ``quantization``)."""
    gguf = None
    if is_gguf(model_path) and load_format != "dummy":
        from workers.models.gguf_loader import GGUFCheckpoint

        gguf = GGUFCheckpoint(model_path)
        arch = gguf.arch
    else:
        arch = load_arch(model_path)
    # FP8 projections take their FP8 layout before loading: a stored FP8 checkpoint's tensors
    # load as they are, 16/32-bit ones are quantized one at a time as they arrive (the model
    # never holds them in 16 bits); dummy weights are quantized after their initialisation
    fp8_at_load = load_format != "dummy" and "fp8" in (quantization, arch.quantization)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, tp, dtype, max_positions, stage)
        if fp8_at_load:
            for proj in model.projections():
                fp8_layout(proj)
    model = model.to_empty(device=device)
    model.tie_embeddings()
    model.cos_sin = cos_sin_cache(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, torch.float32).to(
        device
    )
    if load_format == "dummy":
        _init_dummy(model)
    else:
        wanted = lambda n: _stage_reads(model, n)  # noqa: E731 - a stage reads only its own tensors
        if gguf is not None:
            tensors = split_fused(gguf.tensors(wanted), arch)
        else:
            tensors = split_fused(_safetensors_tensors(checkpoint_files(model_path), wanted), arch)
        _fill(model, arch, tensors, model_path)
    if quantization == "fp8" or arch.quantization == "fp8":
        if not fp8_at_load:  # dummy weights of either
            for proj in model.projections():
                quantize_fp8(proj)
        model.use_fp8()
    if load_format == "dummy":
        return model.eval(), arch
    factors = gguf.rope_factors() if gguf is not None else None
    if factors is not None:
        from workers.models.gguf_loader import cos_sin_with_factors

        model.cos_sin = cos_sin_with_factors(arch, max_positions, factors).to(device)
    model.eval()
    return model, arch


def _safetensors_tensors(files: list[Path], wanted=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint files, or those whose name ``wanted`` accepts (the
    others are never read from disk)."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if "rotary_emb.inv_freq" not in name and (wanted is None or wanted(name)):
                    yield name, f.get_tensor(name)


_STORED_FUSED = re.compile(r"^(.*)\.(qkv_proj|gate_up_proj)\.(weight|bias|weight_scale)$")


def split_fused(tensors: Iterable[tuple[str, torch.Tensor]], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` tensors as the q / k / v and gate / up parts
    other checkpoints store (the loader fuses those again, sharded); the rest as they come. A
    per-tensor scale (one value) goes to every part."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    for name, t in tensors:
        m = _STORED_FUSED.match(name)
        if m is None:
            yield name, t
            continue
        prefix, fused, kind = m.groups()
        if fused == "qkv_proj":
            parts, sizes = ("q_proj", "k_proj", "v_proj"), [q, kv, kv]
        else:
            parts, sizes = ("gate_proj", "up_proj"), [t.shape[0] // 2] * 2
        pieces = [t] * len(parts) if t.numel() == 1 else t.split(sizes, dim=0)
        for part, piece in zip(parts, pieces, strict=True):
            yield f"{prefix}.{part}.{kind}", piece


def _stage_reads(model: LlamaForCausalLM, ckpt_name: str) -> bool:
    """Whether ``_fill`` places this checkpoint tensor in ``model`` (a pipeline stage holds
    some layers only); scalar scales are always read (``_load_scalar`` places them)."""
    ckpt_name = _kv_scale_name(ckpt_name)
    if _SCALAR_RE.match(ckpt_name.removeprefix("model.")):
        return True
    return model.stage_param_name(_map_name(ckpt_name)[0]) is not None


def _fill(
    model: LlamaForCausalLM, arch: ModelArch, tensors: Iterable[tuple[str, torch.Tensor]], model_path: str | Path
) -> None:
    """Copy Hugging Face-named tensors into the (fused, sharded) parameters; every expected
    slot must be filled and no tensor may be left unplaced."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    pending = _expected_slots(model, arch)
    for ckpt_name, tensor in tensors:
        ckpt_name = _kv_scale_name(ckpt_name)
        if _SCALAR_RE.match(ckpt_name.removeprefix("model.")):
            _load_scalar(model, modules, ckpt_name, tensor, model_path)
            continue
        pname, index = _map_name(ckpt_name)
        pname = model.stage_param_name(pname)
        if pname is None:  # a layer (or the embedding, the head) another pipeline stage holds
            continue
        param = params.get(pname)
        if param is None:
            if pname == "lm_head.weight":  # tied checkpoints may still store it
                continue
            raise ModelLoadError(f"unexpected tensor '{ckpt_name}' in checkpoint {model_path}")
        owner_name = pname.rsplit(".", 1)[0]
        if param.dtype == torch.float8_e4m3fn and tensor.dtype != param.dtype and pname.endswith(".weight"):
            with torch.no_grad():  # a 16/32-bit projection weight into its FP8 layout
                _load_quantized(modules[owner_name], param, tensor.to(param.device), index, ckpt_name)
            pending.discard((pname, index))
            pending.discard((owner_name + ".weight_scale", index))
            continue
        tensor = tensor.to(param.dtype)
        with torch.no_grad():
            if index is not None:
                owner = modules[pname.rsplit(".", 1)[0]]
                owner.load_part(param, tensor, index)
            else:
                _load_plain(param, tensor, ckpt_name)
        pending.discard((pname, index))
    if pending:
        missing = sorted(n if i is None else f"{n}[part {i}]" for n, i in pending)
        raise ModelLoadError(f"{model_path}: checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _load_quantized(owner, param, tensor: torch.Tensor, index: int | None, ckpt_name: str) -> None:
    """Online FP8 quantization at load: this rank's rows of a 16/32-bit weight, quantized per
    row (``kernels.fp8_reference.quantize_weight_fp8``), placed with their scales as an FP8
    checkpoint's would be. A row-parallel weight is sharded along K first (its rows' scales
    are this rank's); a fused part's rows are whole rows (its scales need no sharding)."""
    from kernels.fp8_reference import quantize_weight_fp8

    if index is not None:
        wq, scale = quantize_weight_fp8(tensor)
        owner.load_part(param, wq, index)
        owner.load_part(owner.weight_scale, scale, index)
        return
    shard = getattr(param, "shard", None)
    if shard is not None:
        dim, rank, _ = shard
        tensor = _shard(tensor, dim, rank, param.shape[dim])
    if tuple(tensor.shape) != tuple(param.shape):
        raise ModelLoadError(f"tensor '{ckpt_name}' has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    wq, scale = quantize_weight_fp8(tensor)
    param.data.copy_(wq)
    owner.weight_scale.data.copy_(scale)


_KV_SCALE_ALIASES = [  # other writers' names of an attention layer's KV-cache scales
    (re.compile(r"^(.*\.self_attn)\.([kv])_proj\.([kv])_scale$"), r"\1.\3_scale"),  # ModelOpt / AutoFP8
    (re.compile(r"^(.*\.self_attn)\.([kv])_proj\.output_scale$"), r"\1.\2_scale"),  # older llm-compressor
]


def _kv_scale_name(name: str) -> str:
    """``self_attn.k_scale`` / ``v_scale`` for the layouts other tools write them in."""
    for pattern, repl in _KV_SCALE_ALIASES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def _load_scalar(model, modules: dict, ckpt_name: str, tensor: torch.Tensor, model_path) -> None:
    """An FP8 checkpoint's per-tensor scale: a projection's static ``input_scale`` (the fused
    q|k|v and gate|up take the largest of their parts', as the one they quantize with) or an
    attention layer's ``k_scale`` / ``v_scale`` for an FP8 KV cache."""
    name = ckpt_name.removeprefix("model.")
    m = _SCALAR_RE.match(name)
    owner_name, kind = m.group(1), m.group(2)
    if kind == "input_scale":
        fused = _FUSED_RE.match(name)
        owner_name = f"{fused.group(1)}.{_FUSED[fused.group(2)][0]}" if fused else owner_name
    owner_name = model.stage_param_name(owner_name + ".x")
    if owner_name is None:
        return  # another pipeline stage's layer
    owner = modules.get(owner_name[: -len(".x")])
    if owner is None or not hasattr(owner, kind):
        raise ModelLoadError(f"unexpected tensor '{ckpt_name}' in checkpoint {model_path}")
    if tensor.numel() != 1:
        raise ModelLoadError(f"'{ckpt_name}' has {tensor.numel()} values; only per-tensor scales are supported")
    value = tensor.detach().float().reshape(1).cpu()  # a checkpoint tensor: on the host already
    if kind == "input_scale":
        old = owner.input_scale
        value = value if old is None else torch.maximum(old.cpu(), value)
        owner.input_scale = value.to(owner.weight.device)
    else:
        setattr(owner, kind, float(value))


def _map_name(name: str) -> tuple[str, int | None]:
    name = name.removeprefix("model.")
    m = _FUSED_RE.match(name)
    if m:
        fused, index = _FUSED[m.group(2)]
        return f"{m.group(1)}.{fused}.{m.group(3)}", index
    return name, None


def _load_plain(param: torch.nn.Parameter, tensor: torch.Tensor, ckpt_name: str) -> None:
    shard = getattr(param, "shard", None)
    if shard is not None:
        dim, rank, _ = shard
        tensor = _shard(tensor, dim, rank, param.shape[dim])
    if ckpt_name.endswith("weight_scale"):  # per tensor ([] or [1]) or per row ([N, 1])
        tensor = tensor.reshape(-1).expand(param.shape[0]) if tensor.numel() == 1 else tensor.reshape(-1)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ModelLoadError(f"tensor '{ckpt_name}' has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def _init_dummy(model: torch.nn.Module) -> None:
    """Random weights of the right shapes, generated on the device (seeded)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.uniform_(-0.02, 0.02, generator=g)
