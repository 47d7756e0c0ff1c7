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

# Shared experts: add(fused_moe(x, ...), linear(swiglu(linear(x, S13)), S2)) -> one fused_moe whose
# expert stacks end with the shared MLP sliced into always-on experts (weight 1). Runs after
# fuse_swiglu; fold_constants then evaluates append_experts on the weights.
s13, s2 = Var("s13"), Var("s2")
SHARED = Op("linear", Op("swiglu", Op("linear", x, s13)), s2)


def _absorb(m):
    w13n, w2n = ops.append_experts(m["w13"], m["w2"], m["s13"], m["s2"])
    attrs = dict(m.attrs("moe"))
    i, shared_i = m["w13"].shape[1] // 2, m["s2"].shape[1]
    attrs["num_shared"] = attrs.get("num_shared", 0) + shared_i // i
    extra = [m["bias"]] if "bias" in m.values else []
    return ops.fused_moe(m["x"], m["router_w"], w13n, w2n, *extra, **attrs)


def _shared_fits(m) -> bool:
    return m.is_param("s13") and m.is_param("s2") and m["s2"].type.shape[1] % (m["w13"].type.shape[1] // 2) == 0


ABSORB = Rule("shared_experts", Op("add", Op("fused_moe", x, router_w, w13, w2, name="moe"), SHARED), _absorb,
              when=_shared_fits)
ABSORB_BIASED = Rule("shared_experts_biased", Op("add", Op("fused_moe", x, router_w, w13, w2, bias, name="moe"), SHARED),
                     _absorb, when=_shared_fits)

fuse_shared_experts = rule_pass("fuse_shared_experts", [ABSORB, ABSORB_BIASED])
