"""RMSNorm + the projection that follows it: the norm becomes the GEMM's prologue.

    linear(rms_norm(x, w), W)              -> rms_norm_linear(x, w, W)
    linear(add_rms_norm(x, r, w)[1], W)    -> add_rms_norm_linear(x, r, w, W)   (the sum stays an output)

Fires only where the normalised activation has no other reader (after fuse_sibling_linears
the q/k/v and gate/up projections are one linear each, so every pre-projection norm
qualifies). The projection may be dense (`linear`), int4 (`linear_q4`: the fused op then
takes packed, scales and mins and the group_size attr) or W8A8 (`linear_w8a8`: wq and scale, and
the act_group attr; on the CPU the norm is then the int8 GEMM's quantization prologue).
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Op, Rule, Var, rule_pass

x, res, w, proj = Var("x"), Var("res"), Var("w"), Var("proj")
packed, scales, mins = Var("packed"), Var("scales"), Var("mins")
wq, wscale = Var("wq"), Var("wscale")


def q4(m) -> tuple[tuple, dict]:
    """The projection operands and attrs of a matched linear_q4 (node `proj_out`)."""
    return (m["packed"], m["scales"], m["mins"]), {"group_size": m.attrs("proj_out")["group_size"]}


def w8(m) -> tuple[tuple, dict]:
    """The projection operands and attrs of a matched linear_w8a8 (node `proj_out`)."""
    return (m["wq"], m["wscale"]), {"act_group": m.attrs("proj_out")["act_group"]}

NORM_LINEAR = Rule(
    "rms_norm_linear",
    Op("linear", Op("rms_norm", x, w, name="norm"), proj),
    lambda m: ops.rms_norm_linear(m["x"], m["w"], m["proj"], eps=m.attrs("norm")["eps"]),
)


def _add_norm_linear(m):
    s, y = ops.add_rms_norm_linear(m["x"], m["res"], m["w"], m["proj"], eps=m.attrs("norm")["eps"])
    return s, None, y  # add_rms_norm's (sum, normed), then the linear's output


ADD_NORM_LINEAR = Rule(
    "add_rms_norm_linear",
    Op("linear", Op("add_rms_norm", x, res, w, name="norm", out=1), proj, name="proj_out"),
    _add_norm_linear,
    replaces=("norm", "proj_out"),
)

NORM_LINEAR_Q4 = Rule(
    "rms_norm_linear_q4",
    Op("linear_q4", Op("rms_norm", x, w, name="norm"), packed, scales, mins, name="proj_out"),
    lambda m: ops.rms_norm_linear(m["x"], m["w"], *q4(m)[0], eps=m.attrs("norm")["eps"], **q4(m)[1]),
)


def _add_norm_linear_q4(m):
    s, y = ops.add_rms_norm_linear(m["x"], m["res"], m["w"], *q4(m)[0], eps=m.attrs("norm")["eps"], **q4(m)[1])
    return s, None, y


ADD_NORM_LINEAR_Q4 = Rule(
    "add_rms_norm_linear_q4",
    Op("linear_q4", Op("add_rms_norm", x, res, w, name="norm", out=1), packed, scales, mins, name="proj_out"),
    _add_norm_linear_q4,
    replaces=("norm", "proj_out"),
)

NORM_LINEAR_W8 = Rule(
    "rms_norm_linear_w8a8",
    Op("linear_w8a8", Op("rms_norm", x, w, name="norm"), wq, wscale, name="proj_out"),
    lambda m: ops.rms_norm_linear(m["x"], m["w"], *w8(m)[0], eps=m.attrs("norm")["eps"], **w8(m)[1]),
)


def _add_norm_linear_w8(m):
    s, y = ops.add_rms_norm_linear(m["x"], m["res"], m["w"], *w8(m)[0], eps=m.attrs("norm")["eps"], **w8(m)[1])
    return s, None, y


ADD_NORM_LINEAR_W8 = Rule(
    "add_rms_norm_linear_w8a8",
    Op("linear_w8a8", Op("add_rms_norm", x, res, w, name="norm", out=1), wq, wscale, name="proj_out"),
    _add_norm_linear_w8,
    replaces=("norm", "proj_out"),
)

fuse_norm_linear = rule_pass("fuse_norm_linear", [NORM_LINEAR, ADD_NORM_LINEAR, NORM_LINEAR_Q4, ADD_NORM_LINEAR_Q4,
                                                  NORM_LINEAR_W8, ADD_NORM_LINEAR_W8])
