"""The generated-kernel renderer's pass over the kernel IR body (see emit_generated.py): the C++
of each stage (Init, CopyIn, Compute, CopyOut), the UB buffers it asks for, the linear-scan
allocation of elem values to pool tensors, and row values as 32-byte slots or scalars."""
from __future__ import annotations

from ...kernel.ir import Kernel
from .generated_math import BINARY, CMP_C, CMPMODE, f32, unary, with_scalar
from .kernel import BLOCK, CTYPE, SIZE, align, cdiv, copy_row

REPEAT = 64  # f32 elements in one 256-byte repeat


class Render:
    """One pass over the body: C++ for each stage, the UB it needs."""

    def __init__(self, k: Kernel, name: str):
        self.k, self.name = k, name
        _, self.g, self.c = k.space
        self.cp = cdiv(self.c, REPEAT) * REPEAT
        self.gm = {b.name: f"gm{i}" for i, b in enumerate(k.buffers)}
        self.init, self.copy_in, self.compute, self.copy_out, self.members = [], [], [], [], []
        self.ub = 0  # bytes of UB asked for
        self.val: dict[int, tuple] = {}  # SSA -> where its value is
        self.free = {"w": [], "m": []}  # free pool tensors
        self.count = {"w": 0, "m": 0, "r": 0, "o": 0}
        self.queued_in: list[str] = []
        self.pending_free: list[str] = []
        self.reduce = False
        # the counts vector instructions run over (Compare: whole repeats) and the column offset of
        # elem loads / stores: the whole row here; C++ names over one column tile in TiledRender
        self.n, self.np, self.c0 = self.c, self.cp, ""

    # ---- storage ---------------------------------------------------------------------
    def buf(self, name: str, nbytes: int, tbuf: bool = True, queue: str = "") -> None:
        kind = f"TQue<QuePosition::{queue}, BUFFER_NUM>" if queue else "TBuf<QuePosition::VECCALC>"
        self.members.append(f"    {kind} {name};\n")
        self.init.append(f"pipe.InitBuffer({name}, {'BUFFER_NUM, ' if queue else ''}{nbytes});")
        self.ub += align(nbytes) * (1 if tbuf else 2)

    def alloc(self, pool: str) -> str:
        if self.free[pool]:
            return self.free[pool].pop()
        self.count[pool] += 1
        return f"{pool}[{(self.count[pool] - 1) * (self.cp if pool == 'w' else self.mask_bytes)}]"

    @property
    def mask_bytes(self) -> int:
        return align(self.cp // 8)

    def row_slot(self) -> str:
        self.count["r"] += 1
        return f"rw[{8 * (self.count['r'] - 1)}]"

    def scratch(self, row: bool):
        """A scratch allocator for one instruction (its tensors go back after it)."""
        taken = []

        def get():
            taken.append(None if row else self.alloc("w"))
            return self.row_slot() if row else taken[-1]
        return get, taken

    def release(self, taken) -> None:
        self.free["w"] += [t for t in taken if t is not None]

    def index(self, ix) -> str:
        terms = [f"(uint64_t)r * {ix.row}" if ix.row else "", f"g * {ix.group}" if ix.group else "",
                 str(ix.offset) if ix.offset else "", self.c0 if ix.col else ""]
        return " + ".join(t for t in terms if t) or "0"

    def copy(self, dst: str, src: str, size: int, to_gm: bool, ct: str = "float") -> str:
        """DataCopy / DataCopyPad of the row's (or tile's) n elements."""
        return copy_row(dst, src, self.c, size, to_gm, ct)

    def in_queue(self, size: int) -> str:
        """A new double-buffered VECIN queue for one elem load."""
        q = f"inQ{len(self.queued_in)}"
        self.queued_in.append(q)
        self.buf(q, self.cp * size, tbuf=False, queue="VECIN")
        return q

    # ---- values -------------------------------------------------------------------------
    def scalar(self, v: int) -> str:
        """A row value as a C++ scalar expression (read after the vector pipe when it is a slot)."""
        form = self.val[v]
        if form[0] == "scalar":
            return form[1]
        self.emit("WaitPipe<HardEvent::V_S>();", f"float s{v} = {form[1]}.GetValue(0);")
        self.val[v] = ("scalar", f"s{v}", form[1])
        return f"s{v}"

    def slot(self, v: int) -> str:
        """A row value as a 1-element UB tensor (Duplicate of its scalar if it has none)."""
        form = self.val[v]
        if form[0] == "slot":
            return form[1]
        if len(form) == 3:
            return form[2]
        s = self.row_slot()
        self.emit(f"Duplicate({s}, {form[1]}, 1);")
        self.val[v] = ("scalar", form[1], s)
        return s

    def tensor(self, v: int) -> str:
        return self.val[v][1]

    def emit(self, *lines: str) -> None:
        self.compute += lines

    def fail(self, what: str):
        raise ValueError(f"{self.name} ({self.k.name}): the AscendC renderer {what}")

    # ---- the body --------------------------------------------------------------------------
    def walk(self) -> None:
        body, alias, last = self.k.body, {}, {}
        for i, ins in enumerate(body):
            for a in ins.args:
                last[alias.get(a, a)] = i
            if ins.op == "cast" and ins.attrs["to"] in ("bf16", "f16"):
                alias[ins.out] = alias.get(ins.args[0], ins.args[0])  # rendered by its stores
        for i, ins in enumerate(body):
            getattr(self, "op_" + ins.op, self.op_math)(ins)
            dead = {alias.get(a, a) for a in ins.args if last.get(alias.get(a, a)) == i}
            if ins.out >= 0 and ins.out not in alias and ins.out not in last:
                dead.add(ins.out)
            for v in dead:
                self.drop(v)
        self.compute += [f"{q}.FreeTensor({t});" for q, t in self.pending_free]

    def drop(self, v: int) -> None:
        form = self.val[v]
        if form[0] == "elem" and form[2] == "w":
            self.free["w"].append(form[1])
        elif form[0] == "elem" and form[2].startswith("inQ"):
            self.pending_free.remove((form[2], form[1]))
            self.emit(f"{form[2]}.FreeTensor({form[1]});")
        elif form[0] == "mask":
            self.free["m"].append(form[1])

    def op_load(self, ins) -> None:
        ix, b = ins.attrs["index"], self.k.buffer(ins.attrs["buf"])
        gm, ct, size = self.gm[b.name], CTYPE.get(b.dtype), SIZE.get(b.dtype)
        if ct is None or b.dtype == "i64":
            self.fail(f"does not load {b.dtype} buffers ({b.name})")
        if ix.col == 0:
            if b.dtype != "f32":
                self.fail(f"loads row values from f32 buffers only ({b.name} is {b.dtype})")
            self.emit(f"float s{ins.out} = {gm}.GetValue({self.index(ix)});")
            self.val[ins.out] = ("scalar", f"s{ins.out}")
        elif ix.col != 1:
            self.fail(f"does not load with a column stride of {ix.col} ({b.name})")
        elif ix.row == 0 and ix.group == 0 and not self.c0:  # a [C] weight: once, in Init, as f32
            n = len(self.members)
            self.buf(f"wt{n}", self.cp * 4)
            src = f"{gm}[{ix.offset}]"
            if b.dtype == "f32":
                self.init += [copy_row(f"wt{n}.Get<float>()", src, self.c, 4, False), "WaitPipe<HardEvent::MTE2_V>();"]
            else:
                self.buf(f"wraw{n}", self.cp * size)
                self.init += [copy_row(f"wraw{n}.Get<{ct}>()", src, self.c, size, False, ct),
                              "WaitPipe<HardEvent::MTE2_V>();",
                              f"Cast(wt{n}.Get<float>(), wraw{n}.Get<{ct}>(), RoundMode::CAST_NONE, {self.n});"]
            self.val[ins.out] = ("elem", f"wt{n}.Get<float>()", "weight")
        else:
            q = self.in_queue(size)
            self.copy_in += [f"LocalTensor<{ct}> x = {q}.AllocTensor<{ct}>();".replace(" x ", f" {q}x "),
                             self.copy(f"{q}x", f"{gm}[{self.index(ix)}]", size, False, ct),
                             f"{q}.EnQue({q}x);"]
            self.emit(f"LocalTensor<{ct}> {q}x = {q}.DeQue<{ct}>();")
            self.pending_free.append((q, f"{q}x"))
            self.val[ins.out] = ("elem", f"{q}x", q)

    def op_const(self, ins) -> None:
        v = ins.attrs["value"]
        text = f32(v) if ins.dtype == "f32" else ("true" if v else "false") if ins.dtype == "bool" else str(int(v))
        self.val[ins.out] = ("scalar", text)

    def op_col(self, ins) -> None:
        self.fail("has no column index (col) yet")

    def op_cast(self, ins) -> None:
        to, a = ins.attrs["to"], ins.args[0]
        if to in ("bf16", "f16"):
            self.val[ins.out] = ("cast", a, to)
        elif to != "f32" or self.val[a][0] != "elem":
            self.fail(f"does not cast {ins.kind} values to {to}")
        elif self.val[a][2] == "weight":
            self.val[ins.out] = self.val[a]
        else:
            d = self.alloc("w")
            self.emit(f"Cast({d}, {self.tensor(a)}, RoundMode::CAST_NONE, {self.n});")
            self.val[ins.out] = ("elem", d, "w")

    def op_round(self, ins) -> None:
        ct, a = CTYPE[ins.attrs["to"]], ins.args[0]
        self.half = max(getattr(self, "half", 0), self.cp * 2)
        d, src, n = (self.alloc("w"), self.tensor(a), self.n) if ins.kind == "elem" else (self.row_slot(), self.slot(a), 1)
        self.emit(f"Cast(halfBuf.Get<{ct}>(), {src}, RoundMode::CAST_RINT, {n});",
                  f"Cast({d}, halfBuf.Get<{ct}>(), RoundMode::CAST_NONE, {n});")
        self.val[ins.out] = ("elem", d, "w") if ins.kind == "elem" else ("slot", d)

    def op_reduce(self, ins) -> None:
        kind, a = ins.attrs["kind"], self.tensor(ins.args[0])
        self.reduce, d = True, self.row_slot()
        fn = {"sum": "ReduceSum", "min": "ReduceMin"}.get(kind, "ReduceMax")
        self.emit(f"{fn}({d}, {a}, reduceBuf.Get<float>(), {self.n}{', true' if kind == 'argmax' else ''});")
        if kind == "argmax":  # the index's bits in the second lane
            self.emit("WaitPipe<HardEvent::V_S>();",
                      f"int32_t s{ins.out} = rw.ReinterpretCast<int32_t>().GetValue({8 * (self.count['r'] - 1) + 1});")
            self.val[ins.out] = ("scalar", f"s{ins.out}")
        else:
            self.val[ins.out] = ("slot", d)

    def op_math(self, ins) -> None:
        kinds = [self.val[a][0] for a in ins.args]
        if ins.op == "where":
            return self._where(ins, kinds)
        elem = "elem" in kinds
        if ins.op in CMPMODE and not elem:  # row compare: on the scalar unit
            a, b = (self.scalar(x) for x in ins.args)
            self.emit(f"bool s{ins.out} = ({a}) {CMP_C[ins.op]} ({b});")
            self.val[ins.out] = ("scalar", f"s{ins.out}")
            return
        get, taken = self.scratch(row=not elem)
        if ins.op in CMPMODE:  # both operands as tensors of Cp elements; the mask
            ts = []
            for x, kind in zip(ins.args, kinds):
                if kind == "elem":
                    ts.append(self.tensor(x))
                else:
                    ts.append(get())
                    self.emit(f"Duplicate({ts[-1]}, {self.scalar(x)}, {self.np});")
            d = self.alloc("m")
            self.emit(f"Compare({d}, {ts[0]}, {ts[1]}, CMPMODE::{CMPMODE[ins.op]}, {self.np});")
            self.val[ins.out] = ("mask", d)
        elif not elem:
            d = self.row_slot()
            args = [self.slot(a) for a in ins.args]
            lines = (unary(ins.op, d, args[0], 1, get) if len(args) == 1
                     else [f"{BINARY[ins.op]}({d}, {args[0]}, {args[1]}, 1);"])
            self.emit(*lines)
            self.val[ins.out] = ("slot", d)
        else:
            d = self.alloc("w")
            if len(ins.args) == 1:
                self.emit(*unary(ins.op, d, self.tensor(ins.args[0]), self.n, get))
            elif kinds == ["elem", "elem"]:
                self.emit(f"{BINARY[ins.op]}({d}, {self.tensor(ins.args[0])}, {self.tensor(ins.args[1])}, {self.n});")
            else:
                first = kinds[0] == "elem"
                t, s = (ins.args[0], ins.args[1]) if first else (ins.args[1], ins.args[0])
                self.emit(*with_scalar(ins.op, d, self.tensor(t), self.scalar(s), first, self.n, get))
            self.val[ins.out] = ("elem", d, "w")
        self.release(taken)

    def _where(self, ins, kinds) -> None:
        m, a, b = ins.args
        if "elem" not in kinds:
            c, x, y = (self.scalar(v) for v in ins.args)
            self.emit(f"float s{ins.out} = ({c}) ? ({x}) : ({y});")
            self.val[ins.out] = ("scalar", f"s{ins.out}")
            return
        if kinds[0] != "mask" or ins.dtype != "f32":
            self.fail("selects f32 values by an elem mask only")
        get, taken = self.scratch(row=False)
        if kinds[1] == "elem":
            x = self.tensor(a)
        else:
            x = get()
            self.emit(f"Duplicate({x}, {self.scalar(a)}, {self.n});")
        d, mask = self.alloc("w"), self.tensor(m)
        if kinds[2] == "elem":
            self.emit(f"Select({d}, {mask}, {x}, {self.tensor(b)}, SELMODE::VSEL_TENSOR_TENSOR_MODE, {self.n});")
        else:
            self.emit(f"Select({d}, {mask}, {x}, {self.scalar(b)}, SELMODE::VSEL_TENSOR_SCALAR_MODE, {self.n});")
        self.val[ins.out] = ("elem", d, "w")
        self.release(taken)

    def op_store(self, ins) -> None:
        ix, b, v = ins.attrs["index"], self.k.buffer(ins.attrs["buf"]), ins.args[0]
        gm, ct, size, form = self.gm[b.name], CTYPE.get(b.dtype), SIZE.get(b.dtype), self.val[v]
        if ct is None or b.dtype == "i64":
            self.fail(f"does not store {b.dtype} buffers ({b.name})")
        j = self.count["o"]
        self.count["o"] += 1
        if ix.col == 0:  # a row value: through a 32-byte TBuf slot
            if form[0] not in ("scalar", "slot"):
                self.fail(f"stores row values only where the index has no column ({b.name})")
            s = self.scalar(v)
            self.buf(f"rowOut{j}", BLOCK)
            self.emit(f"LocalTensor<{ct}> ro{j} = rowOut{j}.Get<{ct}>();", "WaitPipe<HardEvent::MTE3_S>();",
                      f"ro{j}.SetValue(0, ({ct})({s}));", "WaitPipe<HardEvent::S_MTE3>();",
                      f"DataCopyPad({gm}[{self.index(ix)}], ro{j}, DataCopyExtParams{{1, {size}, 0, 0, 0}});")
            return
        if ix.col != 1:
            self.fail(f"does not store with a column stride of {ix.col} ({b.name})")
        q = f"outQ{j}"
        self.buf(q, self.cp * size, tbuf=False, queue="VECOUT")
        self.emit(f"LocalTensor<{ct}> {q}y = {q}.AllocTensor<{ct}>();")
        if form[0] == "cast":
            self.emit(f"Cast({q}y, {self.tensor(form[1])}, RoundMode::CAST_RINT, {self.n});")
        elif b.dtype != "f32":
            self.fail(f"stores {b.dtype} only through a cast")
        elif form[0] == "elem":
            self.emit(f"Muls({q}y, {form[1]}, 1.0f, {self.n});")  # an exact vector copy
        else:
            self.emit(f"Duplicate({q}y, {self.scalar(v)}, {self.n});")
        self.emit(f"{q}.EnQue({q}y);")
        self.copy_out += [f"LocalTensor<{ct}> {q}y = {q}.DeQue<{ct}>();",
                          self.copy(f"{gm}[{self.index(ix)}]", f"{q}y", size, True), f"{q}.FreeTensor({q}y);"]
