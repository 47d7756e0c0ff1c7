"""Lowering: a fusion group of primitive graph nodes -> one Kernel.

Every group member's output lives in the group's index space (R, G, C) (space_of): rank-3
values are [R, G, C], rank-2 [R, C] (G == 1), rank-1 [R] or [C]; a member whose output is
[R, G, 1] is a row op. Operands broadcast numpy-style against the member's output.
Values from outside the group are loaded; `split` (last axis) and `reshape` of a graph value
are views: a load reads the viewed buffer at the view's offset and strides, so neither copies.
0-d params (constants a decomposition wrote as numbers) become literals.

Precision follows the graph's references exactly: values compute in f32; where a member's
graph dtype is bf16 / f16 the result is rounded to it (`round`), as torch rounds each op's
result; stores cast to the buffer's dtype. So a generated kernel matches the interpreter to
f32 rounding, not merely to bf16's.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Graph, Node, Value
from ..ir.types import Dim
from .ir import Buffer, Index, Instr, Kernel, verify

Space = tuple[Dim, int, int]

UNARY_OPS = {"neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt",
             "tanh": "tanh", "erf": "erf", "sigmoid": "sigmoid"}
BINARY_OPS = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "maximum": "max", "minimum": "min"}
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
REDUCE_OPS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_mean": "sum"}
POINTWISE = frozenset(UNARY_OPS) | frozenset(BINARY_OPS) | frozenset(COMPARE_OPS) | {"where", "cast", "silu",
                                                                                       "pow_scalar"}
LOWERABLE = POINTWISE | frozenset(REDUCE_OPS) | {"reshape"}
VIEWS = ("split", "reshape")  # ops a load can see through
FLOATS = ("f32", "bf16", "f16")


def canonical(shape: tuple[Dim, ...], g: int | None = None) -> tuple[Dim, Dim, Dim] | None:
    """A value's shape as (rows, groups, cols), or None if it has no such form."""
    if len(shape) == 3:
        return shape
    if len(shape) == 2:
        return (shape[0], 1, shape[1])
    if len(shape) == 1:
        return (shape[0], 1, 1) if isinstance(shape[0], str) else (1, 1, shape[0])
    if len(shape) == 0:
        return (1, 1, 1)
    return None


def node_shape(n: Node) -> tuple[Dim, ...]:
    """The shape a member iterates over: its operand's for a reduction, else its output's."""
    return n.inputs[0].type.shape if n.op in REDUCE_OPS else n.outputs[0].type.shape


def space_of(n: Node) -> tuple[Space, bool] | None:
    """(space, is_row_op) of a lowerable node, or None where it cannot be lowered: integer
    values, an axis other than the last, a rank over 3, a symbolic feature size."""
    if n.op not in LOWERABLE:
        return None
    ok_dtypes = FLOATS + ("bool",)
    if any(v.type.dtype not in ok_dtypes for v in n.inputs + n.outputs):
        return None
    operands_bool = any(v.type.dtype == "bool" for v in n.inputs)
    if operands_bool and n.op not in ("where", "cast"):  # arithmetic and compares take floats
        return None
    if n.op == "where" and (n.inputs[0].type.dtype != "bool" or n.outputs[0].type.dtype == "bool"):
        return None
    if n.op == "cast" and n.outputs[0].type.dtype == "bool":
        return None
    if n.op in REDUCE_OPS:
        x = n.inputs[0].type
        if n.attrs.get("axis", -1) % max(x.rank, 1) != x.rank - 1 or not n.attrs.get("keepdim", True) or x.rank < 2:
            return None
    if n.op == "reshape":
        return None  # a reshape joins a group only as the view of a member's result (see Lowering)
    c = canonical(node_shape(n))
    if c is None or not isinstance(c[1], int) or not isinstance(c[2], int):
        return None
    if n.op == "pow_scalar" and not _pow_ok(n.attrs["exponent"]):
        return None
    row = n.op not in REDUCE_OPS and c[2] == 1
    return c, row


def _pow_ok(e: float) -> bool:
    return e in (0.5, -0.5) or float(e).is_integer() and -4 <= e <= 4 and e != 0


@dataclass
class View:
    """Where a graph value's elements are: buffer value `source`, shape `shape` (contiguous in the
    source from `offset`, rows `row_stride` apart)."""

    source: Value
    shape: tuple[Dim, ...]
    offset: int = 0
    row_stride: int | None = None  # split: the source's row; None: contiguous


def view_of(v: Value, producers: dict[Value, Node], grouped: frozenset = frozenset()) -> View:
    """Follows split (last axis, rank 2) and reshape (of contiguous values) back to a buffer; not
    through a node of a generated kernel (`grouped`), whose result that kernel stores."""
    p = producers.get(v)
    if p in grouped:
        return View(v, v.type.shape)
    if p is not None and p.op == "reshape":
        inner = view_of(p.inputs[0], producers, grouped)
        if inner.row_stride is None and inner.offset == 0:
            return View(inner.source, v.type.shape)
    if p is not None and p.op == "split" and p.inputs[0].type.rank == 2 and \
            p.attrs.get("axis", -1) in (-1, 1) and isinstance(p.inputs[0].type.shape[1], int):
        inner = view_of(p.inputs[0], producers, grouped)
        if inner.row_stride is None and inner.offset == 0:
            i = p.outputs.index(v)
            return View(inner.source, v.type.shape, sum(p.attrs["sizes"][:i]), p.inputs[0].type.shape[1])
    return View(v, v.type.shape)


def index_for(shape: tuple[Dim, ...], out_rank: int, space: Space, offset: int = 0,
              row_stride: int | None = None) -> Index:
    """The Index of a value of `shape` (contiguous, or rows row_stride apart) broadcast against a
    member output of rank out_rank in `space`."""
    full = (1,) * (out_rank - len(shape)) + tuple(shape)
    c = canonical(full)
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc = acc * d if isinstance(d, int) else acc
    strides = [0] * (out_rank - len(shape)) + list(reversed(strides))
    if row_stride is not None:
        strides[0] = row_stride
    if out_rank == 0:
        return Index(0, 0, 0, offset)
    by_axis = {3: (0, 1, 2), 2: (0, None, 1), 1: (0, None, None) if isinstance(full[0], str) else (None, None, 0)}[out_rank]
    coef = []
    for axis, pos in enumerate(by_axis):
        size = c[axis]
        coef.append(strides[pos] if pos is not None and size != 1 else 0)
    return Index(coef[0], coef[1], coef[2], offset)


class Lowering:
    """Builds one Kernel from a group's nodes (in graph order)."""

    def __init__(self, g: Graph, nodes: list[Node], space: Space, name: str, outputs: list[Value],
                 grouped: frozenset = frozenset()):
        self.g, self.nodes, self.space, self.name, self.grouped = g, nodes, space, name, grouped
        self.producers = g.producers()
        self.body: list[Instr] = []
        self.env: dict[Value, tuple[int, tuple[Dim, ...]]] = {}  # value -> (kernel value, layout shape)
        self.loads: dict[tuple, int] = {}
        self.inputs: list[Value] = []
        self.outputs = outputs
        self.kinds: dict[int, str] = {}

    def emit(self, op: str, args: tuple[int, ...], dtype: str, **attrs) -> int:
        kind = "elem" if any(self.kinds[a] == "elem" for a in args) else "row"
        if op in ("load", "store"):
            kind = attrs["index"].kind
        elif op == "reduce":
            kind = "row"
        out = len(self.kinds) if op != "store" else -1
        self.body.append(Instr(out, op, args, dtype, kind, attrs))
        if out >= 0:
            self.kinds[out] = kind
        return out

    def operand(self, v: Value, out_rank: int) -> int:
        """The kernel value of operand v of a member with output rank out_rank (f32 or bool)."""
        if v in self.env:
            return self.env[v][0]
        if v.type.rank == 0 and v.name in self.g.weights:
            value = self.g.weights[v.name].item()
            return self.emit("const", (), "bool" if v.type.dtype == "bool" else "f32",
                             value=bool(value) if v.type.dtype == "bool" else float(value))
        view = view_of(v, self.producers, self.grouped)
        ix = index_for(view.shape, out_rank, self.space, view.offset, view.row_stride)
        key = (view.source, ix)
        if key not in self.loads:
            if view.source not in self.inputs:
                self.inputs.append(view.source)
            dt = view.source.type.dtype
            x = self.emit("load", (), dt, buf=self.buffer_name(view.source), index=ix)
            if dt in ("bf16", "f16"):
                x = self.emit("cast", (x,), "f32", to="f32")
            self.loads[key] = x
        return self.loads[key]

    def buffer_name(self, v: Value) -> str:
        return f"in{self.inputs.index(v)}"

    def rounded(self, x: int, dtype: str) -> int:
        return self.emit("round", (x,), "f32", to=dtype) if dtype in ("bf16", "f16") else x

    def lower(self) -> tuple[Kernel, list[Value]]:
        for n in self.nodes:
            self.member(n)
        bufs_in = [Buffer(f"in{i}", v.type.dtype, v.type.shape, "in") for i, v in enumerate(self.inputs)]
        bufs_out = []
        for j, v in enumerate(self.outputs):
            x, layout = self.env[v]
            ix = index_for(layout, len(layout), self.space)
            if v.type.dtype in ("bf16", "f16"):
                x = self.emit("cast", (x,), v.type.dtype, to=v.type.dtype)
            self.emit("store", (x,), v.type.dtype, buf=f"out{j}", index=ix)
            bufs_out.append(Buffer(f"out{j}", v.type.dtype, v.type.shape, "out"))
        k = Kernel(self.name, bufs_in + bufs_out, self.space, self.body)
        verify(k)
        return k, self.inputs

    def member(self, n: Node) -> None:
        out = n.outputs[0]
        rank, dt = out.type.rank, out.type.dtype
        if n.op == "reshape":  # of a member's result: the same elements, the member's layout
            x, layout = self.env[n.inputs[0]]
            self.env[out] = (x, layout)
            return
        if n.op in REDUCE_OPS:
            rank = n.inputs[0].type.rank
        a = [self.operand(v, rank) for v in n.inputs]
        op = n.op
        if op in UNARY_OPS:
            r = self.rounded(self.emit(UNARY_OPS[op], (a[0],), "f32"), dt)
        elif op in BINARY_OPS:
            r = self.rounded(self.emit(BINARY_OPS[op], (a[0], a[1]), "f32"), dt)
        elif op in COMPARE_OPS:
            r = self.emit(op, (a[0], a[1]), "bool")
        elif op == "where":
            r = self.rounded(self.emit("where", (a[0], a[1], a[2]), "bool" if dt == "bool" else "f32"), dt)
        elif op == "silu":
            r = self.rounded(self.emit("mul", (a[0], self.emit("sigmoid", (a[0],), "f32")), "f32"), dt)
        elif op == "cast":
            src = n.inputs[0].type.dtype
            if src == "bool":  # 0.0 / 1.0: exact in every float dtype
                r = self.emit("cast", (a[0],), "f32", to="f32")
            elif dt == src or dt == "f32":
                r = a[0]
            else:
                r = self.rounded(a[0], dt)
        elif op == "pow_scalar":
            r = self.rounded(self.power(a[0], n.attrs["exponent"]), dt)
        elif op in REDUCE_OPS:
            r = self.emit("reduce", (a[0],), "f32", kind=REDUCE_OPS[op])
            if op == "reduce_mean":
                c = self.emit("const", (), "f32", value=float(self.space[2]))
                r = self.emit("div", (r, c), "f32")
            r = self.rounded(r, dt)
        else:
            raise ValueError(f"{n.op} does not lower")
        layout = out.type.shape
        self.env[out] = (r, layout)

    def power(self, x: int, e: float) -> int:
        if e == 0.5:
            return self.emit("sqrt", (x,), "f32")
        if e == -0.5:
            return self.emit("rsqrt", (x,), "f32")
        k = int(abs(e))
        if k == 0:
            return self.emit("const", (), "f32", value=1.0)
        r = x
        for _ in range(k - 1):
            r = self.emit("mul", (r, x), "f32")
        return self.emit("recip", (r,), "f32") if e < 0 else r


def lower_group(g: Graph, nodes: list[Node], space: Space, name: str, outputs: list[Value],
                grouped: frozenset = frozenset()) -> tuple[Kernel, list[Value]]:
    """The Kernel of a group (nodes in graph order) whose results `outputs` are read outside it;
    returns it with the graph values its input buffers bind to, in order. `grouped`: every node
    of every generated kernel (loads do not see through their views)."""
    return Lowering(g, nodes, space, name, outputs, grouped).lower()
