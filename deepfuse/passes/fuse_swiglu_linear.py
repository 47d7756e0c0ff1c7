"""SwiGLU + down projection: linear(swiglu(x), W) -> swiglu_linear(x, W).

The activation becomes the down GEMM's prologue, so the [T, I] activation never goes to
memory on a target that fuses it. Matches dense `linear` only.
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Op, Rule, Var, rule_pass

x, proj = Var("x"), Var("proj")

SWIGLU_LINEAR = Rule("swiglu_linear", Op("linear", Op("swiglu", x), proj),
                     lambda m: ops.swiglu_linear(m["x"], m["proj"]))

fuse_swiglu_linear = rule_pass("fuse_swiglu_linear", [SWIGLU_LINEAR])
