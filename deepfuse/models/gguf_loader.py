"""GGUF -> (config, HF-named fp32 weights), with the `gguf` package. Architectures: llama, gemma3.

Dequantizes every tensor and, for llama, undoes llama.cpp's Q/K row permutation (its converter
interleaves the two rotary halves of each head; we use the rotate-half layout). Gemma 3 files are
not permuted and hold each norm weight as Gemma's multiplier 1 + w, which models.gemma3 expects.
"""
from __future__ import annotations

import os
import re

import numpy as np
import torch
from tqdm import tqdm

from ..errors import DeepfuseError
from .gemma3 import Gemma3Config
from .llama import LlamaConfig

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER = {  # llama.cpp names Gemma 3's pre-feedforward norm ffn_norm, Llama's post-attention one
    **_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
LAYER_NAMES = {"llama": _LAYER, "gemma3": _GEMMA3_LAYER}


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


def config_from_gguf(reader) -> LlamaConfig | Gemma3Config:
    arch = field(reader, "general.architecture")
    if arch == "gemma3":
        return gemma3_config_from_gguf(reader)
    if arch != "llama":
        raise DeepfuseError(f"GGUF architecture {arch!r} is not supported yet (supported: llama, gemma3)")
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


def gemma3_config_from_gguf(reader) -> Gemma3Config:
    """What the file does not say is what transformers assumes for Gemma 3 GGUFs: every 6th layer
    attends to everything, sliding layers use RoPE base 10000, and the attention scale is
    query_pre_attn_scalar**-0.5 with query_pre_attn_scalar = 256."""
    g = lambda key, default=None: field(reader, "gemma3." + key, default)
    n, pattern = int(g("block_count")), 6
    return Gemma3Config(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(g("embedding_length")),
        intermediate_size=int(g("feed_forward_length")), num_layers=n,
        num_heads=int(g("attention.head_count")), num_kv_heads=int(g("attention.head_count_kv")),
        head_dim=int(g("attention.key_length")), rope_theta=float(g("rope.freq_base", 1e6)), rope_local_theta=10000.0,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")), max_position=int(g("context_length")),
        query_pre_attn_scalar=256.0, sliding_window=int(g("attention.sliding_window")),
        full_attention_layers=tuple(i for i in range(n) if (i + 1) % pattern == 0),
        final_logit_softcap=float(g("final_logit_softcapping", 0.0) or 0.0),
        tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
    )


IGNORED = (".attn_rot_embd",)  # old conversions' stored inverse rotary frequencies: RoPE's own, recomputed


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute: interleaved rotary pairs -> rotate-half halves. w: [H*hd, K]."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str, family: str = "llama") -> str | None:
    if name in _NAMES:
        return _NAMES[name]
    layer = LAYER_NAMES[family]
    m = re.match(r"blk\.(\d+)\.(\w+)\.weight$", name)
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.weight"
    return None


def load_gguf(path: str) -> tuple[LlamaConfig | Gemma3Config, dict[str, torch.Tensor]]:
    """Reads, dequantizes and renames every tensor. Returns fp32 weights."""
    import gguf

    reader = open_gguf(path)
    config = config_from_gguf(reader)
    family = "gemma3" if config.family == "gemma3" else "llama"
    unknown = [t.name for t in reader.tensors if hf_name(t.name, family) is None and not t.name.endswith(IGNORED)]
    if unknown:
        why = ("Llama 3.1-style rope scaling factors, which plain RoPE would ignore" if "rope_freqs.weight" in unknown
               else f"weights the {family} model has no place for (biases, experts, ...), which would be dropped")
        raise DeepfuseError(f"GGUF tensor {unknown[0]} in {path} ({len(unknown)} such tensors) holds {why}; "
                            "this model is not supported yet")
    weights: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="loading GGUF weights", unit="tensor", leave=False):
        name = hf_name(t.name, family)
        if name is None:  # an IGNORED tensor: any other was refused above
            continue
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as e:
            raise DeepfuseError(f"GGUF tensor {t.name} in {path} cannot be read ({e}); the file is corrupt") from None
        if family == "llama" and name.endswith("q_proj.weight"):
            data = unpermute_rows(data, config.num_heads)
        elif family == "llama" and name.endswith("k_proj.weight"):
            data = unpermute_rows(data, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.array(data, dtype=np.float32, order="C"))
    return config, weights
