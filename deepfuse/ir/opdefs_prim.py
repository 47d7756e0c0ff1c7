"""Primitive ops: the elementwise math, reductions and views that semantic ops decompose into,
and that lower one for one into the kernel IR (deepfuse/kernel/lower.py).

Binary ops broadcast numpy-style (x[T,D] with w[D], a row value [T,1] or a 0-d constant) and
want one dtype. Reductions run along one axis (`axis`, default the last) and keep it as size 1
by default. bf16 / f16 operands compute as torch computes them: in f32, rounded once per op.
"""
from __future__ import annotations

import torch

from .ops import OPS, decomposition, expect, register
from .types import Dim, TensorType


def broadcast_shape(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """numpy's broadcast of two (partly symbolic) shapes, or None where they do not broadcast."""
    out: list[Dim] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(reversed(out))


def _broadcast(out_dtype: str | None = None, arity: int = 2):
    def rule(types: list[TensorType], attrs: dict) -> list[TensorType]:
        expect(len(types) == arity, f"wants {arity} operands, got {len(types)}")
        expect(all(t.dtype == types[0].dtype for t in types), f"operand dtypes differ: {', '.join(map(str, types))}")
        shape = types[0].shape
        for t in types[1:]:
            shape = broadcast_shape(shape, t.shape)
            expect(shape is not None, f"operand shapes do not broadcast: {', '.join(map(str, types))}")
        return [TensorType(out_dtype or types[0].dtype, shape)]

    return rule


def _unary(types: list[TensorType], attrs: dict) -> list[TensorType]:
    expect(len(types) == 1, f"wants 1 operand, got {len(types)}")
    expect(types[0].dtype in ("f32", "bf16", "f16"), f"wants a float operand, got {types[0]}")
    return [types[0]]


def _unary_op(name: str, fn) -> None:
    register(name, _unary)(fn)


for _name, _fn in {"neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
                   "rsqrt": torch.rsqrt, "tanh": torch.tanh, "erf": torch.erf, "sigmoid": torch.sigmoid}.items():
    _unary_op(_name, lambda x, _f=_fn: _f(x))

# add and mul (opdefs_basic) broadcast like the other binary ops
for _name in ("add", "mul"):
    OPS[_name].infer = _broadcast()

for _name, _fn in {"sub": torch.sub, "div": torch.div, "maximum": torch.maximum, "minimum": torch.minimum}.items():
    register(_name, _broadcast())(lambda a, b, _f=_fn: _f(a, b))

for _name, _fn in {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
                   "ne": torch.ne}.items():
    register(_name, _broadcast("bool"))(lambda a, b, _f=_fn: _f(a, b))


def _where_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    expect(len(types) == 3, f"where wants (cond, a, b), got {len(types)} operands")
    c, a, b = types
    expect(c.dtype == "bool" and a.dtype == b.dtype, f"where wants a bool condition and operands of one dtype: "
           f"{c}, {a}, {b}")
    shape = broadcast_shape(broadcast_shape(c.shape, a.shape) or (), b.shape)
    expect(shape is not None and broadcast_shape(c.shape, a.shape) is not None,
           f"where operands do not broadcast: {c}, {a}, {b}")
    return [TensorType(a.dtype, shape)]


@register("where", _where_type)
def where(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a where c, else b (broadcast)."""
    return torch.where(c, a, b)


@register("pow_scalar", _unary)
def pow_scalar(x: torch.Tensor, *, exponent: float) -> torch.Tensor:
    """x ** exponent for a constant exponent."""
    return x.pow(exponent)


def _reduce_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (x,) = types
    expect(x.rank >= 1, f"a reduction wants a tensor of rank >= 1, got {x}")
    axis = attrs.get("axis", -1) % x.rank
    shape = list(x.shape)
    if attrs.get("keepdim", True):
        shape[axis] = 1
    else:
        shape.pop(axis)
    return [x.with_shape(*shape)]


@register("reduce_sum", _reduce_type)
def reduce_sum(x: torch.Tensor, *, axis: int = -1, keepdim: bool = True) -> torch.Tensor:
    """Sum along `axis`."""
    return x.sum(axis, keepdim=keepdim)


@register("reduce_max", _reduce_type)
def reduce_max(x: torch.Tensor, *, axis: int = -1, keepdim: bool = True) -> torch.Tensor:
    """Largest element along `axis`."""
    return x.amax(axis, keepdim=keepdim)


@register("reduce_mean", _reduce_type)
def reduce_mean(x: torch.Tensor, *, axis: int = -1, keepdim: bool = True) -> torch.Tensor:
    """Mean along `axis` (torch: the sum divided by the count)."""
    return x.mean(axis, keepdim=keepdim)


def _reshape_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (x,) = types
    shape = tuple(attrs["shape"])
    xs = [d for d in x.shape if isinstance(d, str)]
    ys = [d for d in shape if isinstance(d, str)]
    expect(xs == ys, f"reshape keeps the symbolic dims in order: {x} -> {list(shape)}")
    size = lambda s: eval("*".join(str(d) for d in s if isinstance(d, int)) or "1")  # noqa: E731
    expect(size(x.shape) == size(shape), f"reshape changes the element count: {x} -> {list(shape)}")
    return [x.with_shape(*shape)]


@register("reshape", _reshape_type)
def reshape(x: torch.Tensor, *, shape: list) -> torch.Tensor:
    """A view of contiguous x with `shape` (a symbolic dim keeps its size; at most one)."""
    sizes = [d if isinstance(d, int) else -1 for d in shape]
    expect(sizes.count(-1) <= 1, f"reshape to {shape} has more than one symbolic dim")
    return x.reshape(sizes)


# ---- semantic ops that models use and targets get as decompositions --------------------------------


@decomposition("rms_norm")
def _rms_norm_decomp(x, w, *, eps):
    from ..frontend import ops

    h = ops.cast(x, dtype="f32")
    h = ops.mul(h, ops.rsqrt(ops.add(ops.reduce_mean(ops.mul(h, h)), eps)))
    return ops.mul(w, ops.cast(h, dtype=x.dtype))


@decomposition("head_rms_norm")
def _head_rms_norm_decomp(x, w, *, eps, head_dim):
    from ..frontend import ops

    t, width = x.shape
    h = ops.reshape(x, shape=[t, width // head_dim, head_dim])
    return ops.reshape(ops.rms_norm(h, w, eps=eps), shape=[t, width])


@decomposition("silu")
def _silu_decomp(x):
    from ..frontend import ops

    h = ops.cast(x, dtype="f32")
    return ops.cast(ops.mul(h, ops.sigmoid(h)), dtype=x.dtype)


@register("gelu_tanh", _unary)
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Gemma's activation), computed in f32 and rounded once."""
    return torch.nn.functional.gelu(x, approximate="tanh")


@decomposition("gelu_tanh")
def _gelu_tanh_decomp(x):
    from ..frontend import ops

    h = ops.cast(x, dtype="f32")
    inner = ops.mul(ops.add(h, ops.mul(ops.pow(h, 3), 0.044715)), 0.7978845608028654)
    return ops.cast(ops.mul(ops.mul(h, 0.5), ops.add(ops.tanh(inner), 1.0)), dtype=x.dtype)


@register("softmax", _unary)
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax along the last axis, computed in f32 and rounded once."""
    return torch.softmax(x.float(), -1).to(x.dtype)


@decomposition("softmax")
def _softmax_decomp(x):
    from ..frontend import ops

    h = ops.cast(x, dtype="f32")
    e = ops.exp(ops.sub(h, ops.reduce_max(h)))
    return ops.cast(ops.div(e, ops.reduce_sum(e)), dtype=x.dtype)


@register("softcap", _unary)
def softcap(x: torch.Tensor, *, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): logit soft-capping (Gemma 2, Grok); each of the three ops computes in
    f32 (cap too) and rounds to x's dtype, as torch does for `torch.tanh(x / cap) * cap`."""
    return torch.tanh(x / cap) * cap


@decomposition("softcap")
def _softcap_decomp(x, *, cap):
    from ..frontend import ops

    def f32(v):
        return ops.cast(v, dtype="f32") if x.dtype != "f32" else v

    def back(v):
        return ops.cast(v, dtype=x.dtype) if x.dtype != "f32" else v

    scaled = back(ops.div(f32(x), cap))
    return back(ops.mul(f32(back(ops.tanh(f32(scaled)))), cap))


@decomposition("add_bias")
def _add_bias_decomp(x, b):
    from ..frontend import ops

    return ops.add(x, b)
