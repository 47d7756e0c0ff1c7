"""The Triton renderer of the kernel IR (deepfuse/kernel): one `kernel` node -> one kernel spec.

A program owns a block of BR rows of one group g (grid: cdiv(R, BR) x G) and a tile of BC
columns: elem values are [BR, BC] tensors (or [1, BC] when the index has no row term, e.g. a
weight vector, loaded once per program), row values [BR, 1]. Loads and stores mask the row tail
(r < R) and the column tail (c < C).

Two shapes of code, chosen by C:
- C <= MAX_TILE: one tile holds the whole row (BC = next pow2 of C); the body is emitted in
  order, and BR = 2048 // BC rows (at most 16) share a program, so narrow rows (head_dim 32,
  hidden 96) still fill the warps with 16 elements per thread.
- C > MAX_TILE (a vocabulary softmax): BR = 1 and columns go in tiles of LOOP_TILE, in passes.
  A value's level is how many reductions lie under it; pass p recomputes the elem values that
  the reductions and stores of level p need, tile by tile, accumulating each reduction in a
  [BR, BC] vector that is folded after the loop (argmax keeps each lane's first maximum, then
  the smallest column among the lanes that hold the row's maximum: the first maximum).
MAX_TILE = 8192: with 16 warps that is 16 f32 per thread per live value; the gelu-glu body
keeps about six live, which stays inside the register file (tests check the PTX for .local).

Masked lanes enter reductions as their neutral element (sum 0, max -inf, min +inf). Math as the
interpreter does it: sqrt, div and recip round correctly (sqrt_rn, div_rn); exp, log, rsqrt,
sigmoid and erf are Triton's; tanh is 2*sigmoid(2x)-1, with its odd series for |x| < 1/16 where
that form cancels. Rounding to bf16 is done on the bits (nearest even): Triton's CPU
interpreter truncates in `.to(tl.bfloat16)`, the GPU rounds; the bit form is exact on both.
The helpers are decorated `@triton.jit(noinline=False)`: runner.load_kernel strips the plain
"@triton.jit" line of the kernel only (so AOT gets the bare function); helpers must stay jitted.
"""
from __future__ import annotations

from ...ir import Node
from ...kernel.ir import Index, Instr, Kernel, elem_closure, levels
from . import templates as T
from .tiles import tiles_for

MAX_TILE, LOOP_TILE, ROW_TILE = 8192, 4096, 2048
PTR = {"f32": "*fp32", "bf16": "*bf16", "f16": "*fp16", "i32": "*i32", "i64": "*i64", "bool": "*i1"}
TL = {"f32": "tl.float32", "bf16": "tl.bfloat16", "f16": "tl.float16", "i32": "tl.int32", "i64": "tl.int64",
      "bool": "tl.int1"}
UNARY = {"neg": "-{0}", "abs": "tl.abs({0})", "exp": "tl.exp({0})", "log": "tl.log({0})", "sqrt": "tl.sqrt_rn({0})",
         "rsqrt": "tl.rsqrt({0})", "tanh": "_tanh({0})", "erf": "tl.erf({0})", "sigmoid": "tl.sigmoid({0})",
         "recip": "tl.div_rn(1.0, {0})"}
BINARY = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "tl.div_rn({0}, {1})",
          "max": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
          "min": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
          "lt": "{0} < {1}", "le": "{0} <= {1}", "gt": "{0} > {1}", "ge": "{0} >= {1}", "eq": "{0} == {1}",
          "ne": "{0} != {1}"}
NEUTRAL = {"sum": "0.0", "max": '-float("inf")', "min": 'float("inf")', "argmax": '-float("inf")'}
HELPERS = {
    "_tanh": '''@triton.jit(noinline=False)
def _tanh(x):
    x2 = x * x
    series = x + x * x2 * (-0.3333333432674408 + x2 * 0.13333334028720856)
    return tl.where(tl.abs(x) < 0.0625, series, 2.0 * tl.sigmoid(2.0 * x) - 1.0)
''',
    "_rne_bf16": '''@triton.jit(noinline=False)
def _rne_bf16(x):
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return tl.where(x == x, u.to(tl.float32, bitcast=True), x)
''',
}


def with_helpers(src: str) -> str:
    """src with the definitions of the HELPERS it calls, before its kernel (once each)."""
    helpers = "".join(h + "\n\n" for n, h in HELPERS.items() if n + "(" in src and f"def {n}(" not in src)
    return src.replace("@triton.jit\ndef ", helpers + "@triton.jit\ndef ", 1) if helpers else src


def row_binding(k: Kernel) -> list | None:
    """The row count's argument form: ["shape", input, axis] of the first input naming the row
    symbol, ["const", R] for a fixed R, None when no input binds it."""
    r = k.space[0]
    if isinstance(r, int):
        return ["const", r]
    for i, b in enumerate(k.inputs):
        if r in b.shape:
            return ["shape", i, list(b.shape).index(r)]
    return None


def renderable(node: Node) -> bool:
    """Whether emit_kernel can render the node (else its reference runs on the device)."""
    k = Kernel.from_json(node.attrs["kernel"])
    return row_binding(k) is not None and all(b.dtype in PTR for b in k.buffers)


def _const(ins: Instr) -> str:
    v = ins.attrs["value"]
    if ins.dtype == "bool":
        return repr(bool(v))
    if ins.dtype == "f32":
        v = float(v)
        v = repr(v) if v == v and abs(v) != float("inf") else f'float("{v}")'
    return f"tl.full([1, 1], {v}, {TL[ins.dtype]})"


def _expr(ins: Instr, a: list[str], src: str) -> str:
    """The Triton expression of a pointwise instruction over its argument names (src: the first
    argument's dtype)."""
    if ins.op == "const":
        return _const(ins)
    if ins.op == "col":
        return "cols"
    if ins.op in UNARY:
        return UNARY[ins.op].format(*a)
    if ins.op in BINARY:
        return BINARY[ins.op].format(*a)
    if ins.op == "where":
        return f"tl.where({a[0]}, {a[1]}, {a[2]})"
    to = ins.attrs["to"]
    if ins.op == "round":
        return f"_rne_bf16({a[0]})" if to == "bf16" else f"{a[0]}.to({TL[to]}).to(tl.float32)"
    if ins.op == "cast":
        return f"_rne_bf16({a[0]}).to(tl.bfloat16)" if to == "bf16" and src == "f32" else f"{a[0]}.to({TL[to]})"
    raise ValueError(f"no Triton form for {ins.op!r}")


def _ptr(ix: Index, p: str) -> tuple[str, str]:
    """(pointer expression, mask expression or "") of an index into parameter p."""
    terms = [f"rb * {ix.row}"] if ix.row else []
    terms += [f"g * {ix.group}"] if ix.group else []
    terms += ["cols" if ix.col == 1 else f"cols * {ix.col}"] if ix.col else []
    terms += [str(ix.offset)] if ix.offset else []
    mask = " & ".join((["rm"] if ix.row else []) + (["cm"] if ix.col else []))
    return f"{p} + ({' + '.join(terms)})" if terms else p, mask


class _Body:
    """Emits instructions as Triton lines; `params` maps buffer names to parameter names."""

    def __init__(self, k: Kernel, params: dict[str, str]):
        self.k, self.params, self.lines = k, params, []
        self.dtype = {i.out: i.dtype for i in k.body}

    def put(self, line: str, depth: int) -> None:
        self.lines.append("    " * depth + line)

    def instr(self, ins: Instr, depth: int) -> None:
        a = [f"v{x}" for x in ins.args]
        if ins.op == "load":
            ptr, mask = _ptr(ins.attrs["index"], self.params[ins.attrs["buf"]])
            self.put(f"v{ins.out} = tl.load({ptr}" + (f", mask={mask}, other=0)" if mask else ")"), depth)
        elif ins.op == "store":
            ptr, mask = _ptr(ins.attrs["index"], self.params[ins.attrs["buf"]])
            self.put(f"tl.store({ptr}, {a[0]}" + (f", mask={mask})" if mask else ")"), depth)
        elif ins.op != "reduce":
            self.put(f"v{ins.out} = {_expr(ins, a, self.dtype.get(ins.args[0]) if ins.args else '')}", depth)

    def reduce_tile(self, ins: Instr, depth: int) -> None:
        """A reduction of one whole-row tile."""
        x, kind, o = f"v{ins.args[0]}", ins.attrs["kind"], f"v{ins.out}"
        self.put(f"m{o} = tl.where(cm, {x}, {NEUTRAL[kind]})", depth)
        if kind == "argmax":
            self.put(f"t{o} = tl.max(m{o}, 1, keep_dims=True)", depth)
            self.put(f"{o} = tl.min(tl.where(m{o} == t{o}, cols, BC), 1, keep_dims=True)", depth)
        else:
            self.put(f"{o} = tl.{kind}(m{o}, 1, keep_dims=True)", depth)

    def reduce_init(self, ins: Instr, depth: int) -> None:
        o, kind = f"v{ins.out}", ins.attrs["kind"]
        self.put(f"a{o} = tl.full([BR, BC], {NEUTRAL[kind]}, tl.float32)", depth)
        if kind == "argmax":
            self.put(f"i{o} = tl.zeros([BR, BC], tl.int32)", depth)

    def reduce_step(self, ins: Instr, depth: int) -> None:
        x, kind, o = f"v{ins.args[0]}", ins.attrs["kind"], f"v{ins.out}"
        masked = f"tl.where(cm, {x}, {NEUTRAL[kind]})"
        if kind == "sum":
            self.put(f"a{o} += {masked}", depth)
        elif kind in ("max", "min"):
            self.put(f"a{o} = tl.{'maximum' if kind == 'max' else 'minimum'}(a{o}, {masked})", depth)
        else:  # strictly greater: each lane keeps its first maximum
            self.put(f"m{o} = {masked}", depth)
            self.put(f"i{o} = tl.where(m{o} > a{o}, cols, i{o})", depth)
            self.put(f"a{o} = tl.maximum(a{o}, m{o})", depth)

    def reduce_fold(self, ins: Instr, depth: int) -> None:
        o, kind = f"v{ins.out}", ins.attrs["kind"]
        if kind == "argmax":
            self.put(f"t{o} = tl.max(a{o}, 1, keep_dims=True)", depth)
            self.put(f"{o} = tl.min(tl.where(a{o} == t{o}, i{o}, {self.k.space[2]}), 1, keep_dims=True)", depth)
        else:
            self.put(f"{o} = tl.{kind}(a{o}, 1, keep_dims=True)", depth)



def _tiled(b: _Body) -> None:
    """The whole row in one tile: the body in order."""
    b.put("cols = tl.arange(0, BC)[None, :]", 1)
    b.put(f"cm = cols < {b.k.space[2]}", 1)
    for ins in b.k.body:
        b.reduce_tile(ins, 1) if ins.op == "reduce" else b.instr(ins, 1)


def _looped(b: _Body) -> None:
    """Column tiles in passes, one per level (module docstring)."""
    k, lv = b.k, levels(b.k)
    in_tile = [i for i in k.body if i.op == "reduce" or (i.op == "store" and i.attrs["index"].kind == "elem")]
    at = lambda i: lv[i.args[0]]  # the pass a tile consumer runs in
    passes = max((at(i) for i in in_tile), default=-1) + 1
    for p in range(passes + 1):
        for ins in k.body:  # the row values this pass needs: their reductions are done
            if ins.kind == "row" and ins.op not in ("reduce", "store") and (lv[ins.out] == p if p < passes
                                                                            else lv[ins.out] >= passes):
                b.instr(ins, 1)
        if p == passes:
            break
        users = [i for i in in_tile if at(i) == p]
        need = elem_closure(k, [i.args[0] for i in users])
        for ins in users:
            if ins.op == "reduce":
                b.reduce_init(ins, 1)
        b.put(f"for c0 in range(0, {k.space[2]}, BC):", 1)
        b.put("cols = c0 + tl.arange(0, BC)[None, :]", 2)
        b.put(f"cm = cols < {k.space[2]}", 2)
        for ins in k.body:
            if ins.out in need:
                b.instr(ins, 2)
            elif ins in users:
                b.reduce_step(ins, 2) if ins.op == "reduce" else b.instr(ins, 2)
        for ins in users:
            if ins.op == "reduce":
                b.reduce_fold(ins, 1)
    for ins in k.body:
        if ins.op == "store" and ins.attrs["index"].kind == "row":
            b.instr(ins, 1)


def emit_kernel(node: Node, name: str, arch: str) -> list[dict]:
    """One spec for a `kernel` node (attrs["kernel"]: the kernel IR as JSON)."""
    k = Kernel.from_json(node.attrs["kernel"])
    _, groups, c = k.space
    params = {bf.name: f"p{i}" for i, bf in enumerate(k.buffers)}
    looped = c > MAX_TILE
    bc = LOOP_TILE if looped else 1 << max(0, (c - 1).bit_length())
    br = 1 if looped else max(1, min(16, ROW_TILE // bc))
    b = _Body(k, params)
    b.put("rows = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]", 1)
    b.put("rm = rows < R", 1)
    b.put("rb = rows.to(tl.int64)", 1)
    b.put("g = tl.program_id(1)", 1)
    (_looped if looped else _tiled)(b)
    body = "\n".join(b.lines)
    helpers = "".join(h + "\n\n" for n, h in HELPERS.items() if n + "(" in body)
    sig = ", ".join(params.values())
    source = (T.HEADER + helpers + f"@triton.jit\ndef {name}({sig}, R, BR: tl.constexpr, BC: tl.constexpr):\n"
              + body + "\n")
    ins_i = {bf.name: i for i, bf in enumerate(k.inputs)}
    outs_j = {bf.name: j for j, bf in enumerate(k.outputs)}
    forms = [["in", ins_i[bf.name]] if bf.role == "in" else ["out", outs_j[bf.name]] for bf in k.buffers]
    rows = row_binding(k)
    num_warps = 8 if looped else min(16, max(4, br * bc // 512))
    signature = {params[bf.name]: PTR[bf.dtype] for bf in k.buffers} | {"R": "i32", "BR": "constexpr",
                                                                        "BC": "constexpr"}
    return [{"name": name, "source": source, "signature": signature, "args": forms + [rows],
             "constexprs": {"BR": br, "BC": bc}, "grid": [["cdiv", rows, br], groups, 1],
             "num_warps": num_warps, "num_stages": tiles_for(arch, "row", node).get("num_stages", 1)}]
