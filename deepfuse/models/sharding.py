"""Default shardings of the Llama family (dense and MoE) for tensor and expert parallelism.

Megatron's layout: q/k/v and gate/up split by output features, o and down by input features (a
partial sum, all-reduced); MoE experts split over the ranks (each computes its experts for every
token and the sum is all-reduced, or with moe_dispatch="all_to_all" each rank's share of the
tokens goes to its experts' ranks and back); router and norms replicated. Attention splits by kv head, each
with its query heads (rank r: kv heads r*Hkv/W.. and the H/Hkv query heads of each), and so does
each layer's kv cache. Where the ranks do not divide the kv heads (SmolLM2: 3 over 2 ranks) the
split is uneven (1 and 2). The embedding and the LM head are split by vocabulary: the lookup is a
partial sum (one all-reduce of [T,D]) and the head gives each rank a vocabulary slice of the
logits (one all-gather of [R,V]), so neither table is stored whole on any rank; a vocabulary the
ranks do not divide keeps both replicated.
"""
from __future__ import annotations

from ..errors import DeepfuseError
from ..passes.shard import S, ShardingSpec


def llama_sharding(config, world: int, moe_dispatch: str = "all_reduce") -> ShardingSpec:
    """config: a LlamaConfig. moe_dispatch: how expert-parallel MoE layers meet their tokens
    (passes/shard.py: "all_reduce" or "all_to_all"). Raises DeepfuseError naming the size that
    does not split."""
    if getattr(config, "family", "llama") in ("gemma3", "yoco_swa"):
        raise DeepfuseError(f"tensor parallelism is implemented for the Llama family, not {config.family!r}")
    if config.num_kv_heads < world:
        raise DeepfuseError(f"num_kv_heads = {config.num_kv_heads} cannot be split over {world} ranks; "
                            f"use a tensor_parallel_size of at most {config.num_kv_heads}")
    if config.num_experts and config.num_experts % world:
        raise DeepfuseError(f"num_experts = {config.num_experts} does not split over {world} ranks; "
                            "use a tensor_parallel_size dividing it")
    heads = config.num_kv_heads  # blocks of q (H/Hkv heads each), k, v, o's input and the cache
    spec = ShardingSpec(world, inputs={f"kv_cache.{i}": S(3, heads) for i in range(config.num_layers)},
                        moe_dispatch=moe_dispatch)
    p = spec.params
    if config.vocab_size % world == 0:
        p["model.embed_tokens.weight"] = p["lm_head.weight"] = S(0)
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for x in "qkv":
            p[f"{a}{x}_proj.weight"] = p[f"{a}{x}_proj.bias"] = S(0, heads)
        p[a + "o_proj.weight"] = S(1, heads)
        p[a + "sinks"] = S(0, heads)
        p[m + "gate_proj.weight"] = p[m + "up_proj.weight"] = S(0, config.intermediate_size)
        p[m + "down_proj.weight"] = S(1, config.intermediate_size)
        p[m + "experts.gate_up_proj"] = p[m + "experts.down_proj"] = S(0)
    return spec
