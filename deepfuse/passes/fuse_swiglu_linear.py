"""SwiGLU + down projection: linear(swiglu(x), W) -> swiglu_linear(x, W).

The activation becomes the down GEMM's prologue, so the [T, I] activation never goes to
memory on a target that fuses it. The projection may be dense, int4 (linear_q4) or W8A8
(linear_w8a8: on the CPU the activation is then the int8 GEMM's quantization prologue) or int4-a8
(linear_q4a8: the fused op has group_size and act_group, both the group).
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Op, Rule, Var, rule_pass

x, proj = Var("x"), Var("proj")
packed, scales, mins = Var("packed"), Var("scales"), Var("mins")
wq, wscale = Var("wq"), Var("wscale")

SWIGLU_LINEAR = Rule("swiglu_linear", Op("linear", Op("swiglu", x), proj),
                     lambda m: ops.swiglu_linear(m["x"], m["proj"]))
SWIGLU_LINEAR_Q4 = Rule("swiglu_linear_q4", Op("linear_q4", Op("swiglu", x), packed, scales, mins, name="proj_out"),
                        lambda m: ops.swiglu_linear(m["x"], m["packed"], m["scales"], m["mins"],
                                                    group_size=m.attrs("proj_out")["group_size"]))

SWIGLU_LINEAR_W8 = Rule("swiglu_linear_w8a8", Op("linear_w8a8", Op("swiglu", x), wq, wscale, name="proj_out"),
                        lambda m: ops.swiglu_linear(m["x"], m["wq"], m["wscale"],
                                                    act_group=m.attrs("proj_out")["act_group"]))

SWIGLU_LINEAR_Q4A8 = Rule("swiglu_linear_q4a8",
                          Op("linear_q4a8", Op("swiglu", x), packed, scales, mins, name="proj_out"),
                          lambda m: ops.swiglu_linear(m["x"], m["packed"], m["scales"], m["mins"],
                                                      group_size=m.attrs("proj_out")["group_size"],
                                                      act_group=m.attrs("proj_out")["group_size"]))

fuse_swiglu_linear = rule_pass("fuse_swiglu_linear",
                               [SWIGLU_LINEAR, SWIGLU_LINEAR_Q4, SWIGLU_LINEAR_W8, SWIGLU_LINEAR_Q4A8])
