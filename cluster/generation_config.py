"""A checkpoint's ``generation_config.json``: the EOS ids and the sampling defaults it names.

As in vLLM: the file beside the checkpoint (a GGUF file has none) names ``eos_token_id``
that become stop tokens of every request (``Request.extra_stop_ids``: ``stop_reason`` names
the token; ``ignore_eos`` ignores them) (the original Llama 3 Instruct's ``config.json`` names only
``<|end_of_text|>``; its turns end with ``<|eot_id|>``, which only the generation config
adds). With ``ModelConfig.generation_config`` 'auto' (default) its ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) also
become the defaults of what a request leaves out: a chat or gRPC field it omits (completions
keep 16 tokens, as in vLLM), ``LLM.generate`` / ``chat`` and the engine's ``add_request``
without sampling params. 'vllm': the engine's own sampling defaults (the EOS ids still
apply); a directory: the file there, for both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams, SamplingParamsError
from workers.models.arch import ModelLoadError
from workers.models.gguf_arch import is_gguf

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a generation config adds: stop tokens and per-request sampling defaults."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # the file read (None: none)

    def params(self, **given: Any) -> SamplingParams:
        """``SamplingParams`` of ``given`` (the fields a request set), the defaults filling the rest."""
        return SamplingParams(**{**self.sampling, **given})


NO_GENERATION_DEFAULTS = GenerationDefaults()  # (no file: the engine's own defaults)


def load_generation_defaults(cfg: EngineConfig, model_path: str) -> GenerationDefaults:
    """The defaults ``cfg.model.generation_config`` names for the checkpoint at ``model_path``."""
    choice = cfg.model.generation_config
    if choice in ("auto", "vllm"):
        if is_gguf(model_path):
            return GenerationDefaults()
        f = Path(model_path) / "generation_config.json"
        if not f.is_file():
            return GenerationDefaults()
    else:
        f = Path(choice) / "generation_config.json"
        if not f.is_file():
            raise ModelLoadError(
                f"generation_config {choice!r}: no generation_config.json there "
                "(expected 'auto', 'vllm' or a directory holding one)"
            )
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{f}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    eos = data.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
        raise ModelLoadError(f"{f}: eos_token_id must be a token id or a list of them, got {data['eos_token_id']!r}")
    sampling = {ours: data[key] for key, ours in SAMPLING_KEYS.items() if data.get(key) is not None}
    if choice == "vllm":  # (the stop tokens only)
        sampling = {}
    try:  # types (an int where a float goes is converted), then ranges: SamplingParams' own checks
        checked = msgspec.convert(sampling, SamplingParams)
    except (msgspec.ValidationError, SamplingParamsError) as exc:
        raise ModelLoadError(f"{f}: {exc}") from None
    sampling = {k: getattr(checked, k) for k in sampling}
    return GenerationDefaults(tuple(dict.fromkeys(eos)), sampling, str(f))
