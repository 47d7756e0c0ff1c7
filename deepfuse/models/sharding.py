"""Default shardings of the Llama family (dense and MoE) for tensor and expert parallelism.

Megatron's layout: q/k/v and gate/up split by output features (whole heads per rank: rank r has
query heads r*H/W.. and their kv heads r*Hkv/W..), o and down by input features (a partial sum,
all-reduced); MoE experts split over the ranks (each computes its E/W experts for every token,
the sum is all-reduced); router and norms replicated. The embedding and the LM head are split by
vocabulary: the lookup is a partial sum (one all-reduce of [T,D]) and the head gives each rank a
vocabulary slice of the logits (one all-gather of [R,V]), so neither table is stored whole on
any rank. Each layer's kv cache is split by kv heads.
"""
from __future__ import annotations

from ..errors import DeepfuseError
from ..passes.shard import P, R, S, ShardingSpec  # noqa: F401  (R, P: for readers of specs)


def llama_sharding(config, world: int) -> ShardingSpec:
    """config: a LlamaConfig. Raises DeepfuseError naming the size that does not split."""
    if getattr(config, "family", "llama") in ("gemma3", "yoco_swa"):
        raise DeepfuseError(f"tensor parallelism is implemented for the Llama family, not {config.family!r}")
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "vocab_size": config.vocab_size,
             "intermediate_size": config.intermediate_size}
    if config.num_experts:
        sizes["num_experts"] = config.num_experts
    for name, n in sizes.items():
        if n % world:
            raise DeepfuseError(f"{name} = {n} does not split over {world} ranks; use a tensor_parallel_size dividing it")
    spec = ShardingSpec(world, inputs={f"kv_cache.{i}": S(3) for i in range(config.num_layers)})
    p = spec.params
    p["model.embed_tokens.weight"] = p["lm_head.weight"] = S(0)
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for x in "qkv":
            p[f"{a}{x}_proj.weight"] = p[f"{a}{x}_proj.bias"] = S(0)
        p[a + "o_proj.weight"] = S(1)
        p[a + "sinks"] = S(0)
        p[m + "gate_proj.weight"] = p[m + "up_proj.weight"] = S(0)
        p[m + "down_proj.weight"] = S(1)
        p[m + "experts.gate_up_proj"] = p[m + "experts.down_proj"] = S(0)
    return spec
