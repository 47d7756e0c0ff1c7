"""AscendC W8A8 projections for Ascend 950: linear_w8a8, logits_w8a8 and the prologue-fused
forms (rms_norm_linear, add_rms_norm_linear, swiglu_linear with act_group). One launch:
    [prologue or row gather -> scratch A [M, K]]   generated prologue (prologue.py) / gather
    quantize (vector): A rows -> q int8 [M, K], d f32 [M, K/G]: per group max|a| (ReduceMax of
        Abs), inv = 127 / max on the scalar unit (a true f32 division), q = rint(a * inv) by
        Cast float -> float CAST_RINT, then float -> half -> int8 (exact for |q| <= 127)
    weight (vector): wq u8 [N, K] -> wq - 128 as int8 [N, K] (u8 -> half, Adds -128, half -> int8)
    cube: per group g, dots[g] = q[:, g] . w8[:, g]^T, int8 x int8 -> int32 (Matmul API,
        Matmul使用说明.md: int8_t A and B, int32_t C on Ascend 950), K = G per call
    combine (vector): y[m] = (sum over g in order of f32(dots[g][m]) * d[m, g]) * scale, Muls then
        Add (two roundings, as the reference's), cast to the output dtype
The weight is re-offset every step (N*K bytes read and written: the stored format is u8).
"""
from __future__ import annotations

from ...ir import Node
from .emit import emit_gather, source
from .emit_gemm import WORKSPACE, cube_tiling
from .kernel import AIV_CORES, CTYPE, SIZE, AscendKernel, align, copy_row, from_f32, rows_tiling
from .prologue import emit_prologue

QUANTIZE = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR a, GM_ADDR q, GM_ADDR d, const ${NAME}_tiling& t)
    {
$ROWS_INIT        aGm.SetGlobalBuffer((__gm__ $T*)a, (uint64_t)t.rows * $K);
        qGm.SetGlobalBuffer((__gm__ int8_t*)q, (uint64_t)t.rows * $K);
        dGm.SetGlobalBuffer((__gm__ float*)d, (uint64_t)t.rows * $GROUPS);
        pipe.InitBuffer(inQueue, BUFFER_NUM, $IN_BYTES);
        pipe.InitBuffer(qQueue, BUFFER_NUM, $Q_BYTES);
        pipe.InitBuffer(xfBuf, $K * 4);
        pipe.InitBuffer(workBuf, $K * 4);
        pipe.InitBuffer(halfBuf, $HALF_BYTES);
        pipe.InitBuffer(maxBuf, $GROUPS * 32);
        pipe.InitBuffer(dBuf, $D_BYTES);
    }
$PROCESS_ROWS
private:
    __aicore__ inline void CopyIn(uint32_t row)
    {
        LocalTensor<$T> aLocal = inQueue.AllocTensor<$T>();
        $COPY_IN
        inQueue.EnQue(aLocal);
    }
    __aicore__ inline void Compute()
    {
        LocalTensor<$T> aLocal = inQueue.DeQue<$T>();
        LocalTensor<float> xf = xfBuf.Get<float>();
        LocalTensor<float> work = workBuf.Get<float>();
        LocalTensor<float> maxes = maxBuf.Get<float>();
        LocalTensor<float> dRow = dBuf.Get<float>();
        $TO_F32
        inQueue.FreeTensor(aLocal);
        Abs(work, xf, $K);
        for (uint32_t g = 0; g < $GROUPS; g++) {
            ReduceMax(maxes[g * 8], work[g * $G], work[g * $G], $G);
        }
        WaitPipe<HardEvent::V_S>();
        WaitPipe<HardEvent::MTE3_S>();  // the previous row's d is out
        for (uint32_t g = 0; g < $GROUPS; g++) {
            float amax = maxes.GetValue(g * 8);
            inv[g] = amax > 0.0f ? 127.0f / amax : 0.0f;
            dRow.SetValue(g, amax / 127.0f);
        }
        WaitPipe<HardEvent::S_V>();
        for (uint32_t g = 0; g < $GROUPS; g++) {
            Muls(xf[g * $G], xf[g * $G], inv[g], $G);
        }
        Cast(work, xf, RoundMode::CAST_RINT, $K);  // to integers, ties to even
        Maxs(work, work, -127.0f, $K);
        Mins(work, work, 127.0f, $K);
        LocalTensor<half> h = halfBuf.Get<half>();
        Cast(h, work, RoundMode::CAST_RINT, $K);  // exact: integers of at most 127
        LocalTensor<int8_t> qLocal = qQueue.AllocTensor<int8_t>();
        Cast(qLocal, h, RoundMode::CAST_RINT, $K);
        qQueue.EnQue(qLocal);
    }
    __aicore__ inline void CopyOut(uint32_t row)
    {
        LocalTensor<int8_t> qLocal = qQueue.DeQue<int8_t>();
        $COPY_Q
        qQueue.FreeTensor(qLocal);
        WaitPipe<HardEvent::S_MTE3>();
        DataCopyPad(dGm[(uint64_t)row * $GROUPS], dBuf.Get<float>(), DataCopyExtParams{1, $GROUPS * 4, 0, 0, 0});
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue;
    TQue<QuePosition::VECOUT, BUFFER_NUM> qQueue;
    TBuf<QuePosition::VECCALC> xfBuf, workBuf, halfBuf, maxBuf, dBuf;
    GlobalTensor<$T> aGm;
    GlobalTensor<int8_t> qGm;
    GlobalTensor<float> dGm;
    float inv[$GROUPS];
    uint32_t first = 0, last = 0;
};
"""

OFFSET_WEIGHT = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR wq, GM_ADDR w8, const ${NAME}_tiling& t)
    {
$ROWS_INIT        wqGm.SetGlobalBuffer((__gm__ uint8_t*)wq, (uint64_t)t.rows * $K);
        w8Gm.SetGlobalBuffer((__gm__ int8_t*)w8, (uint64_t)t.rows * $K);
        pipe.InitBuffer(inQueue, BUFFER_NUM, $Q_BYTES);
        pipe.InitBuffer(outQueue, BUFFER_NUM, $Q_BYTES);
        pipe.InitBuffer(halfBuf, $HALF_BYTES);
    }
$PROCESS_ROWS
private:
    __aicore__ inline void CopyIn(uint32_t row)
    {
        LocalTensor<uint8_t> wLocal = inQueue.AllocTensor<uint8_t>();
        $COPY_IN
        inQueue.EnQue(wLocal);
    }
    __aicore__ inline void Compute()
    {
        LocalTensor<uint8_t> wLocal = inQueue.DeQue<uint8_t>();
        LocalTensor<half> h = halfBuf.Get<half>();
        Cast(h, wLocal, RoundMode::CAST_NONE, $K);
        inQueue.FreeTensor(wLocal);
        Adds(h, h, (half)-128.0f, $K);  // exact: -127 .. 127
        LocalTensor<int8_t> oLocal = outQueue.AllocTensor<int8_t>();
        Cast(oLocal, h, RoundMode::CAST_RINT, $K);
        outQueue.EnQue(oLocal);
    }
    __aicore__ inline void CopyOut(uint32_t row)
    {
        LocalTensor<int8_t> oLocal = outQueue.DeQue<int8_t>();
        $COPY_OUT
        outQueue.FreeTensor(oLocal);
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue;
    TQue<QuePosition::VECOUT, BUFFER_NUM> outQueue;
    TBuf<QuePosition::VECCALC> halfBuf;
    GlobalTensor<uint8_t> wqGm;
    GlobalTensor<int8_t> w8Gm;
    uint32_t first = 0, last = 0;
};
"""

COMBINE = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR dots, GM_ADDR d, GM_ADDR scale, GM_ADDR y, const ${NAME}_tiling& t)
    {
$ROWS_INIT        rows = t.rows;
        dotsGm.SetGlobalBuffer((__gm__ int32_t*)dots, (uint64_t)$GROUPS * t.rows * $N);
        dGm.SetGlobalBuffer((__gm__ float*)d, (uint64_t)t.rows * $GROUPS);
        scaleGm.SetGlobalBuffer((__gm__ float*)scale, $N);
        yGm.SetGlobalBuffer((__gm__ $TY*)y, (uint64_t)t.rows * $N);
        pipe.InitBuffer(dotQueue, BUFFER_NUM, $NC * 4);
        pipe.InitBuffer(scaleQueue, 1, $NC * 4);
        pipe.InitBuffer(yQueue, BUFFER_NUM, $Y_BYTES);
        pipe.InitBuffer(accBuf, $NC * 4);
        pipe.InitBuffer(termBuf, $NC * 4);
    }
    __aicore__ inline void Process()
    {
        for (uint32_t row = first; row < last; row++) {
            for (uint32_t n0 = 0; n0 + $NC <= $N; n0 += $NC) {
                Full(row, n0);
            }
$TAIL_CALL        }
    }

private:
$CHUNKS
    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> dotQueue;
    TQue<QuePosition::VECIN, 1> scaleQueue;
    TQue<QuePosition::VECOUT, BUFFER_NUM> yQueue;
    TBuf<QuePosition::VECCALC> accBuf, termBuf;
    GlobalTensor<int32_t> dotsGm;
    GlobalTensor<float> dGm, scaleGm;
    GlobalTensor<$TY> yGm;
    uint32_t first = 0, last = 0, rows = 0;
};
"""
# one chunk of `count` columns from n0 of a row: the group sums in order, times the weight scale
CHUNK = """    __aicore__ inline void $FN(uint32_t row, uint32_t n0)
    {
        LocalTensor<float> sc = scaleQueue.AllocTensor<float>();
        $COPY_SCALE
        scaleQueue.EnQue(sc);
        sc = scaleQueue.DeQue<float>();
        LocalTensor<float> acc = accBuf.Get<float>();
        LocalTensor<float> term = termBuf.Get<float>();
        Duplicate(acc, 0.0f, $COUNT);
        for (uint32_t g = 0; g < $GROUPS; g++) {
            LocalTensor<int32_t> dot = dotQueue.AllocTensor<int32_t>();
            $COPY_DOT
            dotQueue.EnQue(dot);
            dot = dotQueue.DeQue<int32_t>();
            Cast(term, dot, RoundMode::CAST_RINT, $COUNT);  // exact: |dot| < 2^24
            dotQueue.FreeTensor(dot);
            float dg = dGm.GetValue((uint64_t)row * $GROUPS + g);
            Muls(term, term, dg, $COUNT);
            Add(acc, acc, term, $COUNT);
        }
        Mul(acc, acc, sc, $COUNT);
        scaleQueue.FreeTensor(sc);
        LocalTensor<$TY> yLocal = yQueue.AllocTensor<$TY>();
        $TO_Y
        yQueue.EnQue(yLocal);
        yLocal = yQueue.DeQue<$TY>();
        $COPY_Y
        yQueue.FreeTensor(yLocal);
    }
"""
NC_MAX = 4096  # columns per combine chunk: 2 dot buffers, scale, acc, term (f32) and 2 outputs, ~90 KiB of UB
QUANT_UB = 200 * 1024  # what the quantize kernel's whole-row buffers may take (module doc; emittable checks it)


def quantize_ub_bytes(k: int, size: int, groups: int) -> int:
    """UB bytes the quantize kernel asks for a row of k activations of `size` bytes."""
    return 2 * align(k * size) + 2 * align(k) + 2 * k * 4 + align(k * 2) + groups * 32 + align(groups * 4)


GROUP_MATMUL = """\
// $NAME: per group g of $G along K, dots[g] = Q[M, g] . W8[$N, g]^T, int8 x int8 -> int32 on the cube
// unit (Matmul API); generated by deepfuse for ascend950
#include "kernel_operator.h"
#include "kernel_tiling/kernel_tiling.h"
#define ASCENDC_CUBE_ONLY
#include "lib/matmul_intf.h"
using namespace AscendC;
using namespace matmul;

using A_TYPE = MatmulType<TPosition::GM, CubeFormat::ND, int8_t>;
using B_TYPE = MatmulType<TPosition::GM, CubeFormat::ND, int8_t, true>;
using C_TYPE = MatmulType<TPosition::GM, CubeFormat::ND, int32_t>;
using BIAS_TYPE = MatmulType<TPosition::GM, CubeFormat::ND, int32_t>;

extern "C" __global__ __cube__ void $NAME(GM_ADDR q, GM_ADDR w8, GM_ADDR dots, GM_ADDR workspace,
    AscendC::tiling::TCubeTiling tiling)
{
    SetSysWorkspace(workspace);
    TPipe pipe;
    Matmul<A_TYPE, B_TYPE, C_TYPE, BIAS_TYPE> mm;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), mm, &tiling);
    const TCubeTiling& t = tiling;
    int32_t nStart = GetBlockIdx() * t.singleCoreN;
    if (t.M == 0 || nStart >= t.N) {
        return;
    }
    int32_t tailN = t.N - nStart < t.singleCoreN ? t.N - nStart : t.singleCoreN;
    GlobalTensor<int8_t> qGm, wGm;
    GlobalTensor<int32_t> dotsGm;
    qGm.SetGlobalBuffer((__gm__ int8_t*)q, (uint64_t)t.M * t.Ka);
    wGm.SetGlobalBuffer((__gm__ int8_t*)w8, (uint64_t)t.N * t.Kb);
    dotsGm.SetGlobalBuffer((__gm__ int32_t*)dots, (uint64_t)$GROUPS * t.M * t.N);
    for (int32_t g = 0; g < $GROUPS; g++) {
        mm.SetTensorA(qGm[g * $G]);
        mm.SetTensorB(wGm[(uint64_t)nStart * t.Kb + g * $G], true);
        mm.SetTail(t.M, tailN, $G);
        mm.IterateAll(dotsGm[(uint64_t)g * t.M * t.N + nStart]);
    }
    mm.End();
}
"""


def emit_w8a8(node: Node, name: str) -> dict:
    """-> {"kernels", "tmps"} of a W8A8 form (module doc). Scratch: [A,] q, d, w8, dots."""
    op, x = node.op, node.inputs[0].type
    g = node.attrs["act_group"]
    logits = op == "logits_w8a8"
    wi = 1 if op in ("linear_w8a8", "logits_w8a8") else len(node.inputs) - 2  # wq, then scale
    n, k = node.inputs[wi].type.shape
    groups = k // g
    dt = x.dtype
    m_form = ["shape", 3, 0] if logits else ["shape", 0, 0]
    kernels, tmps = [], []
    if op == "linear_w8a8":
        a_arg, a_tmp = ["in", 0], None
    else:
        a_tmp = {"shape": [node.inputs[3].type.shape[0] if logits else x.shape[0], k], "dtype": dt}
        tmps.append(a_tmp)
        a_arg = ["tmp", 0]
        if logits:
            kernels.append(emit_gather(node, name + "_rows", ids_index=3, y_arg=["tmp", 0]))
        else:
            kernels.append(emit_prologue(node, name + "_prologue"))
    rows = m_form
    iq, idd, iw, idots = len(tmps), len(tmps) + 1, len(tmps) + 2, len(tmps) + 3
    mdim = a_tmp["shape"][0] if a_tmp else x.shape[0]
    tmps += [{"shape": [mdim, k], "dtype": "i8"}, {"shape": [mdim, groups], "dtype": "f32"},
             {"shape": [n, k], "dtype": "i8"}, {"shape": [groups, mdim, n], "dtype": "i32"}]
    t, size = CTYPE[dt], SIZE[dt]
    fields = rows_tiling(rows, AIV_CORES)
    to_f32 = "Cast(xf, aLocal, RoundMode::CAST_NONE, $K);" if dt != "f32" else "Adds(xf, aLocal, 0.0f, $K);"
    quant = source(name + "_quant", f"W8A8 activation groups of {g} -> int8 and scales, {dt}", fields, QUANTIZE,
                   ["a", "q", "d"], T=t, K=k, G=g, GROUPS=groups, IN_BYTES=align(k * size), Q_BYTES=align(k),
                   HALF_BYTES=align(k * 2), D_BYTES=align(groups * 4), TO_F32=to_f32.replace("$K", str(k)),
                   COPY_IN=copy_row("aLocal", f"aGm[(uint64_t)row * {k}]", k, size, False, t),
                   COPY_Q=copy_row(f"qGm[(uint64_t)row * {k}]", "qLocal", k, 1, True, "int8_t"))
    kernels.append(AscendKernel(name + "_quant", quant, [a_arg, ["tmp", iq], ["tmp", idd]], fields, AIV_CORES))
    wfields = rows_tiling(n, AIV_CORES)
    offset = source(name + "_weight", "W8A8 weight u8 -> int8 (wq - 128)", wfields, OFFSET_WEIGHT, ["wq", "w8"],
                    K=k, Q_BYTES=align(k), HALF_BYTES=align(k * 2),
                    COPY_IN=copy_row("wLocal", f"wqGm[(uint64_t)row * {k}]", k, 1, False, "uint8_t"),
                    COPY_OUT=copy_row(f"w8Gm[(uint64_t)row * {k}]", "oLocal", k, 1, True, "int8_t"))
    kernels.append(AscendKernel(name + "_weight", offset, [["in", wi], ["tmp", iw]], wfields, AIV_CORES))
    cube_fields, cores = cube_tiling(["tmp_shape", iq, 0], n, k, 1)
    base_k = min(64, align(g, 32))
    patch = {"singleCoreK": g, "baseK": base_k}
    cube_fields = [[f, ct, patch.get(f, v)] for f, ct, v in cube_fields]
    base_m, base_n = (next(v for f, _, v in cube_fields if f == key) for key in ("baseM", "baseN"))
    cube_fields = [[f, ct, (2 * base_m + 2 * base_n) * base_k if f == "shareL1Size" else v] for f, ct, v in cube_fields]
    cube = GROUP_MATMUL.replace("$NAME", name + "_dots").replace("$GROUPS", str(groups)).replace("$G", str(g)) \
        .replace("$N", str(n))
    kernels.append(AscendKernel(name + "_dots", cube, [["tmp", iq], ["tmp", iw], ["tmp", idots]], cube_fields, cores,
                                core="aic", workspace=WORKSPACE))
    out = 1 if op == "add_rms_norm_linear" else 0
    ty = node.outputs[out].type.dtype
    tyc, ysize = CTYPE[ty], SIZE[ty]
    nc = min(NC_MAX, align(n * 4) // 4) if n > NC_MAX else n
    chunks, tail = "", n % nc if n > nc else 0

    def chunk(fn: str, count: int) -> str:
        to_y = f"Adds(yLocal, acc, 0.0f, {count});" if ty == "f32" else from_f32("yLocal", "acc", count)
        return CHUNK.replace("$FN", fn).replace("$COUNT", str(count)).replace("$TO_Y", to_y) \
            .replace("$TY", tyc).replace("$GROUPS", str(groups)) \
            .replace("$COPY_SCALE", copy_row("sc", "scaleGm[n0]", count, 4, False, "float")) \
            .replace("$COPY_DOT", copy_row("dot", f"dotsGm[((uint64_t)g * rows + row) * {n} + n0]", count, 4, False,
                                           "int32_t")) \
            .replace("$COPY_Y", copy_row(f"yGm[(uint64_t)row * {n} + n0]", "yLocal", count, ysize, True, tyc))

    chunks = chunk("Full", nc) + (chunk("Tail", tail) if tail else "")
    tail_call = f"            Tail(row, {n - tail});\n" if tail else ""
    cfields = rows_tiling(["tmp_shape", iq, 0], AIV_CORES)
    comb = source(name, f"W8A8 group sums and weight scale, {ty} out", cfields, COMBINE, ["dots", "d", "scale", "y"],
                  TY=tyc, N=n, NC=nc, GROUPS=groups, Y_BYTES=align(nc * ysize), CHUNKS=chunks, TAIL_CALL=tail_call)
    kernels.append(AscendKernel(name, comb, [["tmp", idots], ["tmp", idd], ["in", wi + 1], ["out", out]], cfields,
                                AIV_CORES))
    return {"kernels": kernels, "tmps": tmps}


__all__ = ["emit_w8a8"]
