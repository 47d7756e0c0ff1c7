"""The family registry: what each model family is and which checkpoints it reads.

A family module (models/llama_family.py, models/gemma3_family.py, models/yoco.py) calls
`register(Family(...))` once, at import; models/__init__.py imports every family module. The
loaders, the artifact loader, the compiler and the runtime find a family here by the name a
config or manifest carries (`config.family`), a GGUF's `general.architecture` or a Hugging Face
config's `model_type`, and import no family module themselves. This module owns the lookup
only: no model math, no file reading.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import DeepfuseError

Weights = dict[str, torch.Tensor]


class ModelConfig(Protocol):
    """What the runtime reads of any family's config (a frozen dataclass)."""

    family: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def to_dict(self) -> dict: ...

    def window_of(self, i: int) -> int: ...


class Model(Protocol):
    """What the compiler reads of any family's model: `step` is traced (models.llama.step_specs)."""

    config: ModelConfig
    weights: Weights

    def step(self, *inputs): ...


# (config, weights as read) -> (config, the model's weights): what a format's tensors need to become
# the model's, and what they tell of the config (Llama: learned attention sinks where present)
Adapt = Callable[[ModelConfig, Weights], tuple[ModelConfig, Weights]]


@dataclass(frozen=True)
class GGUFFormat:
    """How a family reads GGUF files of the given `general.architecture`s."""

    archs: tuple[str, ...]
    config: Callable[[object], ModelConfig]  # (gguf.GGUFReader) -> config
    layer_names: dict[str, str]  # llama.cpp's `blk.{i}.<key>.weight` key -> HF `model.layers.{i}.<value>.weight`
    weights: Adapt | None = None  # layout fix-ups after renaming (Llama: llama.cpp's Q/K row order)


@dataclass(frozen=True)
class HFFormat:
    """How a family reads Hugging Face directories of the given config.json `model_type`s."""

    model_types: tuple[str, ...]
    config: Callable[[dict], ModelConfig]  # (config.json as a dict) -> config
    weights: Adapt | None = None  # after loading: renames, stacking, offsets (Gemma's norms: 1 + w)


@dataclass(frozen=True)
class Family:
    name: str  # the `family` its configs and artifact manifests carry
    config: type  # config class: from_dict(d), to_dict()
    model: type  # model class: model(config, weights), .step(...)
    variants: tuple[str, ...] = ()  # other `family` names its configs carry (Llama's "mixtral", ...)
    gguf: GGUFFormat | None = None
    hf: HFFormat | None = None
    chat_template: str | None = None  # used where the checkpoint's tokenizer brings none
    eos_tokens: tuple[str, ...] = ()  # tokens that also end a generation (Gemma's <end_of_turn>)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.variants)


FAMILIES: dict[str, Family] = {}  # every name and variant -> its family


def register(family: Family) -> Family:
    """Adds `family`; a name, GGUF architecture or model_type another family claims is refused."""
    taken = [n for n in family.names if n in FAMILIES]
    taken += [a for a in (family.gguf.archs if family.gguf else ()) if a in gguf_archs()]
    taken += [t for t in (family.hf.model_types if family.hf else ()) if t in hf_model_types()]
    if taken:
        raise ValueError(f"family {family.name!r}: {taken[0]!r} is already registered")
    FAMILIES.update(dict.fromkeys(family.names, family))
    return family


def families() -> list[Family]:
    return list({id(f): f for f in FAMILIES.values()}.values())


def gguf_archs() -> dict[str, Family]:
    return {a: f for f in families() if f.gguf for a in f.gguf.archs}


def hf_model_types() -> dict[str, Family]:
    return {t: f for f in families() if f.hf for t in f.hf.model_types}


def family_by_name(name: str) -> Family:
    """The family of a config's or manifest's `family` name."""
    if name not in FAMILIES:
        raise DeepfuseError(f"model family {name!r} is unknown (known: {', '.join(sorted(FAMILIES))}); "
                            "it was built by another deepfuse or a plugin that is not loaded")
    return FAMILIES[name]


def family_for_gguf_arch(arch: str) -> Family:
    found = gguf_archs()
    if arch not in found:
        raise DeepfuseError(f"GGUF architecture {arch!r} is not supported yet (supported: {', '.join(sorted(found))})")
    return found[arch]


def family_for_hf_model_type(model_type: str) -> Family:
    found = hf_model_types()
    if model_type not in found:
        raise DeepfuseError(f"model_type {model_type!r} is not supported yet (supported: {', '.join(sorted(found))})")
    return found[model_type]
