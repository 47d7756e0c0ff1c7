"""MoE fusion: moe(x, linear(x, Wr), W13, W2) -> fused_moe(x, Wr, W13, W2).

The router matmul, scoring (softmax or sigmoid, with the optional score-correction bias,
grouped top-k, renormalisation, routed scaling), the experts and the weighted combine
become one op, which a target implements as a grouped GEMM over tokens sorted by
expert (CPU: torch._grouped_mm; no per-expert loop).
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Op, Rule, Var, rule_pass

x, router_w, w13, w2, bias = Var("x"), Var("router_w"), Var("w13"), Var("w2"), Var("bias")


def _fused(m):
    extra = [m["bias"]] if "bias" in m.values else []
    return ops.fused_moe(m["x"], m["router_w"], m["w13"], m["w2"], *extra, **m.attrs("moe"))


def _weights(m) -> bool:
    return all(m.is_param(n) for n in ("router_w", "w13", "w2"))


FUSED_MOE = Rule("fused_moe", Op("moe", x, Op("linear", x, router_w), w13, w2, name="moe"), _fused, when=_weights)
FUSED_MOE_BIASED = Rule("fused_moe_biased", Op("moe", x, Op("linear", x, router_w), w13, w2, bias, name="moe"),
                        _fused, when=_weights)

fuse_moe = rule_pass("fuse_moe", [FUSED_MOE, FUSED_MOE_BIASED])
