"""RMSNorm + the projection that follows it: the norm becomes the GEMM's prologue.

    linear(rms_norm(x, w), W)              -> rms_norm_linear(x, w, W)
    linear(add_rms_norm(x, r, w)[1], W)    -> add_rms_norm_linear(x, r, w, W)   (the sum stays an output)

Fires only where the normalised activation has no other reader (after fuse_sibling_linears
the q/k/v and gate/up projections are one linear each, so every pre-projection norm
qualifies). The projection may be dense (`linear`), int4 (`linear_q4`: the fused op then
takes packed, scales and mins and the group_size attr) or W8A8 (`linear_w8a8`: wq and scale, and
the act_group attr; on the CPU the norm is then the int8 GEMM's quantization prologue) or int4-a8
(`linear_q4a8`: packed, scales and mins with group_size and act_group both the group; on the CPU
the norm is made row by row in q4a8_gemm's quantization phase).
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Op, Rule, Var, rule_pass

x, res, w, proj = Var("x"), Var("res"), Var("w"), Var("proj")

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


def quantized_rules(suffix: str, op: str, operands: tuple[str, ...], attrs: dict[str, str]) -> list[Rule]:
    """rms_norm_linear_<suffix> and add_rms_norm_linear_<suffix> for a quantized projection
    op(activation, *operands); the fused op's attr a is the projection's attrs[a]."""
    args = tuple(Var(name) for name in operands)

    def proj(m) -> tuple[list, dict]:
        return [m[name] for name in operands], {a: m.attrs("proj_out")[b] for a, b in attrs.items()}

    def norm_linear(m):
        ins, attrs = proj(m)
        return ops.rms_norm_linear(m["x"], m["w"], *ins, eps=m.attrs("norm")["eps"], **attrs)

    def add_norm_linear(m):
        ins, attrs = proj(m)
        s, y = ops.add_rms_norm_linear(m["x"], m["res"], m["w"], *ins, eps=m.attrs("norm")["eps"], **attrs)
        return s, None, y

    return [Rule(f"rms_norm_linear_{suffix}", Op(op, Op("rms_norm", x, w, name="norm"), *args, name="proj_out"),
                 norm_linear),
            Rule(f"add_rms_norm_linear_{suffix}",
                 Op(op, Op("add_rms_norm", x, res, w, name="norm", out=1), *args, name="proj_out"), add_norm_linear,
                 replaces=("norm", "proj_out"))]


fuse_norm_linear = rule_pass("fuse_norm_linear", [
    NORM_LINEAR, ADD_NORM_LINEAR,
    *quantized_rules("q4", "linear_q4", ("packed", "scales", "mins"), {"group_size": "group_size"}),
    *quantized_rules("w8a8", "linear_w8a8", ("wq", "wscale"), {"act_group": "act_group"}),
    *quantized_rules("q4a8", "linear_q4a8", ("packed", "scales", "mins"),
                     {"group_size": "group_size", "act_group": "group_size"}),
])
