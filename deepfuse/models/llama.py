"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen3-MoE, Mixtral), written once over frontend ops.

`Llama(config, weights).step(...)` runs eagerly on torch tensors and records IR under
`deepfuse.trace`. Weight names follow Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`).
This file owns the model's math only: no loading, no timing, no cache management.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..errors import DeepfuseError
from ..frontend import Spec, ops
from ..ir.opdefs_llm import kv_row_size
from .cache_groups import cache_groups, layer_inputs


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    sliding_window: int = 0  # 0: full causal attention
    family: str = "llama"
    qk_norm: bool = False  # Qwen3: RMSNorm of each q and k head before RoPE
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    o_bias: bool = False  # Llama with attention_bias: a bias on o_proj too
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head (self_attn.sinks [H])
    num_experts: int = 0  # 0: dense SwiGLU MLP in every layer
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    renormalize_topk: bool = False  # divide the top-k routing weights by their sum
    dense_layers: tuple[int, ...] = ()  # layers that keep the dense MLP in a MoE model
    full_attention_layers: tuple[int, ...] = ()  # with a sliding window: layers that attend to everything

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> LlamaConfig:
        return LlamaConfig(**{**d, "dense_layers": tuple(d.get("dense_layers", ())),
                              "full_attention_layers": tuple(d.get("full_attention_layers", ()))})

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers

    def window_of(self, i: int) -> int:
        """Layer i's attention window (0: full causal attention)."""
        return 0 if i in self.full_attention_layers else self.sliding_window



KV_CACHE_DTYPES = ("int8",)  # besides the model's own float dtype (None)


def step_specs(config: LlamaConfig, dtype: str, kv_cache_dtype: str | None = None) -> list[Spec]:
    """Inputs of one engine step. T tokens, S sequences, B blocks per table, N blocks of BS slots
    (NW in a hybrid model's sliding layers, whose group has its own slot_mapping, block_tables and
    seq_lens: models/cache_groups.py),
    R sampled rows (sample_rows: indices into the T tokens, strictly increasing) with their
    sampling parameters and the draft each row verifies (draft_tokens; -1: none).
    kv_cache_dtype None: the caches hold `dtype`; "int8": int8 rows with a scale each
    (ir.opdefs_llm.quantize_kv_rows), [2,N,BS,Hkv,hd+4]."""
    if kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
        raise DeepfuseError(f"unsupported kv_cache_dtype {kv_cache_dtype!r} (use None or one of {KV_CACHE_DTYPES})")
    cache_dtype = "i8" if kv_cache_dtype == "int8" else dtype
    seq = [Spec(n, "i64", ("S",)) for n in ("seq_lens", "query_lens")]
    sampling = [Spec("sample_rows", "i64", ("R",)), Spec("temperature", "f32", ("R",)), Spec("top_k", "i64", ("R",)),
                Spec("top_p", "f32", ("R",)), Spec("seeds", "i64", ("R",)), Spec("draft_tokens", "i64", ("R",))]
    groups = cache_groups(config)
    blocks_dim = {i: g.blocks_dim for g in groups for i in g.layers}
    row = kv_row_size(config.head_dim, cache_dtype)
    caches = [Spec(f"kv_cache.{i}", cache_dtype, (2, blocks_dim[i], "BS", config.num_kv_heads, row))
              for i in range(config.num_layers)]
    more = [Spec(name + g.suffix, "i64", shape) for g in groups[1:]
            for name, shape in (("slot_mapping", ("T",)), ("block_tables", ("S", "B")), ("seq_lens", ("S",)))]
    return [Spec("tokens", "i64", ("T",)), Spec("positions", "i64", ("T",)),
            Spec("slot_mapping", "i64", ("T",)), Spec("block_tables", "i64", ("S", "B")),
            *seq, *sampling, *more, *caches]


# checkpoint tensors the model may ignore: RoPE's inverse frequencies (recomputed), and a tied
# head saved beside the embedding it equals
UNUSED_BY_DESIGN = ("rotary_emb.inv_freq", "lm_head.weight")


class Llama:
    """weights: HF-named tensors, all of one float dtype."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor]):
        self.config, self.weights = config, weights
        names = set(self.weight_names())
        missing = [n for n in names if n not in weights]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[0]}")
        extra = sorted(n for n in weights if n not in names and not n.endswith(UNUSED_BY_DESIGN))
        if extra:  # a part of the model this definition lacks: running without it would be wrong
            raise ValueError(f"checkpoint has {len(extra)} weights this model does not use, e.g. {extra[0]}; "
                             "its architecture is not supported yet")

    def first_layers(self, n: int) -> Llama:
        """The first n decoder layers with the model's final norm and head: a self-drafter for
        speculative decoding (same tokenizer and vocabulary, a fraction of the cost)."""
        import dataclasses

        if not 1 <= n < self.config.num_layers:
            raise ValueError(f"a draft of the first {n} layers needs 1 <= n < {self.config.num_layers}")
        cfg = dataclasses.replace(self.config, num_layers=n,
                                  dense_layers=tuple(i for i in self.config.dense_layers if i < n),
                                  full_attention_layers=tuple(i for i in self.config.full_attention_layers if i < n))
        keep = set(self.weight_names(cfg))
        return Llama(cfg, {k: v for k, v in self.weights.items() if k in keep})

    def weight_names(self, config: LlamaConfig | None = None) -> list[str]:
        """The HF weight names of this model, or of `config`'s shape of it."""
        c = config or self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not c.tie_embeddings:
            names.append("lm_head.weight")
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            names += [p + s + ".weight" for s in (
                "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj")]
            if c.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            if c.qkv_bias:
                names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
            if c.o_bias:
                names.append(p + "self_attn.o_proj.bias")
            if c.attention_sinks:
                names.append(p + "self_attn.sinks")
            if c.is_moe_layer(i):
                names += [p + "mlp.gate.weight", p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"]
            else:
                names += [p + s + ".weight" for s in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        return names

    def proj(self, x, name: str, bias: bool):
        y = ops.linear(x, self.weights[name + ".weight"])
        return ops.add_bias(y, self.weights[name + ".bias"]) if bias else y

    def step(self, tokens, positions, slot_mapping, block_tables, seq_lens, query_lens,
             sample_rows, temperature, top_k, top_p, seeds, draft_tokens, *rest):
        """rest: a hybrid model's sliding-group inputs, then one cache per layer (step_specs).
        tokens[T] -> (logits[R,V] f32, next_tokens[R] i64, hidden[R,D]) at sample_rows:
        next_tokens is -1 after a sequence's first rejected draft (spec_verify); hidden is the
        final-normed hidden state the logits come from (an MTP draft head's input). Writes k/v
        into kv_caches."""
        c, w = self.config, self.weights
        rope = dict(head_dim=c.head_dim, theta=c.rope_theta)
        paged, kv_caches = layer_inputs(c, slot_mapping, block_tables, seq_lens, rest)
        h = ops.embedding(w["model.embed_tokens.weight"], tokens)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            x = ops.rms_norm(h, w[p + "input_layernorm.weight"], eps=c.rms_norm_eps)
            q = self.proj(x, p + "self_attn.q_proj", c.qkv_bias)
            k = self.proj(x, p + "self_attn.k_proj", c.qkv_bias)
            if c.qk_norm:
                q = ops.head_rms_norm(q, w[p + "self_attn.q_norm.weight"], eps=c.rms_norm_eps, head_dim=c.head_dim)
                k = ops.head_rms_norm(k, w[p + "self_attn.k_norm.weight"], eps=c.rms_norm_eps, head_dim=c.head_dim)
            q, k = ops.rope(q, positions, **rope), ops.rope(k, positions, **rope)
            v = self.proj(x, p + "self_attn.v_proj", c.qkv_bias)
            slots, tables, lens = paged[i]
            a = ops.attention(q, k, v, kv_caches[i], slots, tables, lens, query_lens,
                              num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                              scale=1.0 / math.sqrt(c.head_dim), window=c.window_of(i),
                              sinks=w[p + "self_attn.sinks"] if c.attention_sinks else None)
            h = ops.add(h, self.proj(a, p + "self_attn.o_proj", c.o_bias))
            x = ops.rms_norm(h, w[p + "post_attention_layernorm.weight"], eps=c.rms_norm_eps)
            if c.is_moe_layer(i):
                router = ops.linear(x, w[p + "mlp.gate.weight"])
                mlp = ops.moe(x, router, w[p + "mlp.experts.gate_up_proj"], w[p + "mlp.experts.down_proj"],
                              top_k=c.experts_per_token, renormalize=c.renormalize_topk)
            else:
                gate = ops.silu(ops.linear(x, w[p + "mlp.gate_proj.weight"]))
                up = ops.linear(x, w[p + "mlp.up_proj.weight"])
                mlp = ops.linear(ops.mul(gate, up), w[p + "mlp.down_proj.weight"])
            h = ops.add(h, mlp)
        h = ops.rms_norm(h, w["model.norm.weight"], eps=c.rms_norm_eps)
        head = w["model.embed_tokens.weight"] if c.tie_embeddings else w["lm_head.weight"]
        logits = ops.logits(h, head, sample_rows)
        next_tokens = ops.spec_verify(ops.sample(logits, temperature, top_k, top_p, seeds), draft_tokens)
        return logits, next_tokens, ops.take_rows(h, sample_rows)
