"""The kernel-level IR: one generated kernel, below the graph IR.

A kernel iterates over an index space of rows x groups x columns, (R, G, C): R may be a
step symbol ("T"), G and C are ints. Its body is straight-line SSA code that every
(r, g, c) runs; a value is either per element ("elem": varies with c) or per row ("row":
one per (r, g), the result of a reduction along c, the only reduction axis a kernel has).

    load   buf[index]          index = r*row + g*group + c*col + offset (an Index)
    store  buf[index] = v      (elem values; a row value is stored where col == 0)
    const  v                   a number, in the instruction's dtype
    col                        c itself (i32)
    unary / binary / compare / where     pointwise math, in f32 (compares give bool)
    cast   v -> dtype          to a narrower float: round to nearest even (explicit)
    round  v -> dtype          rounds an f32 to dtype's precision and stays f32 (the point where
                               the graph's reference rounded an intermediate)
    reduce.sum|max|min|argmax v     along c: a row value (argmax: i32, the first maximum)

Arithmetic is f32 only (loads of bf16/f16 are cast up by the lowering, stores cast down), so a
renderer never guesses a precision. Kernels are data: `to_json` / `from_json` for plans and
artifacts, `text` for dumps. The torch interpreter (interpret.py) is its ground truth, checked
against the graph interpreter; each renderer is checked against it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DeepfuseError
from ..ir.types import Dim

UNARY = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "erf", "sigmoid", "recip")
BINARY = ("add", "sub", "mul", "div", "max", "min")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
REDUCE = ("sum", "max", "min", "argmax")
VALUE_DTYPES = ("f32", "i32", "bool")  # what arithmetic sees; buffers may also be bf16, f16, i64
BUFFER_DTYPES = ("f32", "bf16", "f16", "i32", "i64", "bool")


@dataclass(frozen=True)
class Index:
    """Flat element offset r*row + g*group + c*col + offset into a contiguous buffer."""

    row: int = 0
    group: int = 0
    col: int = 0
    offset: int = 0

    def __str__(self) -> str:
        terms = [f"{v}*{n}" if v != 1 else n for n, v in (("r", self.row), ("g", self.group), ("c", self.col)) if v]
        if self.offset or not terms:
            terms.append(str(self.offset))
        return " + ".join(terms)

    @property
    def kind(self) -> str:
        """"elem" if it moves with c, else "row"."""
        return "elem" if self.col else "row"


@dataclass(frozen=True)
class Buffer:
    """A kernel parameter: a contiguous tensor of `shape` (the graph value's type), read ("in")
    or written ("out")."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]
    role: str  # "in" | "out"

    def __str__(self) -> str:
        return f"{self.name}: {self.role} {self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Instr:
    """`out = op(args...)` with the result's dtype and kind ("elem" | "row"). attrs: load/store's
    "buf" and "index" (Index), const's "value", cast/round's "to", reduce's "kind"."""

    out: int  # SSA number (stores: -1)
    op: str
    args: tuple[int, ...]
    dtype: str
    kind: str
    attrs: dict = field(default_factory=dict, compare=False, hash=False)

    def text(self) -> str:
        a = ", ".join(f"%{x}" for x in self.args)
        suffix = f"  : {self.dtype} {self.kind}"
        if self.op == "load":
            return f"%{self.out} = load {self.attrs['buf']}[{self.attrs['index']}]{suffix}"
        if self.op == "store":
            return f"store {self.attrs['buf']}[{self.attrs['index']}] = {a}"
        if self.op == "const":
            return f"%{self.out} = const {self.attrs['value']!r}{suffix}"
        if self.op in ("cast", "round"):
            return f"%{self.out} = {self.op} {a} -> {self.attrs['to']}{suffix}"
        if self.op == "reduce":
            return f"%{self.out} = reduce.{self.attrs['kind']} {a}{suffix}"
        return f"%{self.out} = {self.op} {a}{suffix}"


@dataclass
class Kernel:
    """One generated kernel: its parameters (inputs then outputs, in launch order), the index
    space (rows, groups, cols) and its body."""

    name: str
    buffers: list[Buffer]
    space: tuple[Dim, int, int]
    body: list[Instr]
    notes: list[str] = field(default_factory=list)  # why the fusion group was formed

    @property
    def inputs(self) -> list[Buffer]:
        return [b for b in self.buffers if b.role == "in"]

    @property
    def outputs(self) -> list[Buffer]:
        return [b for b in self.buffers if b.role == "out"]

    def buffer(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)

    def reductions(self) -> list[Instr]:
        return [i for i in self.body if i.op == "reduce"]

    def text(self) -> str:
        r, g, c = self.space
        head = f"kernel {self.name}({', '.join(map(str, self.buffers))})\n  space [{r}, {g}, {c}]\n"
        notes = "".join(f"  # {n}\n" for n in self.notes)
        return head + notes + "".join(f"  {i.text()}\n" for i in self.body)

    def to_json(self) -> dict:
        return {"name": self.name, "space": list(self.space), "notes": self.notes,
                "buffers": [[b.name, b.dtype, list(b.shape), b.role] for b in self.buffers],
                "body": [[i.out, i.op, list(i.args), i.dtype, i.kind, _attrs_json(i.attrs)] for i in self.body]}

    @staticmethod
    def from_json(d: dict) -> Kernel:
        bufs = [Buffer(n, dt, tuple(s), role) for n, dt, s, role in d["buffers"]]
        body = [Instr(o, op, tuple(a), dt, k, _attrs_parse(at)) for o, op, a, dt, k, at in d["body"]]
        return Kernel(d["name"], bufs, tuple(d["space"]), body, list(d.get("notes", [])))


def _attrs_json(attrs: dict) -> dict:
    return {k: ([v.row, v.group, v.col, v.offset] if isinstance(v, Index) else v) for k, v in attrs.items()}


def _attrs_parse(attrs: dict) -> dict:
    return {k: (Index(*v) if k == "index" else v) for k, v in attrs.items()}


def levels(k: Kernel) -> dict[int, int]:
    """Each value's level: the most reductions on a path into it (a reduction's result is one
    more than its argument's). A renderer that walks a row in column tiles makes one pass per level."""
    lv: dict[int, int] = {}
    for ins in k.body:
        base = max((lv[a] for a in ins.args), default=0)
        lv[ins.out] = base + 1 if ins.op == "reduce" else base
    return lv


def elem_closure(k: Kernel, roots: list[int]) -> set[int]:
    """The elem values (no stores) among `roots` and everything they are computed from: what a
    tile pass recomputes for the reductions and stores that consume `roots`."""
    elem = {i.out: i for i in k.body if i.kind == "elem" and i.op != "store"}
    need, todo = set(), list(roots)
    while todo:
        v = todo.pop()
        if v in elem and v not in need:
            need.add(v)
            todo += elem[v].args
    return need


class KernelError(DeepfuseError):
    """A kernel that breaks the IR's rules (verify): from an artifact, bad input (a ValueError too)."""


def verify(k: Kernel) -> None:
    """Checks SSA order, dtypes (arithmetic in f32), kinds and buffer use; raises KernelError."""
    names = [b.name for b in k.buffers]
    if len(set(names)) != len(names):
        raise KernelError(f"{k.name}: duplicate buffer names {names}")
    seen: dict[int, Instr] = {}
    stored = set()
    for ins in k.body:
        where = f"{k.name}: {ins.text()}"
        for a in ins.args:
            if a not in seen:
                raise KernelError(f"{where}: %{a} is used before it is defined")
        args = [seen[a] for a in ins.args]
        elem = any(a.kind == "elem" for a in args)
        if ins.op == "load":
            buf = k.buffer(ins.attrs["buf"])
            if buf.role != "in" or ins.dtype != buf.dtype or ins.kind != ins.attrs["index"].kind:
                raise KernelError(f"{where}: does not match buffer {buf}")
        elif ins.op == "store":
            buf = k.buffer(ins.attrs["buf"])
            if buf.role != "out" or args[0].dtype != buf.dtype:
                raise KernelError(f"{where}: stores {args[0].dtype} into {buf}")
            stored.add(buf.name)
            continue
        elif ins.op in UNARY + BINARY:
            if any(a.dtype != "f32" for a in args) or ins.dtype != "f32":
                raise KernelError(f"{where}: arithmetic is f32 only")
        elif ins.op in COMPARE:
            if any(a.dtype != "f32" for a in args) or ins.dtype != "bool":
                raise KernelError(f"{where}: compares f32 values into bool")
        elif ins.op == "where":
            if args[0].dtype != "bool" or not args[1].dtype == args[2].dtype == ins.dtype:
                raise KernelError(f"{where}: where(bool, a, b) with a, b of one dtype")
        elif ins.op == "reduce":
            if ins.kind != "row" or args[0].kind != "elem" or ins.attrs["kind"] not in REDUCE:
                raise KernelError(f"{where}: a reduction turns an elem value into a row value")
        elif ins.op == "round":
            if args[0].dtype != "f32" or ins.dtype != "f32" or ins.attrs["to"] not in ("bf16", "f16"):
                raise KernelError(f"{where}: round takes f32 to bf16 or f16 precision")
        elif ins.op == "cast":
            src, to = args[0].dtype, ins.attrs.get("to")
            ok = to == ins.dtype and (to == "f32" and src in ("f32", "bf16", "f16", "bool", "i32")
                                      or to in ("bf16", "f16") and src == "f32")
            if not ok:
                raise KernelError(f"{where}: a cast widens bf16/f16/bool/i32 to f32 or narrows f32 to bf16/f16")
        elif ins.op not in ("const", "col"):
            raise KernelError(f"{where}: unknown op {ins.op!r}")
        if ins.out in seen:
            raise KernelError(f"{where}: %{ins.out} is defined twice")
        if ins.op not in ("load", "const", "col", "reduce") and ins.kind != ("elem" if elem else "row"):
            raise KernelError(f"{where}: kind should be {'elem' if elem else 'row'}")
        seen[ins.out] = ins
    missing = {b.name for b in k.outputs} - stored
    if missing:
        raise KernelError(f"{k.name}: outputs never stored: {sorted(missing)}")
    for ins in k.body:
        if ins.op in ("load", "store"):
            check_bounds(k, k.buffer(ins.attrs["buf"]), ins.attrs["index"], ins.text())


def check_bounds(k: Kernel, buf: Buffer, ix: Index, what: str) -> None:
    """Every (r, g, c) of the space addresses an element inside `buf`, for every row count: a
    kernel (from an artifact, say) cannot read or write outside its buffers."""
    rows, groups, cols = k.space
    if not (isinstance(groups, int) and isinstance(cols, int) and groups >= 1 and cols >= 1):
        raise KernelError(f"{k.name}: the space's groups and columns must be positive ints, got {k.space}")
    if min(ix.row, ix.group, ix.col, ix.offset) < 0:
        raise KernelError(f"{k.name}: {what}: negative index terms")
    per_row = 1
    for d in buf.shape[1:]:
        if not isinstance(d, int):
            raise KernelError(f"{k.name}: {buf} has a symbolic dim past its first")
        per_row *= d
    inner = ix.group * (groups - 1) + ix.col * (cols - 1) + ix.offset  # the largest offset within a row
    if buf.shape and buf.shape[0] == rows and isinstance(rows, str):
        ok = ix.row <= per_row and inner < per_row  # row r stays in the buffer's row r (or earlier ones)
    else:
        numel = per_row * (buf.shape[0] if buf.shape else 1)
        if not buf.shape or isinstance(buf.shape[0], str):
            ok = False if buf.shape else inner < 1 and ix.row == 0
        else:
            last_row = (rows - 1) if isinstance(rows, int) else None
            ok = last_row is not None and ix.row * last_row + inner < numel or ix.row == 0 and inner < numel
    if not ok:
        raise KernelError(f"{k.name}: {what}: the index can leave {buf}")
