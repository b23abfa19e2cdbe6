"""FP8 checkpoints for tests, written from a tiny 16/32-bit one as llm-compressor lays them out:
each projection's ``weight`` in e4m3 with a ``weight_scale`` (per tensor ``[]`` or per output
row ``[N, 1]``), optionally a static ``input_scale`` and the attention layers' ``k_scale`` /
``v_scale``, and a compressed-tensors ``quantization_config`` in ``config.json``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJ = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
FP8_MAX = 448.0


def _quantize(w: torch.Tensor, strategy: str, tensor_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    if strategy == "tensor":
        scale = torch.tensor(tensor_scale if tensor_scale is not None else w.abs().max().item() / FP8_MAX)
    else:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def write_fp8_checkpoint(
    src: Path,
    out: Path,
    *,
    strategy: str = "channel",
    tensor_scale: float | dict[str, float] | None = None,
    input_scales: dict[str, float] | None = None,
    kv_scales: tuple[float, float] | None = None,
) -> Path:
    """``src`` with its projections in FP8. ``strategy``: 'channel' (a scale per output row)
    or 'tensor' (one scale, ``tensor_scale`` if given: one for all, or one per projection name
    ``{"q_proj": ...}``); ``input_scales``: a static activation
    scale per projection name (``"q_proj": 0.01``, ...); ``kv_scales``: every attention
    layer's (k_scale, v_scale)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    result = {}
    for name, t in tensors.items():
        m = PROJ.match(name)
        if m is None:
            result[name] = t
            continue
        ts = tensor_scale.get(m.group(2)) if isinstance(tensor_scale, dict) else tensor_scale
        q, scale = _quantize(t, strategy, ts)
        result[name] = q
        result[f"{m.group(1)}.{m.group(2)}.weight_scale"] = scale
        if input_scales and m.group(2) in input_scales:
            result[f"{m.group(1)}.{m.group(2)}.input_scale"] = torch.tensor([input_scales[m.group(2)]])
        if kv_scales and m.group(2) == "q_proj":
            result[f"{m.group(1)}.k_scale"] = torch.tensor(kv_scales[0])
            result[f"{m.group(1)}.v_scale"] = torch.tensor(kv_scales[1])
    save_file(result, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True},
                "input_activations": {"type": "float", "num_bits": 8, "dynamic": not input_scales},
            }
        },
        "ignore": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def write_dequantized_checkpoint(fp8_dir: Path, out: Path) -> Path:
    """An FP8 checkpoint's weights dequantized (``weight * weight_scale``) into a plain float32
    checkpoint: quantizing it per row at load gives back the same e4m3 values."""
    out.mkdir(parents=True, exist_ok=True)
    for f in fp8_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    t = load_file(str(fp8_dir / "model.safetensors"))
    result = {}
    for name, v in t.items():
        if name.endswith(("weight_scale", "input_scale", "k_scale", "v_scale")):
            continue
        if v.dtype == torch.float8_e4m3fn:
            scale = t[name + "_scale"].float()
            v = v.float() * (scale if scale.dim() else scale.reshape(1, 1))
        result[name] = v.float().contiguous()
    save_file(result, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out
