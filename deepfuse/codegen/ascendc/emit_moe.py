"""AscendC fused_moe for Ascend 950: eight kernels over the launch's scratch tensors.

    router     logits[T,E] = x . router_w^T                       cube (Matmul API)
    _route     per token: softmax / sigmoid scores, + score bias for the choice, top-k by
               repeated ReduceMax, renormalise, routed scaling, shared experts -> ids, weights
    _sort      one core, scalar: counts per expert, row offsets, (token, slot) pairs sorted by
               expert -> rows[P] (pair ids), pos[P] (each pair's row), offsets[E+1]
    _gather    xs[P,D] = x[pair / KT]                              vector
    _up        h13[P,2I] = xs . w13[e]^T over each expert's rows    cube, grouped
    _swiglu    h[P,I] = silu(gate) * up                            vector
    _down      ys[P,D] = h . w2[e]^T over each expert's rows        cube, grouped
    _combine   y[t] = sum_j weights[t,j] * ys[pos[t*KT+j]]          vector
P = T*KT pairs, KT = top_k + num_shared. Group-limited routing (n_group > 1, DeepSeek-V3: groups
ranked by their two best scores) runs in the routing kernel on the scalar unit.
"""
from __future__ import annotations

from ...ir import Node
from .emit import emit_gather, emit_swiglu, source
from .emit_gemm import emit_grouped_matmul, emit_matmul
from .kernel import (
    AIV_CORES,
    BLOCK,
    CTYPE,
    LOWEST,
    SIZE,
    AscendKernel,
    align,
    copy_row,
    from_f32,
    rows_tiling,
    to_f32,
)

ROUTE = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR logits, ${BIAS_PARAM}GM_ADDR ids, GM_ADDR weights, const ${NAME}_tiling& t)
    {
$ROWS_INIT        logitGm.SetGlobalBuffer((__gm__ float*)logits, (uint64_t)t.rows * $E);
        idsGm.SetGlobalBuffer((__gm__ int32_t*)ids, (uint64_t)t.rows * $KT);
        weightGm.SetGlobalBuffer((__gm__ float*)weights, (uint64_t)t.rows * $KT);
        pipe.InitBuffer(inQueue, BUFFER_NUM, $E_BYTES);
        pipe.InitBuffer(scoreBuf, $E_BYTES);
        pipe.InitBuffer(choiceBuf, $E_BYTES);
        pipe.InitBuffer(workBuf, $E_BYTES);
        pipe.InitBuffer(maxBuf, $BLOCK);
        pipe.InitBuffer(idsBuf, $KT_BYTES);
        pipe.InitBuffer(weightBuf, $KT_BYTES);
$BIAS_INIT    }
$PROCESS_ROWS
private:
    __aicore__ inline void CopyIn(uint32_t row)
    {
        LocalTensor<float> x = inQueue.AllocTensor<float>();
        $COPY_IN
        inQueue.EnQue(x);
    }
    __aicore__ inline void Compute(uint32_t row)
    {
        LocalTensor<float> x = inQueue.DeQue<float>();
        LocalTensor<float> score = scoreBuf.Get<float>();
        LocalTensor<float> choice = choiceBuf.Get<float>();
        LocalTensor<float> work = workBuf.Get<float>();
        LocalTensor<float> m = maxBuf.Get<float>();
$SCORES        inQueue.FreeTensor(x);
$CHOICE$GROUPS        LocalTensor<int32_t> ids = idsBuf.Get<int32_t>();
        LocalTensor<float> weights = weightBuf.Get<float>();
        float w[$KT];
        float total = 0.0f;
        WaitPipe<HardEvent::MTE3_S>();  // the previous row's copy-out of ids / weights is done
        for (uint32_t k = 0; k < $TOPK; k++) {
            ReduceMax(m, choice, work, $E, true);
            WaitPipe<HardEvent::V_S>();
            float bits = m.GetValue(1);
            uint32_t e = *reinterpret_cast<uint32_t*>(&bits);
            ids.SetValue(k, (int32_t)e);
            w[k] = score.GetValue(e);
            total += w[k];
            choice.SetValue(e, $LOWEST);
            WaitPipe<HardEvent::S_V>();
        }
        for (uint32_t k = 0; k < $TOPK; k++) {
            weights.SetValue(k, $WEIGHT);
        }
        for (uint32_t k = $TOPK; k < $KT; k++) {  // shared experts: always on, weight 1
            ids.SetValue(k, (int32_t)($E + k - $TOPK));
            weights.SetValue(k, 1.0f);
        }
        WaitPipe<HardEvent::S_MTE3>();
        DataCopyPad(idsGm[(uint64_t)row * $KT], ids, DataCopyExtParams{1, $KT * 4, 0, 0, 0});
        DataCopyPad(weightGm[(uint64_t)row * $KT], weights, DataCopyExtParams{1, $KT * 4, 0, 0, 0});
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue;
    TBuf<QuePosition::VECCALC> scoreBuf, choiceBuf, workBuf, maxBuf, idsBuf, weightBuf$BIAS_BUF;
    GlobalTensor<float> logitGm, weightGm$BIAS_GM;
    GlobalTensor<int32_t> idsGm;
    uint32_t first = 0, last = 0;
};
"""
# group-limited routing (DeepSeek-V3): groups rank by the sum of their two best choice values;
# the experts of all but the best TOPK_GROUP groups leave the choice (scalar unit)
GROUPS = """\
        WaitPipe<HardEvent::V_S>();
        float groupScore[$NG];
        bool keep[$NG];
        for (uint32_t g = 0; g < $NG; g++) {
            float best = $LOWEST, second = $LOWEST;
            for (uint32_t e = g * $GE; e < (g + 1) * $GE; e++) {
                float v = choice.GetValue(e);
                if (v > best) {
                    second = best;
                    best = v;
                } else if (v > second) {
                    second = v;
                }
            }
            groupScore[g] = best + second;
            keep[g] = false;
        }
        for (uint32_t k = 0; k < $TOPK_GROUP; k++) {
            int32_t pick = -1;
            for (uint32_t g = 0; g < $NG; g++) {
                if (!keep[g] && (pick < 0 || groupScore[g] > groupScore[pick])) {
                    pick = (int32_t)g;
                }
            }
            keep[pick] = true;
        }
        for (uint32_t g = 0; g < $NG; g++) {
            for (uint32_t e = g * $GE; !keep[g] && e < (g + 1) * $GE; e++) {
                choice.SetValue(e, $LOWEST);
            }
        }
        WaitPipe<HardEvent::S_V>();
"""
SOFTMAX = """\
        ReduceMax(m, x, work, $E);
        WaitPipe<HardEvent::V_S>();
        float xMax = m.GetValue(0);
        Adds(score, x, -xMax, $E);
        Exp(score, score, $E);
        ReduceSum(m, score, work, $E);
        WaitPipe<HardEvent::V_S>();
        Duplicate(work, m.GetValue(0), $E);
        Div(score, score, work, $E);
"""
SIGMOID = """\
        Muls(score, x, -1.0f, $E);
        Exp(score, score, $E);
        Adds(score, score, 1.0f, $E);
        Reciprocal(score, score, $E);
"""

SORT = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR ids, GM_ADDR rows, GM_ADDR pos, GM_ADDR offsets, const ${NAME}_tiling& t)
    {
        pairs = t.pairs;
        idsGm.SetGlobalBuffer((__gm__ int32_t*)ids, pairs);
        rowsGm.SetGlobalBuffer((__gm__ int32_t*)rows, pairs);
        posGm.SetGlobalBuffer((__gm__ int32_t*)pos, pairs);
        offsetGm.SetGlobalBuffer((__gm__ int32_t*)offsets, $E + 1);
    }
    // a counting sort by expert on the scalar unit (stable: pairs keep their order within an expert)
    __aicore__ inline void Process()
    {
        if (GetBlockIdx() != 0) {
            return;
        }
        int32_t fill[$E + 1];
        for (uint32_t e = 0; e <= $E; e++) {
            fill[e] = 0;
        }
        for (uint32_t p = 0; p < pairs; p++) {
            fill[idsGm.GetValue(p) + 1]++;
        }
        for (uint32_t e = 0; e < $E; e++) {
            fill[e + 1] += fill[e];
            offsetGm.SetValue(e, fill[e]);
        }
        offsetGm.SetValue($E, fill[$E]);
        for (uint32_t p = 0; p < pairs; p++) {
            int32_t dest = fill[idsGm.GetValue(p)]++;
            rowsGm.SetValue(dest, (int32_t)p);
            posGm.SetValue(p, dest);
        }
        DataCacheCleanAndInvalid<int32_t, CacheLine::ENTIRE_DATA_CACHE>(rowsGm);
    }

private:
    GlobalTensor<int32_t> idsGm, rowsGm, posGm, offsetGm;
    uint32_t pairs = 0;
};
"""

COMBINE = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR ys, GM_ADDR pos, GM_ADDR weights, GM_ADDR y, const ${NAME}_tiling& t)
    {
$ROWS_INIT        ysGm.SetGlobalBuffer((__gm__ $T*)ys, (uint64_t)t.rows * $KT * $D);
        posGm.SetGlobalBuffer((__gm__ int32_t*)pos, (uint64_t)t.rows * $KT);
        weightGm.SetGlobalBuffer((__gm__ float*)weights, (uint64_t)t.rows * $KT);
        yGm.SetGlobalBuffer((__gm__ $T*)y, (uint64_t)t.rows * $D);
        pipe.InitBuffer(inQueue, BUFFER_NUM, $ROW_BYTES);
        pipe.InitBuffer(outQueue, 1, $ROW_BYTES);
$HALF_INIT    }
$PROCESS_ROWS
private:
    // y[row] = sum over the token's KT pairs of weight * the expert's output row
    __aicore__ inline void Compute(uint32_t row)
    {
$ACC        Duplicate(acc, 0.0f, $D);
        for (uint32_t j = 0; j < $KT; j++) {
            uint64_t p = (uint64_t)posGm.GetValue((uint64_t)row * $KT + j);
            float w = weightGm.GetValue((uint64_t)row * $KT + j);
            LocalTensor<$T> ysLocal = inQueue.AllocTensor<$T>();
            $COPY_IN
            inQueue.EnQue(ysLocal);
            ysLocal = inQueue.DeQue<$T>();
$YS_F32            Axpy(acc, yf, w, $D);
            inQueue.FreeTensor(ysLocal);
        }
$STORE    }
    __aicore__ inline void CopyOut(uint32_t row)
    {
        LocalTensor<$T> acc = outQueue.DeQue<$T>();
        $COPY_OUT
        outQueue.FreeTensor(acc);
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue;
    TQue<QuePosition::VECOUT, 1> outQueue;$HALF_BUFS
    GlobalTensor<$T> ysGm, yGm;
    GlobalTensor<float> weightGm;
    GlobalTensor<int32_t> posGm;
    uint32_t first = 0, last = 0;
};
"""


def emit_route(node: Node, name: str, experts: int, kt: int) -> AscendKernel:
    a = node.attrs
    top_k, bias = a["top_k"], len(node.inputs) > 4
    e_bytes = align(experts * 4)
    weight = "w[k]"
    if a.get("renormalize"):
        weight = "w[k] / (total + 1e-20f)"
    weight = f"({weight}) * {float(a.get('routed_scaling', 1.0)):.9e}f"
    scores = (SOFTMAX if a.get("scoring", "softmax") == "softmax" else SIGMOID).replace("$E", str(experts))
    choice = (f"        Add(choice, score, biasBuf.Get<float>(), {experts});\n" if bias
              else f"        Adds(choice, score, 0.0f, {experts});\n")
    n_group = a.get("n_group", 1)
    groups = "" if n_group == 1 else GROUPS.replace("$NG", str(n_group)).replace("$GE", str(experts // n_group)) \
        .replace("$TOPK_GROUP", str(a["topk_group"])).replace("$LOWEST", LOWEST)
    fields = rows_tiling(["shape", 0, 0], AIV_CORES)
    params = ["logits"] + (["bias"] if bias else []) + ["ids", "weights"]
    src = source(name, f"MoE routing: {a.get('scoring', 'softmax')} over {experts} experts, top-{top_k}", fields,
                 ROUTE, params, STAGES="            CopyIn(row);\n            Compute(row);\n",
                 E=experts, KT=kt, TOPK=top_k, E_BYTES=e_bytes, KT_BYTES=align(kt * 4), BLOCK=BLOCK,
                 COPY_IN=copy_row("x", f"logitGm[(uint64_t)row * {experts}]", experts, 4, False), SCORES=scores,
                 CHOICE=choice, GROUPS=groups, WEIGHT=weight, LOWEST=LOWEST,
                 BIAS_PARAM="GM_ADDR bias, " if bias else "", BIAS_BUF=", biasBuf" if bias else "",
                 BIAS_GM=", biasGm" if bias else "",
                 BIAS_INIT=(f"        biasGm.SetGlobalBuffer((__gm__ float*)bias, {experts});\n"
                            f"        pipe.InitBuffer(biasBuf, {e_bytes});\n"
                            f"        {copy_row('biasBuf.Get<float>()', 'biasGm', experts, 4, False)}\n"
                            "        WaitPipe<HardEvent::MTE2_V>();\n") if bias else "")
    args = [["tmp", 0]] + ([["in", 4]] if bias else []) + [["tmp", 1], ["tmp", 2]]
    return AscendKernel(name, src, args, fields, AIV_CORES)


def emit_fused_moe(node: Node, name: str) -> dict:
    """fused_moe(x, router_w, w13[E',2I,D], w2[E',D,I][, score_bias]) -> y[T,D] (see module doc).
    bf16 / f16: router logits and routing weights in fp32, expert rows in the model's dtype,
    the combine accumulated in fp32 and rounded once."""
    a = node.attrs
    x, router, w13 = node.inputs[0].type, node.inputs[1].type, node.inputs[2].type
    t, d = x.shape
    dt = x.dtype
    ct, size, half = CTYPE[dt], SIZE[dt], dt != "f32"
    experts, n_all, two_i = router.shape[0], w13.shape[0], w13.shape[1]
    kt = a["top_k"] + a.get("num_shared", 0)
    pairs = ["mul", ["shape", 0, 0], kt]
    tmps = [{"shape": [t, experts], "dtype": "f32"},     # 0 router logits
            {"shape": [t, kt], "dtype": "i32"},          # 1 expert ids
            {"shape": [t, kt], "dtype": "f32"},          # 2 routing weights
            {"shape": [t, kt], "dtype": "i32"},          # 3 pairs sorted by expert
            {"shape": [t, kt], "dtype": "i32"},          # 4 each pair's sorted row
            {"shape": [n_all + 1], "dtype": "i32"},      # 5 expert row offsets
            {"shape": [t, kt, d], "dtype": dt},          # 6 gathered rows
            {"shape": [t, kt, two_i], "dtype": dt},      # 7 gate | up
            {"shape": [t, kt, two_i // 2], "dtype": dt},  # 8 swiglu
            {"shape": [t, kt, d], "dtype": dt}]          # 9 expert outputs
    router_mm = emit_matmul(name + "_router", ["shape", 0, 0], experts, d, ["in", 0], ["in", 1], ["tmp", 0], dt, "f32")
    route = emit_route(node, name + "_route", experts, kt)
    sort_fields = [["pairs", "uint32_t", pairs]]
    sort = AscendKernel(name + "_sort", source(name + "_sort", f"MoE pairs sorted by expert ({n_all} experts)",
                                               sort_fields, SORT, ["ids", "rows", "pos", "offsets"], E=n_all),
                        [["tmp", 1], ["tmp", 3], ["tmp", 4], ["tmp", 5]], sort_fields, 1)
    gather = emit_gather(node, name + "_gather", ids_arg=["tmp", 3], y_arg=["tmp", 6], rows=pairs, div=kt,
                         ids_dtype="i32")
    up = emit_grouped_matmul(name + "_up", pairs, n_all, two_i, d, ["tmp", 6], ["in", 2], ["tmp", 7], ["tmp", 5], dt)
    swiglu = emit_swiglu(node, name + "_swiglu", ["tmp", 7], ["tmp", 8], i=two_i // 2, rows=pairs)
    down = emit_grouped_matmul(name + "_down", pairs, n_all, d, two_i // 2, ["tmp", 8], ["in", 3], ["tmp", 9],
                               ["tmp", 5], dt)
    if half:
        acc = "        LocalTensor<float> acc = accBuf.Get<float>();\n"
        ys_f32 = (f"            LocalTensor<float> yf = ysBuf.Get<float>();\n"
                  f"            {to_f32('yf', 'ysLocal', d)}\n")
        store = (f"        LocalTensor<{ct}> o = outQueue.AllocTensor<{ct}>();\n        {from_f32('o', 'acc', d)}\n"
                 "        outQueue.EnQue(o);\n")
        half_init = f"        pipe.InitBuffer(accBuf, {align(d * 4)});\n        pipe.InitBuffer(ysBuf, {align(d * 4)});\n"
        half_bufs = "\n    TBuf<QuePosition::VECCALC> accBuf, ysBuf;"
    else:
        acc = "        LocalTensor<float> acc = outQueue.AllocTensor<float>();\n"
        ys_f32 = "            LocalTensor<float> yf = ysLocal;\n"
        store, half_init, half_bufs = "        outQueue.EnQue(acc);\n", "", ""
    combine_fields = rows_tiling(["shape", 0, 0], AIV_CORES)
    combine = AscendKernel(name, source(name, f"MoE combine: weighted sum of each token's {kt} expert rows, {dt}",
                                        combine_fields, COMBINE, ["ys", "pos", "weights", "y"],
                                        STAGES="            Compute(row);\n            CopyOut(row);\n",
                                        KT=kt, D=d, T=ct, ROW_BYTES=align(d * size), ACC=acc, YS_F32=ys_f32,
                                        STORE=store, HALF_INIT=half_init, HALF_BUFS=half_bufs,
                                        COPY_IN=copy_row("ysLocal", f"ysGm[p * {d}]", d, size, False, ct),
                                        COPY_OUT=copy_row(f"yGm[(uint64_t)row * {d}]", "acc", d, size, True)),
                           [["tmp", 9], ["tmp", 4], ["tmp", 2], ["out", 0]], combine_fields, AIV_CORES)
    return {"kernels": [router_mm, route, sort, gather, up, swiglu, down, combine], "tmps": tmps}
