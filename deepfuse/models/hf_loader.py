"""Hugging Face checkpoint directory (config.json + *.safetensors) -> (LlamaConfig, weights)."""
from __future__ import annotations

import dataclasses
import json
import os

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from ..errors import DeepfuseError
from .llama import LlamaConfig

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3_moe", "mixtral")


def _family_fields(cfg: dict) -> dict:
    kind = cfg["model_type"]
    if kind == "qwen3_moe":
        step, only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)
        return dict(family=kind, qk_norm=True, num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                    experts_per_token=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["moe_intermediate_size"],
                    renormalize_topk=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
    if kind == "mixtral":
        return dict(family=kind, num_experts=cfg["num_local_experts"], experts_per_token=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], renormalize_topk=True)
    if kind == "qwen2":
        return dict(qkv_bias=True)
    bias = bool(cfg.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias)


def _refuse_what_the_model_cannot_run(cfg: dict) -> None:
    """Raises DeepfuseError for config fields that change the model's arithmetic in ways
    models/llama.py does not implement: loading them anyway would give wrong tokens silently."""
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if act not in ("silu", "swish"):
        raise DeepfuseError(f"hidden_act {act!r} is not supported yet (the MLP is SwiGLU: silu)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise DeepfuseError(f"rope scaling {kind!r} is not supported yet (only plain RoPE); "
                            "its rotary frequencies would be wrong at every position")
    if cfg.get("mlp_bias"):
        raise DeepfuseError("mlp_bias is not supported yet (the MLP projections have no bias)")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise DeepfuseError(f"partial_rotary_factor {cfg['partial_rotary_factor']} is not supported yet "
                            "(RoPE rotates the whole head)")


def attention_windows(cfg: dict) -> dict:
    """The LlamaConfig fields of the layers' attention windows: sliding_window (0: none) and
    full_attention_layers, the layers that attend to everything in a model whose others slide
    (Qwen2 below max_window_layers; `layer_types` where the config lists them)."""
    n, window = cfg["num_hidden_layers"], int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if types:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise DeepfuseError(f"layer_types {sorted(unknown)} are not supported yet")
        sliding = [t == "sliding_attention" for t in types]
    elif cfg["model_type"] in ("qwen2", "qwen3_moe"):  # Qwen: layers from max_window_layers on slide
        first = cfg.get("max_window_layers", n) if cfg.get("use_sliding_window") and window else n
        sliding = [i >= first for i in range(n)]
    else:
        sliding = [bool(window) and cfg.get("use_sliding_window", True) is not False] * n
    if not any(sliding):
        return {"sliding_window": 0}
    if not window:
        raise DeepfuseError("layer_types has sliding_attention layers but the config sets no sliding_window")
    return {"sliding_window": window, "full_attention_layers": tuple(i for i, s in enumerate(sliding) if not s)}


def config_from_hf(cfg: dict) -> LlamaConfig:
    if cfg.get("model_type") not in SUPPORTED:
        raise DeepfuseError(f"model_type {cfg.get('model_type')!r} is not supported yet (supported: {', '.join(SUPPORTED)})")
    _refuse_what_the_model_cannot_run(cfg)
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    return LlamaConfig(**_family_fields(cfg),
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **attention_windows(cfg),
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
    if any(k.endswith("self_attn.sinks") for k in weights):  # learned attention sinks (gpt-oss's layout)
        config = dataclasses.replace(config, attention_sinks=True)
    return config, normalize_expert_weights(config, weights)


def normalize_expert_weights(config: LlamaConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacks per-expert checkpoint tensors into the fused layout the model uses:
    mlp.experts.gate_up_proj [E,2I,D] and mlp.experts.down_proj [E,D,I]. Reads Qwen-style
    `mlp.experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`
    and `block_sparse_moe.gate`, or the fused tensors themselves."""
    if not config.num_experts:
        return weights
    out = dict(weights)
    for i in range(config.num_layers):
        if not config.is_moe_layer(i):
            continue
        p = f"model.layers.{i}."
        if p + "block_sparse_moe.gate.weight" in out:
            out[p + "mlp.gate.weight"] = out.pop(p + "block_sparse_moe.gate.weight")
        if p + "mlp.experts.gate_up_proj" in out:
            continue
        gate, up, down = [], [], []
        for e in range(config.num_experts):
            q, m = f"{p}mlp.experts.{e}.", f"{p}block_sparse_moe.experts.{e}."
            names = ([q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"] if q + "gate_proj.weight" in out
                     else [m + "w1.weight", m + "w3.weight", m + "w2.weight"])
            missing = [n for n in names if n not in out]
            if missing:
                raise DeepfuseError(f"checkpoint lacks expert weight {missing[0]}")
            g, u, d = (out.pop(n) for n in names)
            gate.append(g)
            up.append(u)
            down.append(d)
        out[p + "mlp.experts.gate_up_proj"] = torch.cat((torch.stack(gate), torch.stack(up)), dim=1)
        out[p + "mlp.experts.down_proj"] = torch.stack(down)
    return out
