"""Column tiling for the generated AscendC kernel (emit_generated.py) when a whole row does not fit
the unified buffer: the row's C columns go through UB in tiles of TC (a multiple of 64, so every
tile but the last is whole 256-byte repeats; Compare runs over the tail rounded up to them).

As the Triton renderer's looped mode: a value's level is how many reductions lie under it; pass p
recomputes, tile by tile, the elem values that the reductions and elem stores of level p need,
and the row values of level p + 1 are computed between the passes (row stores come last). A
reduction accumulates across tiles in a scalar: sum adds each tile's ReduceSum (so the f32 sum is
in another order than the whole row's), max / min keep the larger / smaller tile result, argmax
the first maximum (a later tile replaces it only when strictly greater). Inside a pass everything
runs in one function, tile after tile: CopyIn, Compute, CopyOut of the tile."""
from __future__ import annotations

from ...kernel.ir import Kernel, elem_closure, levels
from .generated_render import REPEAT, Render
from .kernel import LOWEST

INIT = {"sum": "0.0f", "max": LOWEST, "argmax": LOWEST, "min": "3.402823466e+38f"}



class TiledRender(Render):
    """The body in passes over column tiles of `tc` elements; its C++ is `self.row` (one row)."""

    def __init__(self, k: Kernel, name: str, tc: int):
        super().__init__(k, name)
        self.cp, self.tc = tc, tc  # pool tensors, queues and masks hold one tile
        self.n, self.np, self.c0 = "n", "np", "c0"
        self.row: list[str] = []  # the C++ of Row(row)
        self.queues: list[str] = []  # VECIN queues, reused by every pass
        self.pre: list[str] = []  # a pass's accumulator declarations

    def copy(self, dst: str, src: str, size: int, to_gm: bool, ct: str = "float") -> str:
        params = f"DataCopyExtParams{{1, n * {size}, 0, 0, 0}}"
        if to_gm:
            return f"DataCopyPad({dst}, {src}, {params});"
        return f"DataCopyPad({dst}, {src}, {params}, DataCopyPadExtParams<{ct}>{{false, 0, 0, 0}});"

    def in_queue(self, size: int) -> str:
        i = len(self.queued_in)
        self.queued_in.append(f"inQ{i}")
        if i == len(self.queues):  # f32-sized: any load dtype fits it
            self.queues.append(f"inQ{i}")
            self.buf(f"inQ{i}", self.cp * 4, tbuf=False, queue="VECIN")
        return f"inQ{i}"

    def op_reduce(self, ins) -> None:
        kind, a, o = ins.attrs["kind"], self.tensor(ins.args[0]), ins.out
        self.reduce, d = True, self.row_slot()
        fn = {"sum": "ReduceSum", "min": "ReduceMin"}.get(kind, "ReduceMax")
        self.pre.append(f"float acc{o} = {INIT[kind]};")
        self.emit(f"{fn}({d}, {a}, reduceBuf.Get<float>(), n{', true' if kind == 'argmax' else ''});",
                  "WaitPipe<HardEvent::V_S>();", f"float m{o} = {d}.GetValue(0);")
        self.val[o] = ("scalar", f"acc{o}")  # read after the loop (tile_pass)
        if kind == "sum":
            self.emit(f"acc{o} += m{o};")
        elif kind == "argmax":
            self.pre.append(f"int32_t idx{o} = 0;")
            lane = 8 * (self.count["r"] - 1) + 1
            self.emit(f"if (c0 == 0 || m{o} > acc{o}) {{",
                      f"    acc{o} = m{o};",
                      f"    idx{o} = (int32_t)c0 + rw.ReinterpretCast<int32_t>().GetValue({lane});", "}")
        else:
            self.emit(f"if (c0 == 0 || m{o} {'>' if kind == 'max' else '<'} acc{o}) acc{o} = m{o};")

    def walk(self) -> None:
        k, lv = self.k, levels(self.k)
        in_tile = [i for i in k.body if i.op == "reduce" or (i.op == "store" and i.attrs["index"].kind == "elem")]
        at = lambda i: lv[i.args[0]]  # noqa: E731 (the pass a tile consumer runs in)
        passes = max((at(i) for i in in_tile), default=-1) + 1
        for p in range(passes + 1):
            self.compute = []
            for ins in k.body:  # the row values this pass needs: their reductions are done
                if ins.kind == "row" and ins.op not in ("reduce", "store") and (
                        lv[ins.out] == p if p < passes else lv[ins.out] >= passes):
                    getattr(self, "op_" + ins.op, self.op_math)(ins)
            self.row += self.compute
            if p == passes:
                break
            users = [i for i in in_tile if at(i) == p]
            need = elem_closure(k, [i.args[0] for i in users])
            self.tile_pass([i for i in k.body if i.out in need or any(i is u for u in users)])
        self.compute = []
        for ins in k.body:
            if ins.op == "store" and ins.attrs["index"].kind == "row":
                self.op_store(ins)
        self.row += self.compute

    def tile_pass(self, body) -> None:
        """One pass: the loop over column tiles running `body` (a part of the kernel body)."""
        saved = dict(self.val)  # row values read as scalars inside the loop stay scoped to it
        self.compute, self.copy_in, self.copy_out, self.pre, self.queued_in, self.pending_free = [], [], [], [], [], []
        self.free = {"w": [f"w[{i * self.cp}]" for i in range(self.count["w"])],
                     "m": [f"m[{i * self.mask_bytes}]" for i in range(self.count["m"])]}
        super_body, self.k.body = self.k.body, body
        try:
            Render.walk(self)
        finally:
            self.k.body = super_body
        c = self.c
        head = [f"for (uint32_t c0 = 0; c0 < {c}; c0 += {self.tc}) {{",
                f"    uint32_t n = {c} - c0 < {self.tc} ? {c} - c0 : {self.tc};",
                f"    uint32_t np = (n + {REPEAT - 1}) / {REPEAT} * {REPEAT};", "    (void)np;"]
        block = lambda lines: ["{", *lines, "}"] if lines else []  # noqa: E731 (queue tensors' own scope)
        stages = block(self.copy_in) + self.compute + block(self.copy_out)  # CopyIn, Compute, CopyOut
        self.row += self.pre + head + [f"    {x}" for x in stages] + ["}"]
        after = {v: f for v, f in saved.items() if f[0] != "elem" and f[0] != "mask"}
        for ins in body:
            if ins.op == "reduce":
                o = ins.out
                after[o] = ("scalar", f"idx{o}" if ins.attrs["kind"] == "argmax" else f"acc{o}")
        self.val = {**self.val, **after}
