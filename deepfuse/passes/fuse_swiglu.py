"""SwiGLU fusion: mul(silu(gate), up), with gate/up the two equal halves of one split -> swiglu(x).

Runs after fuse_sibling_linears merged gate_proj and up_proj; one op replaces three
(split, silu, mul) and reads the merged projection once.
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Match, Op, Rule, Var, rule_pass

gate_up = Var("gate_up")


def _halves(m: Match) -> bool:
    a = m.attrs("split")
    return len(a["sizes"]) == 2 and a["sizes"][0] == a["sizes"][1] and a.get("axis", -1) in (-1, 1)


SWIGLU = Rule(
    "swiglu",
    Op("mul", Op("silu", Op("split", gate_up, name="split", out=0)), Op("split", gate_up, name="split", out=1)),
    lambda m: ops.swiglu(m["gate_up"]),
    when=_halves,
)

fuse_swiglu = rule_pass("fuse_swiglu", [SWIGLU])
