"""AscendC int4 projections for Ascend 950: linear_q4(x, packed, scales, mins) -> x . W^T with W in
4-bit groups (GGUF Q4_1: w = q * scale + min per group of `group_size` along K, two codes per
byte, the even element in the low nibble) -- and the prologue-fused forms (rms_norm_linear,
add_rms_norm_linear, swiglu_linear with an int4 projection: the prologue kernel into the
launch's scratch, then this kernel).

A vector-core kernel, built for decode-sized steps: each core owns a slice of the N output
columns and, a chunk of columns at a time, unpacks their codes in UB (uint16 And / ShiftRight
split the low and high nibbles into the even and odd planes, Cast u8 -> half -> fp32), applies
each group's scale and min, then dots every token row with them -- x split into its even and odd
elements by GatherMask, so the planes are never re-interleaved. The weight is read once per step
at half a byte per element. Prefill-sized steps run the same kernel (correct, but the dots are on
the vector unit; a cube path that dequantizes B tiles into L1 is not written yet).
"""
from __future__ import annotations

from ...ir import Node
from .emit import source
from .kernel import (
    AIV_CORES,
    BLOCK,
    CTYPE,
    SIZE,
    UB_BYTES,
    AscendKernel,
    align,
    cdiv,
    copy_row,
    from_f32,
    reduce_tmp_bytes,
    to_f32,
)
from .prologue import emit_prologue

LINEAR_Q4 = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR x, GM_ADDR packed, GM_ADDR scales, GM_ADDR mins, GM_ADDR y,
                                const ${NAME}_tiling& t)
    {
        rows = t.rows;
        n0 = GetBlockIdx() * t.colsPerCore;
        n1 = n0 + t.colsPerCore < $N ? n0 + t.colsPerCore : $N;
        xGm.SetGlobalBuffer((__gm__ $T*)x, (uint64_t)t.rows * $K);
        packedGm.SetGlobalBuffer((__gm__ uint8_t*)packed, (uint64_t)$N * $HK);
        scaleGm.SetGlobalBuffer((__gm__ float*)scales, (uint64_t)$N * $GROUPS);
        minGm.SetGlobalBuffer((__gm__ float*)mins, (uint64_t)$N * $GROUPS);
        yGm.SetGlobalBuffer((__gm__ $T*)y, (uint64_t)t.rows * $N);
        pipe.InitBuffer(packedQueue, BUFFER_NUM, $HK_BYTES);
        pipe.InitBuffer(xQueue, BUFFER_NUM, $X_BYTES);
        pipe.InitBuffer(maskBuf, $QK_BYTES);
        pipe.InitBuffer(planeBuf, 2 * $QK_BYTES);
        pipe.InitBuffer(halfBuf, $HK_HALF_BYTES);
        pipe.InitBuffer(wBuf, $NC * $K * 4);  // the chunk's columns: [even plane | odd plane] each
        pipe.InitBuffer(xfBuf, $XF_BYTES);
        pipe.InitBuffer(xeoBuf, $K * 4);  // x's even elements | odd elements
        pipe.InitBuffer(workBuf, $K * 4);
        pipe.InitBuffer(sumBuf, $NC * $BLOCK);
        pipe.InitBuffer(yBuf, $NC_F32_BYTES);
        pipe.InitBuffer(reduceBuf, $REDUCE_BYTES);  // ReduceSum's scratch
$Y_INIT        Duplicate(maskBuf.Get<uint16_t>(), (uint16_t)0x0F0F, $QK);
    }
    __aicore__ inline void Process()
    {
        for (uint32_t c0 = n0; c0 < n1; c0 += $NC) {
            uint32_t nc = n1 - c0 < $NC ? n1 - c0 : $NC;
            for (uint32_t j = 0; j < nc; j++) {
                Dequantize(c0 + j, wBuf.Get<float>()[j * $K]);
            }
            for (uint32_t m = 0; m < rows; m++) {
                LoadRow(m);
                Dot(m, c0, nc);
            }
        }
    }

private:
    // column n's weights in fp32: even elements at w[0, K/2), odd ones at w[K/2, K)
    __aicore__ inline void Dequantize(uint32_t n, const LocalTensor<float>& w)
    {
        LocalTensor<uint8_t> pk = packedQueue.AllocTensor<uint8_t>();
        $COPY_PACKED
        packedQueue.EnQue(pk);
        pk = packedQueue.DeQue<uint8_t>();
        LocalTensor<uint16_t> codes = pk.ReinterpretCast<uint16_t>();
        LocalTensor<uint16_t> lo = planeBuf.Get<uint16_t>();
        LocalTensor<uint16_t> hi = planeBuf.Get<uint16_t>()[$QK_PAD];
        And(lo, codes, maskBuf.Get<uint16_t>(), $QK);  // each byte's low nibble: the even elements
        ShiftRight(hi, codes, (uint16_t)4, $QK);
        And(hi, hi, maskBuf.Get<uint16_t>(), $QK);  // each byte's high nibble: the odd elements
        packedQueue.FreeTensor(pk);
        LocalTensor<half> h = halfBuf.Get<half>();
        Cast(h, lo.ReinterpretCast<uint8_t>(), RoundMode::CAST_NONE, $HK);
        Cast(w, h, RoundMode::CAST_NONE, $HK);
        Cast(h, hi.ReinterpretCast<uint8_t>(), RoundMode::CAST_NONE, $HK);
        Cast(w[$HK], h, RoundMode::CAST_NONE, $HK);
        for (uint32_t g = 0; g < $GROUPS; g++) {
            float scale = scaleGm.GetValue((uint64_t)n * $GROUPS + g);
            float lowest = minGm.GetValue((uint64_t)n * $GROUPS + g);
            for (uint32_t plane = 0; plane < 2; plane++) {
                LocalTensor<float> part = w[plane * $HK + g * $HG];
                Muls(part, part, scale, $HG);
                Adds(part, part, lowest, $HG);
            }
        }
$ROUND_W    }
    // token row m of x, split into its even and odd elements (fp32)
    __aicore__ inline void LoadRow(uint32_t m)
    {
        LocalTensor<$T> xLocal = xQueue.AllocTensor<$T>();
        $COPY_X
        xQueue.EnQue(xLocal);
        xLocal = xQueue.DeQue<$T>();
$X_F32        uint64_t kept = 0;
        LocalTensor<float> xeo = xeoBuf.Get<float>();
        GatherMask(xeo, xf, 1, false, 0, GatherMaskParams{1, $REPEATS, 8, 0}, kept);
        GatherMask(xeo[$HK], xf, 2, false, 0, GatherMaskParams{1, $REPEATS, 8, 0}, kept);
        xQueue.FreeTensor(xLocal);
    }
    // y[m, c0 .. c0+nc) = the row's dots with the chunk's columns
    __aicore__ inline void Dot(uint32_t m, uint32_t c0, uint32_t nc)
    {
        LocalTensor<float> work = workBuf.Get<float>();
        LocalTensor<float> sum = sumBuf.Get<float>();
        for (uint32_t j = 0; j < nc; j++) {
            Mul(work, xeoBuf.Get<float>(), wBuf.Get<float>()[j * $K], $K);
            ReduceSum(sum[j * 8], work, reduceBuf.Get<float>(), $K);
        }
        WaitPipe<HardEvent::V_S>();
        LocalTensor<float> yRow = yBuf.Get<float>();
        WaitPipe<HardEvent::MTE3_S>();  // the previous row's copy-out of yRow is done
        for (uint32_t j = 0; j < nc; j++) {
            yRow.SetValue(j, sum.GetValue(j * 8));
        }
$STORE    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> packedQueue, xQueue;
    TBuf<QuePosition::VECCALC> maskBuf, planeBuf, halfBuf, wBuf, xfBuf, xeoBuf, workBuf, sumBuf, yBuf, reduceBuf$Y_BUF;
    GlobalTensor<$T> xGm, yGm;
    GlobalTensor<uint8_t> packedGm;
    GlobalTensor<float> scaleGm, minGm;
    uint32_t rows = 0, n0 = 0, n1 = 0;
};
"""


def emit_linear_q4(name: str, node: Node, x_arg: list, w_index: int, y_arg: list) -> AscendKernel:
    """x[M,K] . dequantize(packed, scales, mins)^T; the node's int4 operands start at input w_index."""
    dt = node.inputs[0].type.dtype
    t, size, half = CTYPE[dt], SIZE[dt], dt != "f32"
    g = node.attrs["group_size"]
    n, hk = node.inputs[w_index].type.shape
    k = 2 * hk
    groups = k // g
    if k % 64 or g % 16:
        raise ValueError(f"{name}: int4 kernels need K a multiple of 64 and groups of a multiple of 16 (K {k}, group {g})")
    # UB besides the chunk's weights: packed rows and x rows (double-buffered), nibble planes and mask,
    # half staging, fp32 x, x's even|odd, the product, sums and the output row
    fixed = 2 * align(hk) + 2 * align(k * size) + 3 * align(hk) + align(hk * 2) + (align(k, 64) * 4 if half else 0) \
        + 2 * k * 4 + 8 * BLOCK + 2 * align(k * size) + 4 * BLOCK + reduce_tmp_bytes(k)
    nc = max(1, min(8, (UB_BYTES - fixed) // (k * 4)))
    fields = [["rows", "uint32_t", ["shape", 0, 0] if x_arg[0] == "in" else ["tmp_shape", x_arg[1], 0]],
              ["colsPerCore", "uint32_t", cdiv(n, AIV_CORES)]]
    if half:
        x_f32 = f"        LocalTensor<float> xf = xfBuf.Get<float>();\n        {to_f32('xf', 'xLocal', k)}\n"
        rounded = f"roundBuf.Get<{t}>()"  # the weight rounded to the model's dtype, as the reference rounds it
        round_w = f"        {from_f32(rounded, 'w', k)}\n        {to_f32('w', rounded, k)}\n"
        store = ("        WaitPipe<HardEvent::S_V>();\n        WaitPipe<HardEvent::MTE3_V>();\n"
                 f"        {from_f32(f'yOut.Get<{t}>()', 'yRow', 'nc')}\n"
                 "        WaitPipe<HardEvent::V_MTE3>();\n"
                 f"        DataCopyPad(yGm[(uint64_t)m * {n} + c0], yOut.Get<{t}>(), "
                 f"DataCopyExtParams{{1, nc * {size}, 0, 0, 0}});\n")
        y_init = f"        pipe.InitBuffer(yOut, {align(8 * size)});\n        pipe.InitBuffer(roundBuf, {align(k * size)});\n"
        y_buf = ", yOut, roundBuf"
    else:
        x_f32 = "        LocalTensor<float> xf = xLocal;\n"
        round_w = ""
        store = ("        WaitPipe<HardEvent::S_MTE3>();\n"
                 f"        DataCopyPad(yGm[(uint64_t)m * {n} + c0], yRow, DataCopyExtParams{{1, nc * 4, 0, 0, 0}});\n")
        y_init, y_buf = "", ""
    src = source(name, f"int4 projection (Q4_1 groups of {g}) on the vector cores, {dt}", fields, LINEAR_Q4,
                 ["x", "packed", "scales", "mins", "y"],
                 T=t, N=n, K=k, HK=hk, QK=hk // 2, QK_PAD=align(hk // 2 * 2) // 2, GROUPS=groups, HG=g // 2, NC=nc,
                 BLOCK=BLOCK, HK_BYTES=align(hk), X_BYTES=align(k * size), QK_BYTES=align(hk // 2 * 2),
                 HK_HALF_BYTES=align(hk * 2), XF_BYTES=align(k, 64) * 4 if half else BLOCK, NC_F32_BYTES=align(nc * 4),
                 REPEATS=cdiv(k, 64), REDUCE_BYTES=reduce_tmp_bytes(k),
                 Y_INIT=y_init, Y_BUF=y_buf, X_F32=x_f32, ROUND_W=round_w, STORE=store,
                 COPY_PACKED=copy_row("pk", f"packedGm[(uint64_t)n * {hk}]", hk, 1, False, "uint8_t"),
                 COPY_X=copy_row("xLocal", f"xGm[(uint64_t)m * {k}]", k, size, False, t))
    args = [x_arg, ["in", w_index], ["in", w_index + 1], ["in", w_index + 2], y_arg]
    return AscendKernel(name, src, args, fields, AIV_CORES)


def emit_gemm_q4(node: Node, name: str) -> dict:
    """linear_q4 and the int4 prologue forms -> {"kernels", "tmps"} (see module doc)."""
    op, x = node.op, node.inputs[0].type
    w_index = len(node.inputs) - 3
    if op == "linear_q4":
        return {"kernels": [emit_linear_q4(name, node, ["in", 0], 1, ["out", 0])], "tmps": []}
    k = 2 * node.inputs[w_index].type.shape[1]
    pro = emit_prologue(node, name + "_prologue")  # generated (prologue.py)
    out = 1 if op == "add_rms_norm_linear" else 0
    mm = emit_linear_q4(name, node, ["tmp", 0], w_index, ["out", out])
    return {"kernels": [pro, mm], "tmps": [{"shape": [x.shape[0], k], "dtype": x.dtype}]}
