"""The Llama family's registration and checkpoint readers: GGUF `llama` files and Hugging Face
llama, mistral, qwen2, qwen3_moe and mixtral directories -> LlamaConfig and HF-named weights.

Readers refuse what models/llama.py does not implement (other activations, rope scaling, MLP
biases, partial rotary): loading it anyway would give wrong tokens silently.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import DeepfuseError
from .family import Family, GGUFFormat, HFFormat, register
from .gguf_loader import field
from .llama import Llama, LlamaConfig

# llama.cpp's per-layer tensor names -> Hugging Face's
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def config_from_gguf(reader) -> LlamaConfig:
    scaling = field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "", "none"):
        raise DeepfuseError(f"GGUF rope scaling {scaling!r} (llama.rope.scaling.type) is not supported yet "
                            "(only plain RoPE); its rotary frequencies would be wrong at every position")
    heads = int(field(reader, "llama.attention.head_count"))
    hidden = int(field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(field(reader, "llama.feed_forward_length")),
        num_layers=int(field(reader, "llama.block_count")), num_heads=heads,
        num_kv_heads=int(field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(field(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position=int(field(reader, "llama.context_length")),
        tie_embeddings="output.weight" not in names,
    )


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: interleaved rotary pairs -> rotate-half halves. w: [H*hd, K]."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def unpermute_qk(config: LlamaConfig, weights: dict) -> tuple[LlamaConfig, dict]:
    """llama.cpp's converter interleaves the two rotary halves of each q and k head; we use rotate-half."""
    out = dict(weights)
    for name, w in weights.items():
        if name.endswith("q_proj.weight"):
            out[name] = unpermute_rows(w, config.num_heads)
        elif name.endswith("k_proj.weight"):
            out[name] = unpermute_rows(w, config.num_kv_heads)
    return config, out


def hf_family_fields(cfg: dict) -> dict:
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


def refuse_what_the_model_cannot_run(cfg: dict) -> None:
    """Raises DeepfuseError for config fields that change the model's arithmetic in ways
    models/llama.py does not implement."""
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
    refuse_what_the_model_cannot_run(cfg)
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    return LlamaConfig(**hf_family_fields(cfg),
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


def adapt_hf_weights(config: LlamaConfig, weights: dict) -> tuple[LlamaConfig, dict]:
    """Learned attention sinks where the checkpoint has them (gpt-oss's layout), and experts stacked."""
    if any(k.endswith("self_attn.sinks") for k in weights):
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


FAMILY = register(Family(
    "llama", LlamaConfig, Llama, variants=("qwen3_moe", "mixtral"),
    gguf=GGUFFormat(("llama",), config_from_gguf, GGUF_LAYER_NAMES, unpermute_qk),
    hf=HFFormat(("llama", "mistral", "qwen2", "qwen3_moe", "mixtral"), config_from_hf, adapt_hf_weights),
))
