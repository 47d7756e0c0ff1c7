"""Model families and loaders. `load_model(spec)` -> (model, Tokenizer).

spec: a packaged model's name ("smollm2", the default, or "gemma3"; see packaged.py), a .gguf
file, or a Hugging Face checkpoint directory. FAMILIES maps a config's `family` to its config
class and model class; every family not listed there is Llama's (Llama, Qwen, Mixtral, ...).
"""
from __future__ import annotations

import os

from ..errors import DeepfuseError
from .gemma3 import Gemma3, Gemma3Config
from .llama import Llama, LlamaConfig, step_specs
from .yoco import Yoco, YocoConfig
from .packaged import NAMED, gemma3_gguf_path, smollm2_gguf_path

DEFAULT_MODEL = "smollm2"
FAMILIES = {"gemma3": (Gemma3Config, Gemma3), "yoco_swa": (YocoConfig, Yoco)}


def family_of(name: str) -> tuple[type, type]:
    """(config class, model class) of a config's `family`."""
    return FAMILIES.get(name, (LlamaConfig, Llama))


def config_from_dict(d: dict):
    """A model config from its to_dict() (as artifacts store it)."""
    return family_of(d.get("family", "llama"))[0].from_dict(d)


def build_model(config, weights):
    """The family's model class over `weights`."""
    return family_of(config.family)[1](config, weights)


def resolve_model_path(spec: str) -> str:
    if spec in NAMED:
        return NAMED[spec]()
    if spec.endswith(".gguf") or os.path.isdir(spec):
        return spec
    raise DeepfuseError(f"unknown model {spec!r}: use {', '.join(map(repr, NAMED))}, a .gguf file "
                        "or a Hugging Face checkpoint directory")


def load_model(spec: str, with_tokenizer: bool = True):
    """Returns (Llama or Gemma3 with fp32 weights, Tokenizer or None)."""
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
        return build_model(config, weights), tok
    except ValueError as e:
        raise DeepfuseError(f"{path}: {e}") from None


__all__ = ["DEFAULT_MODEL", "FAMILIES", "Gemma3", "Gemma3Config", "Llama", "LlamaConfig", "build_model",
           "config_from_dict", "family_of", "gemma3_gguf_path", "load_model", "resolve_model_path",
           "smollm2_gguf_path", "step_specs"]
