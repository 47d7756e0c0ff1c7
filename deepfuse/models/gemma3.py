"""Gemma 3 decoder (text), written once over frontend ops.

Differences from Llama: embeddings scaled by sqrt(hidden), four RMSNorms per layer (before and
after attention and the MLP), RMSNorm of each q and k head, a GELU-tanh gated MLP, sliding-window
layers with their own RoPE base between full-attention ones, attention scale
query_pre_attn_scalar**-0.5, optional final logit softcapping. Weight names follow Hugging Face,
but every norm weight is the multiplier itself: Gemma's RMSNorm multiplies by (1 + w), so a loader
stores 1 + w (GGUF files already hold it that way).
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import torch

from ..frontend import ops
from .cache_groups import layer_inputs

# Gemma's turn format (the GGUF we ship lacks a chat template): a BOS, then one turn per message
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
END_OF_TURN = "<end_of_turn>"


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float  # full-attention layers
    rope_local_theta: float  # sliding-window layers
    rms_norm_eps: float
    max_position: int
    query_pre_attn_scalar: float
    sliding_window: int
    full_attention_layers: tuple[int, ...]
    final_logit_softcap: float = 0.0  # 0: none
    tie_embeddings: bool = True
    family: str = "gemma3"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Gemma3Config:
        return cls(**{**d, "full_attention_layers": tuple(d["full_attention_layers"])})

    def window_of(self, i: int) -> int:
        """Layer i's attention window (0: full causal attention)."""
        return 0 if i in self.full_attention_layers else self.sliding_window


NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class Gemma3:
    """weights: HF-named tensors of one float dtype, norm weights as multipliers (1 + w)."""

    sliding_kv_from_embeddings = False  # models/yoco.py's variant sets it

    def __init__(self, config: Gemma3Config, weights: dict[str, torch.Tensor]):
        self.config, self.weights = config, weights
        names = set(self.weight_names())
        missing = sorted(n for n in names if n not in weights)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
        extra = sorted(n for n in weights if n not in names)
        if extra:
            raise ValueError(f"checkpoint has {len(extra)} weights Gemma 3 does not use, e.g. {extra[0]}")

    def weight_names(self, config: Gemma3Config | None = None) -> list[str]:
        c = config or self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if c.tie_embeddings else ["lm_head.weight"])
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            names += [p + s + ".weight" for s in (*NORMS, *PROJS, "self_attn.q_norm", "self_attn.k_norm")]
        return names

    def first_layers(self, n: int) -> Gemma3:
        """The first n layers with the final norm and head (a self-drafter)."""
        if not 1 <= n < self.config.num_layers:
            raise ValueError(f"a draft of the first {n} layers needs 1 <= n < {self.config.num_layers}")
        cfg = dataclasses.replace(self.config, num_layers=n,
                                  full_attention_layers=tuple(i for i in self.config.full_attention_layers if i < n))
        keep = set(self.weight_names(cfg))
        return type(self)(cfg, {k: v for k, v in self.weights.items() if k in keep})

    def step(self, tokens, positions, slot_mapping, block_tables, seq_lens, query_lens,
             sample_rows, temperature, top_k, top_p, seeds, draft_tokens, *rest):
        """Same inputs and outputs as Llama.step (see models.llama.step_specs)."""
        c, w = self.config, self.weights
        paged, kv_caches = layer_inputs(c, slot_mapping, block_tables, seq_lens, rest)
        norm = lambda x, name: ops.rms_norm(x, w[name + ".weight"], eps=c.rms_norm_eps)
        linear = lambda x, name: ops.linear(x, w[name + ".weight"])
        h = embedded = ops.mul(ops.embedding(w["model.embed_tokens.weight"], tokens), c.hidden_size ** 0.5)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            window = c.window_of(i)
            rope = dict(head_dim=c.head_dim, theta=c.rope_local_theta if window else c.rope_theta)
            x = norm(h, p + "input_layernorm")
            q = linear(x, p + "self_attn.q_proj")
            source = norm(embedded, p + "input_layernorm") if window and self.sliding_kv_from_embeddings else x
            k, v = linear(source, p + "self_attn.k_proj"), linear(source, p + "self_attn.v_proj")
            q = ops.head_rms_norm(q, w[p + "self_attn.q_norm.weight"], eps=c.rms_norm_eps, head_dim=c.head_dim)
            k = ops.head_rms_norm(k, w[p + "self_attn.k_norm.weight"], eps=c.rms_norm_eps, head_dim=c.head_dim)
            q, k = ops.rope(q, positions, **rope), ops.rope(k, positions, **rope)
            slots, tables, lens = paged[i]
            a = ops.attention(q, k, v, kv_caches[i], slots, tables, lens, query_lens,
                              num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                              scale=c.query_pre_attn_scalar ** -0.5, window=window)
            h = ops.add(h, norm(linear(a, p + "self_attn.o_proj"), p + "post_attention_layernorm"))
            x = norm(h, p + "pre_feedforward_layernorm")
            mlp = ops.mul(ops.gelu_tanh(linear(x, p + "mlp.gate_proj")), linear(x, p + "mlp.up_proj"))
            h = ops.add(h, norm(linear(mlp, p + "mlp.down_proj"), p + "post_feedforward_layernorm"))
        h = norm(h, "model.norm")
        head = w["model.embed_tokens.weight"] if c.tie_embeddings else w["lm_head.weight"]
        logits = ops.logits(h, head, sample_rows)
        if c.final_logit_softcap:
            logits = ops.softcap(logits, cap=c.final_logit_softcap)
        next_tokens = ops.spec_verify(ops.sample(logits, temperature, top_k, top_p, seeds), draft_tokens)
        return logits, next_tokens, ops.take_rows(h, sample_rows)
