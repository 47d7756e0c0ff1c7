"""The Gemma 3 family's registration and checkpoint readers: GGUF `gemma3` files and Hugging Face
`gemma3_text` directories (and the language model of a multimodal `gemma3` one) -> Gemma3Config
and the weights models/gemma3.py expects, every norm weight as its multiplier 1 + w.

GGUF files already hold 1 + w; Hugging Face checkpoints hold w (their RMSNorm computes 1 + w).
"""
from __future__ import annotations

from ..errors import DeepfuseError
from .family import Family, GGUFFormat, HFFormat, register
from .gemma3 import CHAT_TEMPLATE, END_OF_TURN, Gemma3, Gemma3Config
from .gguf_loader import field

# llama.cpp's per-layer tensor names -> Hugging Face's (its ffn_norm is the pre-feedforward norm)
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
SLIDING_WINDOW_PATTERN = 6  # every 6th layer attends to everything where a config does not list layer_types


def config_from_gguf(reader) -> Gemma3Config:
    """What the file does not say is what transformers assumes for Gemma 3 GGUFs: every 6th layer
    attends to everything, sliding layers use RoPE base 10000, and the attention scale is
    query_pre_attn_scalar**-0.5 with query_pre_attn_scalar = 256."""
    g = lambda key, default=None: field(reader, "gemma3." + key, default)
    n = int(g("block_count"))
    return Gemma3Config(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(g("embedding_length")),
        intermediate_size=int(g("feed_forward_length")), num_layers=n,
        num_heads=int(g("attention.head_count")), num_kv_heads=int(g("attention.head_count_kv")),
        head_dim=int(g("attention.key_length")), rope_theta=float(g("rope.freq_base", 1e6)), rope_local_theta=10000.0,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")), max_position=int(g("context_length")),
        query_pre_attn_scalar=256.0, sliding_window=int(g("attention.sliding_window")),
        full_attention_layers=tuple(i for i in range(n) if (i + 1) % SLIDING_WINDOW_PATTERN == 0),
        final_logit_softcap=float(g("final_logit_softcapping", 0.0) or 0.0),
        tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
    )


def text_config(cfg: dict) -> dict:
    """config.json's text model: itself (gemma3_text), or a multimodal gemma3's text_config with
    transformers' defaults for the fields it omits."""
    if cfg.get("model_type") != "gemma3":
        return cfg
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**cfg.get("text_config", {})).to_dict()


def rope_bases(cfg: dict) -> tuple[float, float]:
    """(full-attention, sliding) RoPE bases: rope_parameters by layer type, or rope_theta,
    rope_local_base_freq and rope_scaling (full-attention layers only) in older configs."""
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention") or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
    local = params.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    for layers, rope in (("full-attention", full), ("sliding", local)):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind != "default":
            raise DeepfuseError(f"rope scaling {kind!r} of the {layers} layers is not supported yet (only plain RoPE); "
                                "its rotary frequencies would be wrong at every position")
    return float(full["rope_theta"]), float(local["rope_theta"])


def full_attention_layers(cfg: dict) -> tuple[int, ...]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or SLIDING_WINDOW_PATTERN
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise DeepfuseError(f"layer_types {sorted(unknown)} are not supported yet")
    return tuple(i for i, t in enumerate(types) if t == "full_attention")


def config_from_hf(cfg: dict) -> Gemma3Config:
    c = text_config(cfg)
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    refusals = {f"hidden_activation {act!r} (the MLP is GELU-tanh gated)": act != "gelu_pytorch_tanh",
                "attn_logit_softcapping": bool(c.get("attn_logit_softcapping")),
                "attention_bias": bool(c.get("attention_bias")),
                "use_bidirectional_attention": bool(c.get("use_bidirectional_attention"))}
    for what, refused in refusals.items():
        if refused:
            raise DeepfuseError(f"Gemma 3 with {what} is not supported yet")
    rope_theta, rope_local_theta = rope_bases(c)
    return Gemma3Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"], rope_theta=rope_theta, rope_local_theta=rope_local_theta,
        rms_norm_eps=float(c["rms_norm_eps"]), max_position=c["max_position_embeddings"],
        query_pre_attn_scalar=float(c["query_pre_attn_scalar"]), sliding_window=int(c["sliding_window"]),
        full_attention_layers=full_attention_layers(c),
        final_logit_softcap=float(c.get("final_logit_softcapping") or 0.0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", c.get("tie_word_embeddings", True))),
    )


# a multimodal checkpoint's language model, as transformers 5 and 4 name it; its vision tower is dropped
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                           "language_model.lm_head.": "lm_head."}
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def adapt_hf_weights(config: Gemma3Config, weights: dict) -> tuple[Gemma3Config, dict]:
    """The language model's tensors under Gemma3ForCausalLM's names, norms as 1 + w; a tied head dropped."""
    out = {}
    for name, w in weights.items():
        if name.startswith(VISION_PREFIXES):
            continue
        for old, new in LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(old):
                name = new + name[len(old):]
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        out[name] = w + 1 if name.endswith("norm.weight") else w
    return config, out


FAMILY = register(Family(
    "gemma3", Gemma3Config, Gemma3,
    gguf=GGUFFormat(("gemma3",), config_from_gguf, GGUF_LAYER_NAMES),
    hf=HFFormat(("gemma3_text", "gemma3"), config_from_hf, adapt_hf_weights),
    chat_template=CHAT_TEMPLATE, eos_tokens=(END_OF_TURN,),
))
