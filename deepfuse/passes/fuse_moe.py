"""MoE fusion: moe(x, linear(x, Wr), W13, W2) -> fused_moe(x, Wr, W13, W2).

The router matmul, softmax, top-k (and renormalisation), the experts and the weighted
combine become one op, which a target implements as a grouped GEMM over tokens sorted by
expert (CPU: torch._grouped_mm; no per-expert loop).
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Op, Rule, Var, rule_pass

x, router_w, w13, w2 = Var("x"), Var("router_w"), Var("w13"), Var("w2")

FUSED_MOE = Rule(
    "fused_moe",
    Op("moe", x, Op("linear", x, router_w), w13, w2, name="moe"),
    lambda m: ops.fused_moe(m["x"], m["router_w"], m["w13"], m["w2"], top_k=m.attrs("moe")["top_k"],
                            renormalize=m.attrs("moe")["renormalize"]),
    when=lambda m: m.is_param("router_w") and m.is_param("w13") and m.is_param("w2"),
)

fuse_moe = rule_pass("fuse_moe", [FUSED_MOE])
