"""Model families and loaders. `load_model(spec)` -> (model, Tokenizer).

spec: a packaged model's name ("smollm2", the default, or "gemma3"; see packaged.py), a .gguf
file, or a Hugging Face checkpoint directory. Each family registers itself (models/family.py);
the imports below load every built-in family. Everything else finds a family by name through
the registry: `config_from_dict` and `build_model` here, the loaders by GGUF architecture or
config.json model_type.
"""
from __future__ import annotations

import os

from ..errors import DeepfuseError
from . import gemma3_family, llama_family, yoco  # noqa: F401  (each registers its family)
from .family import Family, families, family_by_name, family_for_gguf_arch, family_for_hf_model_type, register
from .gemma3 import Gemma3, Gemma3Config
from .llama import Llama, LlamaConfig, step_specs
from .packaged import NAMED, gemma3_gguf_path, smollm2_gguf_path
from .yoco import Yoco, YocoConfig

DEFAULT_MODEL = "smollm2"


def config_from_dict(d: dict):
    """A model config from its to_dict() (as artifacts store it); its `family` picks the class."""
    return family_by_name(d.get("family", "llama")).config.from_dict(d)


def build_model(config, weights):
    """The family's model class over `weights`."""
    return family_by_name(config.family).model(config, weights)


def resolve_model_path(spec: str) -> str:
    if spec in NAMED:
        return NAMED[spec]()
    if spec.endswith(".gguf") or os.path.isdir(spec):
        return spec
    raise DeepfuseError(f"unknown model {spec!r}: use {', '.join(map(repr, NAMED))}, a .gguf file "
                        "or a Hugging Face checkpoint directory")


def load_model(spec: str, with_tokenizer: bool = True):
    """Returns (the family's model with fp32 weights, Tokenizer or None)."""
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
    family = family_by_name(config.family)
    if tok is not None:
        tok.add_defaults(family.chat_template, family.eos_tokens)
    try:
        return family.model(config, weights), tok
    except ValueError as e:
        raise DeepfuseError(f"{path}: {e}") from None


__all__ = ["DEFAULT_MODEL", "Family", "Gemma3", "Gemma3Config", "Llama", "LlamaConfig", "Yoco", "YocoConfig",
           "build_model", "config_from_dict", "families", "family_by_name", "family_for_gguf_arch",
           "family_for_hf_model_type", "gemma3_gguf_path", "load_model", "register", "resolve_model_path",
           "smollm2_gguf_path", "step_specs"]
