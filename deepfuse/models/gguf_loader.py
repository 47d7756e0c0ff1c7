"""GGUF -> (config, HF-named fp32 weights), with the `gguf` package.

The file's `general.architecture` picks the family (models/family.py); the family's GGUFFormat
reads its config from the metadata and names its per-layer tensors. Every tensor is dequantized
and renamed to Hugging Face's names; the family's `weights` hook then fixes layouts (Llama undoes
llama.cpp's Q/K row permutation). A tensor the family has no place for is refused by name.
"""
from __future__ import annotations

import os
import re

import numpy as np
import torch
from tqdm import tqdm

from ..errors import DeepfuseError

# tensors outside the layers, the same in every family
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
IGNORED = (".attn_rot_embd",)  # old conversions' stored inverse rotary frequencies: RoPE's own, recomputed


def open_gguf(path: str):
    """A gguf.GGUFReader, or a DeepfuseError naming a missing, truncated or foreign file."""
    import gguf

    if not os.path.isfile(path):
        raise DeepfuseError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DeepfuseError(f"{path} is not a GGUF file (bad magic); pass a .gguf model file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises assorted errors on short files
        raise DeepfuseError(f"GGUF file {path} is truncated or corrupt ({type(e).__name__}: {e}); "
                            "download it again") from None


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_family(reader):
    """The registered family of the file's general.architecture."""
    from .family import family_for_gguf_arch

    return family_for_gguf_arch(field(reader, "general.architecture"))


def hf_name(name: str, layer_names: dict[str, str]) -> str | None:
    """The Hugging Face name of GGUF tensor `name`, or None where the family has no place for it."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = re.match(r"blk\.(\d+)\.(\w+)\.weight$", name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.weight"
    return None


def load_gguf(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    """Reads, dequantizes and renames every tensor. Returns (the family's config, fp32 weights)."""
    import gguf

    reader = open_gguf(path)
    family = gguf_family(reader)
    fmt = family.gguf
    config = fmt.config(reader)
    unknown = [t.name for t in reader.tensors if hf_name(t.name, fmt.layer_names) is None and not t.name.endswith(IGNORED)]
    if unknown:
        why = ("Llama 3.1-style rope scaling factors, which plain RoPE would ignore" if "rope_freqs.weight" in unknown
               else f"weights the {family.name} model has no place for (biases, experts, ...), which would be dropped")
        raise DeepfuseError(f"GGUF tensor {unknown[0]} in {path} ({len(unknown)} such tensors) holds {why}; "
                            "this model is not supported yet")
    weights: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="loading GGUF weights", unit="tensor", leave=False):
        name = hf_name(t.name, fmt.layer_names)
        if name is None:  # an IGNORED tensor: any other was refused above
            continue
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as e:
            raise DeepfuseError(f"GGUF tensor {t.name} in {path} cannot be read ({e}); the file is corrupt") from None
        weights[name] = torch.from_numpy(np.array(data, dtype=np.float32, order="C"))
    return fmt.weights(config, weights) if fmt.weights else (config, weights)
