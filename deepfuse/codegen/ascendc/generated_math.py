"""The kernel IR's unary math as AscendC vector instructions (count forms), for the generated-kernel
renderer (emit_generated.py). Each function returns C++ lines computing `d = op(a)` over `n`
elements; `scratch()` hands out another f32 tensor of at least n elements (dead after the op);
d never aliases a. Ops without a basic instruction are built from ones that exist:

    rsqrt   1 / sqrt(x)                    (Sqrt, Div: the kit advises against Rsqrt's precision)
    sigmoid 1 / (1 + exp(-x))
    tanh    1 - 2 / (exp(2x) + 1)          (exp overflow gives 1, underflow -1)
    erf     Abramowitz & Stegun 7.1.26 on |x| (|error| <= 1.5e-7), the sign restored by
            x / max(|x|, 1e-30), which is exactly +-1 where it matters (below 1e-30, y(|x|) ~ 0)
"""
from __future__ import annotations

# Abramowitz & Stegun 7.1.26: erf(x) = 1 - t*(a1 + t*(a2 + t*(a3 + t*(a4 + t*a5)))) * exp(-x^2),
# t = 1 / (1 + p*x), x >= 0
ERF_P = 0.3275911
ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def f32(v: float) -> str:
    """A float literal C++ parses to the f32 nearest v (the interpreter's torch.tensor(v, f32))."""
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"the AscendC renderer has no literal for {v} (no INFINITY on the AI core)")
    return repr(float(v)) + "f"


def _recip_of(d: str, x: str, n: int, scratch) -> list[str]:
    """d = 1 / x (x may be d)."""
    one = scratch()
    return [f"Duplicate({one}, 1.0f, {n});", f"Div({d}, {one}, {x}, {n});"]


def _erf(d: str, a: str, n: int, scratch) -> list[str]:
    x, p = scratch(), scratch()
    lines = [f"Abs({x}, {a}, {n});", f"Muls({d}, {x}, {f32(ERF_P)}, {n});", f"Adds({d}, {d}, 1.0f, {n});",
             *_recip_of(d, d, n, scratch),  # d = t
             f"Muls({p}, {d}, {f32(ERF_A[4])}, {n});"]
    for coef in reversed(ERF_A[:4]):
        lines += [f"Adds({p}, {p}, {f32(coef)}, {n});", f"Mul({p}, {p}, {d}, {n});"]
    lines += [f"Mul({x}, {x}, {x}, {n});", f"Muls({x}, {x}, -1.0f, {n});", f"Exp({x}, {x}, {n});",
              f"Mul({p}, {p}, {x}, {n});", f"Muls({p}, {p}, -1.0f, {n});", f"Adds({p}, {p}, 1.0f, {n});",
              # sign(a): a / max(|a|, 1e-30)
              f"Abs({x}, {a}, {n});", f"Maxs({x}, {x}, 1e-30f, {n});", f"Div({x}, {a}, {x}, {n});",
              f"Mul({d}, {p}, {x}, {n});"]
    return lines


def unary(op: str, d: str, a: str, n: int, scratch) -> list[str]:
    """C++ lines for d = op(a) over n f32 elements."""
    simple = {"abs": "Abs", "exp": "Exp", "log": "Ln", "sqrt": "Sqrt"}
    if op in simple:
        return [f"{simple[op]}({d}, {a}, {n});"]
    if op == "neg":
        return [f"Muls({d}, {a}, -1.0f, {n});"]
    if op == "recip":
        return _recip_of(d, a, n, scratch)
    if op == "rsqrt":
        return [f"Sqrt({d}, {a}, {n});", *_recip_of(d, d, n, scratch)]
    if op == "sigmoid":
        return [f"Muls({d}, {a}, -1.0f, {n});", f"Exp({d}, {d}, {n});", f"Adds({d}, {d}, 1.0f, {n});",
                *_recip_of(d, d, n, scratch)]
    if op == "tanh":
        two = scratch()
        return [f"Muls({d}, {a}, 2.0f, {n});", f"Exp({d}, {d}, {n});", f"Adds({d}, {d}, 1.0f, {n});",
                f"Duplicate({two}, 2.0f, {n});", f"Div({d}, {two}, {d}, {n});", f"Muls({d}, {d}, -1.0f, {n});",
                f"Adds({d}, {d}, 1.0f, {n});"]
    if op == "erf":
        return _erf(d, a, n, scratch)
    raise ValueError(f"no AscendC rendering of unary {op!r}")


BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min"}
SCALAR = {"add": "Adds", "mul": "Muls", "max": "Maxs", "min": "Mins"}  # commutative, with a scalar form
CMPMODE = {"lt": "LT", "le": "LE", "gt": "GT", "ge": "GE", "eq": "EQ", "ne": "NE"}
CMP_C = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def with_scalar(op: str, d: str, t: str, s: str, tensor_first: bool, n: int, scratch) -> list[str]:
    """d = op(t, s) (or op(s, t)) for a tensor t and a scalar expression s."""
    if op in SCALAR:
        return [f"{SCALAR[op]}({d}, {t}, {s}, {n});"]
    if op == "sub" and tensor_first:  # x - s == x + (-s) exactly
        return [f"Adds({d}, {t}, -({s}), {n});"]
    if op == "sub":  # s - x == (-x) + s exactly
        return [f"Muls({d}, {t}, -1.0f, {n});", f"Adds({d}, {d}, {s}, {n});"]
    b = scratch()  # div: the scalar broadcast, then the exact vector Div
    args = f"{t}, {b}" if tensor_first else f"{b}, {t}"
    return [f"Duplicate({b}, {s}, {n});", f"{BINARY[op]}({d}, {args}, {n});"]
