"""The kernel IR (deepfuse/kernel) rendered as one AscendC vector kernel for Ascend 950.

Logical rows are the index space's (r, g) pairs, R*G of them, split across the vector cores;
each runs CopyIn -> Compute -> CopyOut with its C columns in UB:
  - elem loads that move with r or g come in through a double-buffered TQue each (DataCopyPad
    when C*size is not whole 32-byte blocks); a [C] weight (row = group = 0) is loaded once in
    Init into a TBuf, cast to f32; a row load is a scalar GM read;
  - the body runs on f32 UB tensors of Cp = C rounded up to 64 elements (Compare works on whole
    256-byte repeats; every other instruction on C); elem values get tensors from a pool by a
    linear scan over the SSA body (a value's tensor is reused after its last use); row values
    live in 32-byte slots (vector ops of count 1) and are read as scalars after V_S to combine
    with elem values through Adds / Muls / Maxs / Mins (or Duplicate, then the vector op);
  - stores go out through a double-buffered TQue each (narrowing Casts round to nearest even);
    a row store goes through a small TBuf.
A row that does not fit the unified buffer goes in column tiles instead (generated_tiled.py: the
largest of 16384, 8192, ... 64 columns whose tensors fit; passes by reduction level).
Unsupported IR (col, i32 elem values, strided loads) is refused with a ValueError.
"""
from __future__ import annotations

from ...ir import Node
from ...kernel.ir import Kernel, verify
from .emit import source
from .generated_render import Render
from .generated_tiled import TiledRender
from .kernel import AIV_CORES, BLOCK, CTYPE, UB_BYTES, AscendKernel, reduce_tmp_bytes, rows_tiling

BODY = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init($INIT_PARAMS, const ${NAME}_tiling& t)
    {
$ROWS_INIT$INIT    }
$PROCESS_ROWS
private:
$METHODS
    TPipe pipe;
$MEMBERS    uint32_t first = 0, last = 0;
};
"""
# a whole row per iteration in three stages, or (tiled) one method walking the row's column tiles
STAGE_METHODS = """\
    __aicore__ inline void CopyIn(uint32_t row)
    {
$ROW_RG$COPY_IN    }
    __aicore__ inline void Compute(uint32_t row)
    {
$ROW_RG$COMPUTE    }
    __aicore__ inline void CopyOut(uint32_t row)
    {
$ROW_RG$COPY_OUT    }
"""
STAGES = "            CopyIn(row);\n            Compute(row);\n            CopyOut(row);\n"
TILED_METHODS = """\
    __aicore__ inline void Row(uint32_t row)
    {
$ROW_RG$COMPUTE    }
"""
TILES = [64 * 2 ** i for i in range(8, -1, -1)]  # column tile candidates, largest first (16384 .. 64)


def _lines(lines: list[str]) -> str:
    return "".join(f"        {x}\n" for x in lines)


def _rows_expr(k: Kernel):
    """The tiling's logical row count R*G: R bound from the first input whose shape names it."""
    r, g, _ = k.space
    if not isinstance(r, str):
        return r * g
    for i, b in enumerate(k.inputs):
        if r in b.shape:
            shape = ["shape", i, b.shape.index(r)]
            return shape if g == 1 else ["mul", shape, g]
    raise ValueError(f"{k.name}: no input binds the row count {r!r}")


def _gm_size(k: Kernel, shape) -> str:
    """A buffer's element count in C++ over the tiling (t.rows / G stands for R)."""
    n, rows = 1, ""
    for d in shape:
        if isinstance(d, int):
            n *= d
        elif d == k.space[0] and not rows:
            rows = f"(uint64_t)(t.rows / {k.space[1]}) * "
        else:
            raise ValueError(f"{k.name}: the AscendC renderer sizes buffers by the row symbol only, not {shape}")
    return f"{rows}{n}"


def _render(k: Kernel, name: str, tc: int = 0) -> Render:
    """The body rendered whole-row (tc = 0) or in column tiles of tc, with its UB pools."""
    rd = TiledRender(k, name, tc) if tc else Render(k, name)
    rd.walk()
    pools = [("workBuf", rd.count["w"] * rd.cp * 4), ("maskBuf", rd.count["m"] * rd.mask_bytes),
             ("rowBuf", rd.count["r"] * BLOCK), ("reduceBuf", reduce_tmp_bytes(min(rd.c, rd.cp)) if rd.reduce else 0),
             ("halfBuf", getattr(rd, "half", 0))]
    for buf, nbytes in pools:
        if nbytes:
            rd.buf(buf, nbytes)
    views = [("w", "float", "workBuf"), ("m", "uint8_t", "maskBuf"), ("rw", "float", "rowBuf")]
    rd.views = [f"LocalTensor<{t}> {v} = {b}.Get<{t}>();" for (v, t, b), (_, n) in zip(views, pools) if n]
    return rd


def emit_generated(node: Node, name: str) -> dict:
    """The `kernel` node's kernel IR as one AscendC vector kernel (see the module docstring)."""
    k = Kernel.from_json(node.attrs["kernel"])
    verify(k)
    rd = _render(k, name)
    for tc in TILES if rd.ub > UB_BYTES else []:
        if tc < rd.cp and (rd := _render(k, name, tc)).ub <= UB_BYTES:
            break
    if rd.ub > UB_BYTES:
        raise ValueError(f"{name} ({k.name}): a tile of {rd.cp} columns needs {rd.ub} bytes of the unified buffer, "
                         f"more than its {UB_BYTES}")
    tiled = isinstance(rd, TiledRender)
    compute = rd.views + (rd.row if tiled else rd.compute)
    params = [f"p{i}" for i in range(len(k.buffers))]
    gm_init, members = [], []
    for i, b in enumerate(k.buffers):
        ct = CTYPE[b.dtype]
        gm_init.append(f"gm{i}.SetGlobalBuffer((__gm__ {ct}*)p{i}, {_gm_size(k, b.shape)});")
        members.append(f"    GlobalTensor<{ct}> gm{i};\n")
    g = k.space[1]
    row_rg = f"        uint32_t r = row / {g}, g = row % {g};\n        (void)r; (void)g;\n"
    fields = rows_tiling(_rows_expr(k), AIV_CORES)
    dtypes = sorted({b.dtype for b in k.buffers})
    methods, stages = (TILED_METHODS, "            Row(row);\n") if tiled else (STAGE_METHODS, STAGES)
    body = BODY.replace("$METHODS", methods)
    src = source(name, f"generated from kernel IR {k.name} ({', '.join(dtypes)})", fields, body, params,
                 STAGES=stages, INIT_PARAMS=", ".join(f"GM_ADDR {p}" for p in params),
                 INIT=_lines(gm_init + rd.init), ROW_RG=row_rg, COPY_IN=_lines(rd.copy_in),
                 COMPUTE=_lines(compute), COPY_OUT=_lines(rd.copy_out), MEMBERS="".join(members + rd.members))
    args = [["in", i] for i in range(len(k.inputs))] + [["out", j] for j in range(len(k.outputs))]
    notes = {"ub_bytes": rd.ub, "pool_tensors": rd.count["w"], "kernel_ir": k.name} | ({"tile_cols": rd.cp} if tiled else {})
    return {"kernels": [AscendKernel(name, src, args, fields, AIV_CORES, notes=notes)], "tmps": []}


def renderable(node: Node) -> bool:
    """Whether emit_generated takes this `kernel` node (it refuses with a ValueError otherwise)."""
    try:
        emit_generated(node, "probe")
    except (ValueError, KeyError):
        return False
    return True


__all__ = ["emit_generated", "renderable"]
