"""Basic ops: elementwise math, linear, embedding, split/concat, cast.

Shapes: T = tokens in the step, D/K/N = feature sizes. Reference semantics only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import decomposition, expect, register
from .types import DTYPES, TensorType


def _same(arity: int):
    """The type rule of an elementwise op of `arity` operands of one type: that type."""

    def rule(types: list[TensorType], attrs: dict) -> list[TensorType]:
        expect(len(types) == arity, f"wants {arity} operand{'s' if arity > 1 else ''}, got {len(types)}")
        expect(all(t == types[0] for t in types), f"operand types differ: {', '.join(map(str, types))}")
        return [types[0]]

    return rule


@register("add", _same(2))
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b, same shapes."""
    return a + b


@register("mul", _same(2))
def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b, same shapes."""
    return a * b


@register("silu", _same(1))
def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return F.silu(x)


def _linear_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, w = types
    expect(x.rank == 2 and w.rank == 2, f"linear wants x[T,K], w[N,K]; got {x}, {w}")
    expect(x.shape[1] == w.shape[1], f"linear K mismatch: {x} vs {w}")
    expect(x.dtype == w.dtype, f"linear dtype mismatch: {x.dtype} vs {w.dtype}")
    return [x.with_shape(x.shape[0], w.shape[0])]


@register("linear", _linear_type)
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[T,K] @ w[N,K]^T -> [T,N]."""
    return F.linear(x, w)


def _add_bias_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, b = types
    expect(b.rank == 1 and x.shape[-1] == b.shape[0] and x.dtype == b.dtype, f"bias {b} does not fit {x}")
    return [x]


@register("add_bias", _add_bias_type)
def add_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x[T,N] + b[N] (a projection's bias)."""
    return x + b


def _embedding_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    table, ids = types
    expect(table.rank == 2 and ids.rank == 1, f"embedding wants table[V,D], ids[T]; got {table}, {ids}")
    expect(ids.dtype in ("i32", "i64"), f"embedding ids must be integer, got {ids.dtype}")
    return [table.with_shape(ids.shape[0], table.shape[1])]


@register("embedding", _embedding_type)
def embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[V,D], ids[T] -> [T,D]."""
    return table.index_select(0, ids.long())


def _axis(attrs: dict, rank: int) -> int:
    axis = attrs.get("axis", -1)
    return axis + rank if axis < 0 else axis


def _split_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (x,) = types
    axis, sizes = _axis(attrs, x.rank), attrs["sizes"]
    expect(x.shape[axis] == sum(sizes), f"split sizes {sizes} do not add up to dim {x.shape[axis]} of {x}")
    return [x.with_shape(*x.shape[:axis], s, *x.shape[axis + 1:]) for s in sizes]


@register("split", _split_type)
def split(x: torch.Tensor, *, sizes: list[int], axis: int = -1) -> tuple[torch.Tensor, ...]:
    """Splits x along `axis` into parts of `sizes`."""
    return tuple(t.contiguous() for t in torch.split(x, sizes, dim=axis))


def _concat_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    first = types[0]
    axis = _axis(attrs, first.rank)
    for t in types[1:]:
        expect(t.dtype == first.dtype and t.rank == first.rank, f"concat operands differ: {first} vs {t}")
        expect(all(a == b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis),
               f"concat shapes differ off axis {axis}: {first} vs {t}")
    dims = [t.shape[axis] for t in types]
    expect(all(isinstance(d, int) for d in dims), "concat axis must be static")
    return [first.with_shape(*first.shape[:axis], sum(dims), *first.shape[axis + 1:])]


@register("concat", _concat_type)
def concat(*xs: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """Concatenates along `axis`."""
    return torch.cat(xs, dim=axis)


def _cast_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    expect(attrs["dtype"] in DTYPES, f"unknown dtype {attrs['dtype']!r}")
    return [TensorType(attrs["dtype"], types[0].shape)]


@register("cast", _cast_type)
def cast(x: torch.Tensor, *, dtype: str) -> torch.Tensor:
    """Converts x to `dtype`."""
    return x.to(DTYPES[dtype])


def _swiglu_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (x,) = types
    expect(isinstance(x.shape[-1], int) and x.shape[-1] % 2 == 0, f"swiglu wants an even last dim: {x}")
    return [x.with_shape(*x.shape[:-1], x.shape[-1] // 2)]


@register("swiglu", _swiglu_type)
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """x[T,2I] = [gate | up] -> silu(gate) * up, [T,I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@decomposition("swiglu")
def _swiglu_decomp(x):
    from ..frontend import ops

    half = x.shape[-1] // 2
    gate, up = ops.split(x, sizes=[half, half], axis=-1)
    return ops.mul(ops.silu(gate), up)
