"""Residual add + RMSNorm: rms_norm(add(x, res), w) -> add_rms_norm(x, res, w).

A pre-norm block ends with `h = x + res` and the next block starts with `rms_norm(h)`;
one op produces both, so a target reads h once (one launch on CPU, one kernel on GPU).
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Op, Rule, Var, rule_pass

x, res, w = Var("x"), Var("res"), Var("w")

ADD_RMS_NORM = Rule(
    "add_rms_norm",
    Op("rms_norm", Op("add", x, res, name="sum"), w, name="norm"),
    lambda m: ops.add_rms_norm(m["x"], m["res"], m["w"], eps=m.attrs("norm")["eps"]),
    replaces=("sum", "norm"),
)

fuse_add_rms_norm = rule_pass("fuse_add_rms_norm", [ADD_RMS_NORM])
