"""Hugging Face checkpoint directory (config.json + *.safetensors) -> (config, weights).

config.json's `model_type` picks the family (models/family.py); the family's HFFormat reads the
config and its `weights` hook maps the checkpoint's tensors to the model's names and layout.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from ..errors import DeepfuseError
from .family import family_for_hf_model_type


def read_hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise DeepfuseError(f"{path} has no config.json; pass a Hugging Face checkpoint directory")
    with open(cfg_path) as f:
        return json.load(f)


def config_from_hf(cfg: dict):
    """The family's config of a config.json dict."""
    return family_for_hf_model_type(cfg.get("model_type")).hf.config(cfg)


def load_hf_dir(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    cfg = read_hf_config(path)
    fmt = family_for_hf_model_type(cfg.get("model_type")).hf
    config = fmt.config(cfg)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise DeepfuseError(f"{path} has no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc="loading safetensors", leave=False):
        try:
            weights.update({k: v.float() for k, v in load_file(os.path.join(path, f)).items()})
        except Exception as e:
            raise DeepfuseError(f"cannot read {os.path.join(path, f)} ({e}); the file is corrupt") from None
    return fmt.weights(config, weights) if fmt.weights else (config, weights)
