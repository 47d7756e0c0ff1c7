"""Hugging Face checkpoint directory (config.json + *.safetensors) -> (LlamaConfig, weights)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from ..errors import DeepfuseError
from .llama import LlamaConfig

SUPPORTED = ("llama", "mistral", "qwen2")


def config_from_hf(cfg: dict) -> LlamaConfig:
    if cfg.get("model_type") not in SUPPORTED:
        raise DeepfuseError(f"model_type {cfg.get('model_type')!r} is not supported yet (supported: {', '.join(SUPPORTED)})")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    return LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=int(cfg.get("sliding_window") or 0) if cfg.get("use_sliding_window", True) else 0,
    )


def load_hf_dir(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise DeepfuseError(f"{path} has no config.json; pass a Hugging Face checkpoint directory")
    with open(cfg_path) as f:
        config = config_from_hf(json.load(f))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise DeepfuseError(f"{path} has no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc="loading safetensors", leave=False):
        try:
            weights.update({k: v.float() for k, v in load_file(os.path.join(path, f)).items()})
        except Exception as e:
            raise DeepfuseError(f"cannot read {os.path.join(path, f)} ({e}); the file is corrupt") from None
    return config, weights
