"""AscendC qkv_attention for Ascend 950: two vector kernels.

1. `_rope`: per token row of qkv [T, Q+K+V]: optional per-head RMSNorm of q and k (Qwen3), RoPE
   (rotate-half; cos/sin of position x inv_freq on the vector unit), q into the launch's scratch
   [T, Q], k and v into the paged cache [2, N, BS, Hkv, hd] at the token's slot.
2. the attention: per (token, kv head) task, the group of q heads that share the kv head, an
   online softmax over the sequence's cache blocks (block table lookups on the scalar unit; K
   and V blocks copied in with strided DataCopyPad), causal and optionally sliding-window.
Scores are per-key dot products on the vector unit (Mul + ReduceSum), not cube matmuls: correct
for decode and prefill, but a prefill-speed attention would put QK^T and PV on the cube.
"""
from __future__ import annotations

import torch

from ...ir import Node
from .emit import source
from .kernel import (
    AIV_CORES,
    BLOCK,
    CTYPE,
    KV_BLOCK,
    LOWEST,
    SIZE,
    UB_BYTES,
    AscendKernel,
    align,
    copy_row,
    from_f32,
    reduce_tmp_bytes,
    rows_tiling,
    rstd_on_vector,
    to_f32,
)

ROPE = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR qkv, GM_ADDR positions, GM_ADDR cache, GM_ADDR slots, ${NORM_PARAMS}GM_ADDR q,
                                const ${NAME}_tiling& t)
    {
$ROWS_INIT        vOffset = (uint64_t)t.cacheBlocks * $CACHE_ROWS;
        qkvGm.SetGlobalBuffer((__gm__ $T*)qkv, (uint64_t)t.rows * $W);
        posGm.SetGlobalBuffer((__gm__ $PT*)positions, t.rows);
        slotGm.SetGlobalBuffer((__gm__ $ST*)slots, t.rows);
        cacheGm.SetGlobalBuffer((__gm__ $T*)cache, 2 * vOffset);
        qGm.SetGlobalBuffer((__gm__ $T*)q, (uint64_t)t.rows * $Q);
        pipe.InitBuffer(inQueue, BUFFER_NUM, $W_BYTES);
        pipe.InitBuffer(outQueue, BUFFER_NUM, $W_BYTES);
$HALF_INIT
        pipe.InitBuffer(freqBuf, $HALF_BYTES * 4);  // inv_freq | freqs | cos | sin
        pipe.InitBuffer(workBuf, $HD_BYTES);
        pipe.InitBuffer(sumBuf, 2 * $BLOCK);
        LocalTensor<float> invFreq = freqBuf.Get<float>();
        for (uint32_t i = 0; i < $HALF; i++) {
            invFreq.SetValue(i, INV_FREQ[i]);
        }
$NORM_INIT        WaitPipe<HardEvent::S_V>();
    }
$PROCESS_ROWS
private:
    __aicore__ inline void CopyIn(uint32_t row)
    {
        LocalTensor<$T> x = inQueue.AllocTensor<$T>();
        $COPY_IN
        inQueue.EnQue(x);
    }
    __aicore__ inline void Compute(uint32_t row)
    {
        LocalTensor<$T> x = inQueue.DeQue<$T>();
        LocalTensor<$T> y = outQueue.AllocTensor<$T>();
$TO_F32        LocalTensor<float> f = freqBuf.Get<float>();
        float pos = (float)posGm.GetValue(row);
        Muls(f[$HALF_PAD], f, pos, $HALF);
        Cos(f[2 * $HALF_PAD], f[$HALF_PAD], $HALF);
        Sin(f[3 * $HALF_PAD], f[$HALF_PAD], $HALF);
        for (uint32_t h = 0; h < $HEADS_QK; h++) {
            LocalTensor<float> src = xf[h * $HD];
$NORM_COMPUTE            Rotate(yf[h * $HD], src, f[2 * $HALF_PAD], f[3 * $HALF_PAD]);
        }
        DataCopy(yf[$QK], xf[$QK], $KV);  // v as it is
$FROM_F32        outQueue.EnQue(y);
        inQueue.FreeTensor(x);
    }
    // rotate-half RoPE of one head: [x1 cos - x2 sin | x2 cos + x1 sin]
    __aicore__ inline void Rotate(const LocalTensor<float>& y, const LocalTensor<float>& x,
                                  const LocalTensor<float>& cosT, const LocalTensor<float>& sinT)
    {
        LocalTensor<float> work = workBuf.Get<float>();
        Mul(y, x, cosT, $HALF);
        Mul(work, x[$HALF], sinT, $HALF);
        Sub(y, y, work, $HALF);
        Mul(y[$HALF], x[$HALF], cosT, $HALF);
        Mul(work, x, sinT, $HALF);
        Add(y[$HALF], y[$HALF], work, $HALF);
    }
$NORM_FN    __aicore__ inline void CopyOut(uint32_t row)
    {
        LocalTensor<$T> y = outQueue.DeQue<$T>();
        uint64_t slot = (uint64_t)slotGm.GetValue(row);
        DataCopy(qGm[(uint64_t)row * $Q], y, $Q);
        DataCopy(cacheGm[slot * $KV], y[$Q], $KV);
        DataCopy(cacheGm[vOffset + slot * $KV], y[$QK], $KV);
        outQueue.FreeTensor(y);
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue;
    TQue<QuePosition::VECOUT, BUFFER_NUM> outQueue;
    TBuf<QuePosition::VECCALC> freqBuf, workBuf, sumBuf$NORM_BUFS$HALF_BUFS;
    GlobalTensor<$T> qkvGm, cacheGm, qGm$NORM_GMS;
    GlobalTensor<$PT> posGm;
    GlobalTensor<$ST> slotGm;
    uint32_t first = 0, last = 0;
    uint64_t vOffset = 0;
};
"""
NORM_FN = """\
    // RMSNorm of one head over its $HD features, times w
    __aicore__ inline void HeadNorm(const LocalTensor<float>& x, const LocalTensor<float>& w)
    {
        LocalTensor<float> work = workBuf.Get<float>();
        LocalTensor<float> sum = sumBuf.Get<float>();
        Mul(work, x, x, $HD);
        ReduceSum(sum, work, reduceBuf.Get<float>(), $HD);
$RSTD        float rstd = sum.GetValue(0);
        Muls(x, x, rstd, $HD);
        Mul(x, x, w, $HD);
    }
"""

ATTENTION = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR q, GM_ADDR cache, GM_ADDR tables, GM_ADDR seqLens, GM_ADDR queryLens, GM_ADDR out,
                                ${SINK_PARAM}const ${NAME}_tiling& t)
    {
        first = GetBlockIdx() * t.tasksPerCore;
        last = first + t.tasksPerCore < t.tasks ? first + t.tasksPerCore : t.tasks;
        seqs = t.seqs;
        tableStride = t.tableStride;
        vOffset = (uint64_t)t.cacheBlocks * $BS * $KV;
        qGm.SetGlobalBuffer((__gm__ $T*)q, (uint64_t)t.rows * $Q);
        outGm.SetGlobalBuffer((__gm__ $T*)out, (uint64_t)t.rows * $Q);
        cacheGm.SetGlobalBuffer((__gm__ $T*)cache, 2 * vOffset);
        tableGm.SetGlobalBuffer((__gm__ $TT*)tables, (uint64_t)t.seqs * t.tableStride);
        seqLenGm.SetGlobalBuffer((__gm__ $LT*)seqLens, t.seqs);
        queryLenGm.SetGlobalBuffer((__gm__ $QLT*)queryLens, t.seqs);
$SINK_INIT        pipe.InitBuffer(qQueue, 1, $GROUP_BYTES);
        pipe.InitBuffer(kQueue, BUFFER_NUM, $BLOCK_BYTES);
        pipe.InitBuffer(vQueue, BUFFER_NUM, $BLOCK_BYTES);
        pipe.InitBuffer(outQueue, 1, $GROUP_BYTES);
        pipe.InitBuffer(workBuf, $HD_BYTES);
        pipe.InitBuffer(scoreBuf, $SCORE_BYTES);  // a 32-byte slot per key's dot product
        pipe.InitBuffer(probBuf, $PROB_BYTES);  // a block's scores, then exp(score - max) | correction
        pipe.InitBuffer(reduceBuf, $REDUCE_BYTES);  // ReduceSum's scratch
$HALF_INIT    }
    __aicore__ inline void Process()
    {
        for (uint32_t task = first; task < last; task++) {
            Attend(task / $HKV, task % $HKV);
        }
    }

private:
    // the $GROUP q heads of token `row` that read kv head `kvh`
    __aicore__ inline void Attend(uint32_t row, uint32_t kvh)
    {
        // the token's sequence and position: rows are grouped by sequence, each its last queryLen tokens
        uint32_t seq = 0, end = 0;
        for (; seq < seqs; seq++) {
            end += (uint32_t)queryLenGm.GetValue(seq);
            if (row < end) {
                break;
            }
        }
        int64_t pos = (int64_t)seqLenGm.GetValue(seq) - (int64_t)(end - row);
        int64_t lo = $WINDOW > 0 && pos - $WINDOW + 1 > 0 ? pos - $WINDOW + 1 : 0;
        LocalTensor<$T> qLocal = qQueue.AllocTensor<$T>();
        DataCopy(qLocal, qGm[(uint64_t)row * $Q + kvh * $GROUP_HD], $GROUP_HD);
        qQueue.EnQue(qLocal);
        qLocal = qQueue.DeQue<$T>();
$LOAD_Q
        Duplicate(acc, 0.0f, $GROUP_HD);
        float m[$GROUP], l[$GROUP];
        for (uint32_t g = 0; g < $GROUP; g++) {
$SOFTMAX_INIT        }
        for (int64_t b = lo / $BS; b <= pos / $BS; b++) {
            uint64_t block = (uint64_t)tableGm.GetValue((uint64_t)seq * tableStride + b);
            int64_t j0 = b * $BS > lo ? b * $BS : lo;
            int64_t j1 = b * $BS + $BS - 1 < pos ? b * $BS + $BS - 1 : pos;
            LocalTensor<$T> kLocal = kQueue.AllocTensor<$T>();
            LocalTensor<$T> vLocal = vQueue.AllocTensor<$T>();
            DataCopyExtParams rows{$BS, $HD * $SIZE, ($HKV - 1) * $HD * $SIZE, 0, 0};
            uint64_t at = (block * $BS * $HKV + kvh) * $HD;
            DataCopyPad(kLocal, cacheGm[at], rows, DataCopyPadExtParams<$T>{false, 0, 0, 0});
            DataCopyPad(vLocal, cacheGm[vOffset + at], rows, DataCopyPadExtParams<$T>{false, 0, 0, 0});
            kQueue.EnQue(kLocal);
            vQueue.EnQue(vLocal);
            kLocal = kQueue.DeQue<$T>();
            vLocal = vQueue.DeQue<$T>();
$LOAD_KV            for (uint32_t g = 0; g < $GROUP; g++) {
                OnlineSoftmax(qf[g * $HD], kf, vf, acc[g * $HD], (uint32_t)(j0 - b * $BS),
                              (uint32_t)(j1 - j0 + 1), m[g], l[g]);
            }
            kQueue.FreeTensor(kLocal);
            vQueue.FreeTensor(vLocal);
        }
        for (uint32_t g = 0; g < $GROUP; g++) {
            Muls(acc[g * $HD], acc[g * $HD], 1.0f / l[g], $HD);
        }
        qQueue.FreeTensor(qLocal);
$STORE
    }
    // one q head over keys j0 .. j0+n-1 of a block: m, l and acc updated online
    __aicore__ inline void OnlineSoftmax(const LocalTensor<float>& q, const LocalTensor<float>& k,
                                         const LocalTensor<float>& v, const LocalTensor<float>& acc, uint32_t j0,
                                         uint32_t n, float& m, float& l)
    {
        LocalTensor<float> work = workBuf.Get<float>();
        LocalTensor<float> score = scoreBuf.Get<float>();
        LocalTensor<float> p = probBuf.Get<float>();
        for (uint32_t j = 0; j < n; j++) {
            Mul(work, k[(j0 + j) * $HD], q, $HD);
            ReduceSum(score[j * 8], work, reduceBuf.Get<float>(), $HD);
        }
        WaitPipe<HardEvent::V_S>();
        float blockMax = $LOWEST;
        for (uint32_t j = 0; j < n; j++) {
            float s = score.GetValue(j * 8) * $SCALE;
            p.SetValue(j, s);
            blockMax = s > blockMax ? s : blockMax;
        }
        float mNew = m > blockMax ? m : blockMax;
        p.SetValue(n, m - mNew);
        WaitPipe<HardEvent::S_V>();
        Adds(p, p, -mNew, n);
        Exp(p, p, n + 1);  // p[j] = exp(s_j - mNew), p[n] = exp(m - mNew)
        WaitPipe<HardEvent::V_S>();
        float corr = p.GetValue(n);
        float probs[$BS];
        float sum = 0.0f;
        for (uint32_t j = 0; j < n; j++) {
            probs[j] = p.GetValue(j);
            sum += probs[j];
        }
        Muls(acc, acc, corr, $HD);
        for (uint32_t j = 0; j < n; j++) {
            Axpy(acc, v[(j0 + j) * $HD], probs[j], $HD);
        }
        m = mNew;
        l = l * corr + sum;
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, 1> qQueue;
    TQue<QuePosition::VECIN, BUFFER_NUM> kQueue, vQueue;
    TQue<QuePosition::VECOUT, 1> outQueue;
    TBuf<QuePosition::VECCALC> workBuf, scoreBuf, probBuf, reduceBuf$HALF_BUFS;
    GlobalTensor<$T> qGm, outGm, cacheGm;
    GlobalTensor<$TT> tableGm;
    GlobalTensor<$LT> seqLenGm;
    GlobalTensor<$QLT> queryLenGm;
    uint32_t first = 0, last = 0, seqs = 0, tableStride = 0;
    uint64_t vOffset = 0;
$SINK_GM};
"""
# the online softmax starts empty, or (learned sinks) at the sink logit with weight exp(0) = 1
SOFTMAX_EMPTY = f"            m[g] = {LOWEST};\n            l[g] = 0.0f;\n"
SOFTMAX_SINK = "            m[g] = (float)sinkGm.GetValue(kvh * $GROUP + g);\n            l[g] = 1.0f;\n"


def inv_freq_table(head_dim: int, theta: float) -> str:
    """The rope inverse frequencies exactly as the reference computes them (fp32), as C++."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return ", ".join(f"{float(v):.9e}f" for v in inv)


def emit_qkv_attention(node: Node, name: str) -> dict:
    """qkv_attention(qkv, positions, kv_cache, slots, block_tables, seq_lens, query_lens[, q_norm, k_norm][, sinks]).
    bf16 / f16: rows and cache blocks are cast to fp32 in UB; q, k, v are rounded once, after RoPE.
    Sinks (f32 [H]) are read as scalars: they start each head's online softmax."""
    a = node.attrs
    hd, h, hkv = a["head_dim"], a["num_heads"], a["num_kv_heads"]
    qs, ks, vs = a["sizes"]
    cache = node.inputs[2].type
    bs = cache.shape[2] if isinstance(cache.shape[2], int) else KV_BLOCK  # a step dim: fixed at compile time
    dt = node.inputs[0].type.dtype
    t, size, half = CTYPE[dt], SIZE[dt], dt != "f32"
    w = qs + ks + vs
    hp = hd // 2
    norms, sinks = "qk_norm_eps" in a, a.get("sinks", False)
    it = [CTYPE[v.type.dtype] for v in node.inputs]
    if 2 * 2 * align(w * size) + (2 * align(w * 4) if half else 0) + 4 * align(hp * 4) + align(hd * 4) + 2 * BLOCK \
            > UB_BYTES:
        raise ValueError(f"{name}: a qkv row of {w} does not fit the unified buffer")
    rope_fields = rows_tiling(["shape", 0, 0], AIV_CORES, [["cacheBlocks", "uint32_t", ["shape", 2, 1]]])
    norm = dict(NORM_PARAMS="", NORM_INIT="", NORM_COMPUTE="", NORM_FN="", NORM_BUFS="", NORM_GMS="")
    if norms:
        k_raw, k_f32 = align(hd * size) // size, align(hd * 4) // 4  # k_norm's offset after q_norm
        raw = (f"        pipe.InitBuffer(rawNormBuf, {2 * align(hd * size)});\n"
               f"        DataCopy(rawNormBuf.Get<{t}>(), qNormGm, {hd});\n"
               f"        DataCopy(rawNormBuf.Get<{t}>()[{k_raw}], kNormGm, {hd});\n"
               "        WaitPipe<HardEvent::MTE2_V>();\n"
               f"        {to_f32('normBuf.Get<float>()', f'rawNormBuf.Get<{t}>()', hd)}\n"
               f"        {to_f32(f'normBuf.Get<float>()[{k_f32}]', f'rawNormBuf.Get<{t}>()[{k_raw}]', hd)}\n"
               ) if half else (
               f"        DataCopy(normBuf.Get<float>(), qNormGm, {hd});\n"
               f"        DataCopy(normBuf.Get<float>()[{align(hd * 4) // 4}], kNormGm, {hd});\n"
               "        WaitPipe<HardEvent::MTE2_V>();\n")
        norm = dict(
            NORM_PARAMS="GM_ADDR qNorm, GM_ADDR kNorm, ",
            NORM_INIT=(f"        qNormGm.SetGlobalBuffer((__gm__ {t}*)qNorm, {hd});\n"
                       f"        kNormGm.SetGlobalBuffer((__gm__ {t}*)kNorm, {hd});\n"
                       f"        pipe.InitBuffer(normBuf, {2 * align(hd * 4)});\n"
                       f"        pipe.InitBuffer(reduceBuf, {reduce_tmp_bytes(hd)});\n" + raw),
            NORM_COMPUTE=(f"            HeadNorm(src, normBuf.Get<float>()[h < {h} ? 0 : {align(hd * 4) // 4}]);\n"),
            NORM_FN=NORM_FN.replace("$RSTD", rstd_on_vector("sum", hd, f"{float(a['qk_norm_eps']):.9e}f"))
            .replace("$HD", str(hd)),
            NORM_BUFS=", normBuf, reduceBuf" + (", rawNormBuf" if half else ""), NORM_GMS=", qNormGm, kNormGm")
    half_pad = align(hp * 4) // 4
    if half:
        to_f = ("        LocalTensor<float> xf = xfBuf.Get<float>();\n        LocalTensor<float> yf = yfBuf.Get<float>();\n"
                f"        {to_f32('xf', 'x', w)}\n")
        from_f = f"        {from_f32('y', 'yf', w)}\n"
        rope_half = dict(HALF_INIT=(f"        pipe.InitBuffer(xfBuf, {align(w * 4)});\n"
                                    f"        pipe.InitBuffer(yfBuf, {align(w * 4)});\n"), HALF_BUFS=", xfBuf, yfBuf")
    else:
        to_f, from_f = "        LocalTensor<float> xf = x;\n        LocalTensor<float> yf = y;\n", ""
        rope_half = dict(HALF_INIT="", HALF_BUFS="")
    body = ROPE.replace("class Kernel_$NAME", "constexpr float INV_FREQ[$HALF] = {" + inv_freq_table(hd, a["theta"])
                        + "};\n\nclass Kernel_$NAME")
    rope_params = ["qkv", "positions", "cache", "slots"] + (["qNorm", "kNorm"] if norms else []) + ["q"]
    rope_src = source(name + "_rope", f"q/k {'head RMSNorm + ' if norms else ''}RoPE and the paged KV-cache write, {dt}",
                      rope_fields, body, rope_params,
                      STAGES="            CopyIn(row);\n            Compute(row);\n            CopyOut(row);\n",
                      T=t, W=w, W_BYTES=align(w * size), Q=qs, QK=qs + ks, KV=ks, HD=hd, HD_BYTES=align(hd * 4),
                      HALF=hp, HALF_PAD=half_pad, HALF_BYTES=half_pad * 4, HEADS_QK=h + hkv, BLOCK=BLOCK, PT=it[1],
                      ST=it[3], CACHE_ROWS=bs * ks, TO_F32=to_f, FROM_F32=from_f,
                      COPY_IN=copy_row("x", f"qkvGm[(uint64_t)row * {w}]", w, size, False, t), **norm, **rope_half)
    rope_args = [["in", 0], ["in", 1], ["in", 2], ["in", 3]] + ([["in", 7], ["in", 8]] if norms else []) + [["tmp", 0]]
    requires = [[2, 2, bs, "KV-cache block size"]]
    rope = AscendKernel(name + "_rope", rope_src, rope_args, rope_fields, AIV_CORES, requires=requires)

    group = h // hkv
    ghd = group * hd
    tasks = ["mul", ["shape", 0, 0], hkv]
    att_fields = [["rows", "uint32_t", ["shape", 0, 0]], ["tasks", "uint32_t", tasks],
                  ["tasksPerCore", "uint32_t", ["cdiv", tasks, AIV_CORES]], ["seqs", "uint32_t", ["shape", 6, 0]],
                  ["tableStride", "uint32_t", ["shape", 4, 1]], ["cacheBlocks", "uint32_t", ["shape", 2, 1]]]
    if half:
        load_q = ("        LocalTensor<float> qf = qfBuf.Get<float>();\n"
                  f"        {to_f32('qf', 'qLocal', ghd)}\n        LocalTensor<float> acc = accBuf.Get<float>();\n")
        load_kv = ("            LocalTensor<float> kf = kfBuf.Get<float>();\n"
                   "            LocalTensor<float> vf = vfBuf.Get<float>();\n"
                   f"            {to_f32('kf', 'kLocal', bs * hd)}\n            {to_f32('vf', 'vLocal', bs * hd)}\n")
        store = (f"        LocalTensor<{t}> o = outQueue.AllocTensor<{t}>();\n        {from_f32('o', 'acc', ghd)}\n"
                 "        outQueue.EnQue(o);\n")
        att_half = dict(HALF_INIT=f"        pipe.InitBuffer(qfBuf, {align(ghd * 4)});\n"
                                  f"        pipe.InitBuffer(accBuf, {align(ghd * 4)});\n"
                                  f"        pipe.InitBuffer(kfBuf, {align(bs * hd * 4)});\n"
                                  f"        pipe.InitBuffer(vfBuf, {align(bs * hd * 4)});\n",
                        HALF_BUFS=", qfBuf, accBuf, kfBuf, vfBuf")
    else:
        load_q = "        LocalTensor<float> qf = qLocal;\n        LocalTensor<float> acc = outQueue.AllocTensor<float>();\n"
        load_kv = "            LocalTensor<float> kf = kLocal;\n            LocalTensor<float> vf = vLocal;\n"
        store = "        outQueue.EnQue(acc);\n"
        att_half = dict(HALF_INIT="", HALF_BUFS="")
    store += (f"        LocalTensor<{t}> out = outQueue.DeQue<{t}>();\n"
              f"        DataCopy(outGm[(uint64_t)row * {qs} + kvh * {ghd}], out, {ghd});\n"
              "        outQueue.FreeTensor(out);\n")
    st = CTYPE[node.inputs[-1].type.dtype]
    sink = dict(SINK_PARAM="GM_ADDR sinks, ", SINK_INIT=f"        sinkGm.SetGlobalBuffer((__gm__ {st}*)sinks, {h});\n",
                SINK_GM=f"    GlobalTensor<{st}> sinkGm;\n", SOFTMAX_INIT=SOFTMAX_SINK.replace("$GROUP", str(group))) \
        if sinks else dict(SINK_PARAM="", SINK_INIT="", SINK_GM="", SOFTMAX_INIT=SOFTMAX_EMPTY)
    att_src = source(name, f"paged GQA attention, {group} q heads per kv head, online softmax"
                     f"{' with sinks' if sinks else ''}, {dt}", att_fields,
                     ATTENTION, ["q", "cache", "tables", "seqLens", "queryLens", "out"] + (["sinks"] if sinks else []),
                     T=t, SIZE=size, Q=qs, KV=ks, HD=hd, HD_BYTES=align(hd * 4), HKV=hkv, GROUP=group, GROUP_HD=ghd,
                     GROUP_BYTES=align(ghd * size), BS=bs, BLOCK_BYTES=align(bs * hd * size),
                     SCORE_BYTES=bs * BLOCK, PROB_BYTES=align((bs + 1) * 4), WINDOW=int(a.get("window", 0)),
                     SCALE=f"{float(a['scale']):.9e}f", TT=it[4], LT=it[5], QLT=it[6], LOAD_Q=load_q, LOAD_KV=load_kv,
                     STORE=store, LOWEST=LOWEST, REDUCE_BYTES=reduce_tmp_bytes(hd), **att_half, **sink)
    att_args = [["tmp", 0], ["in", 2], ["in", 4], ["in", 5], ["in", 6], ["out", 0]]
    att = AscendKernel(name, att_src, att_args + ([["in", len(node.inputs) - 1]] if sinks else []),
                       att_fields, AIV_CORES, requires=requires)
    return {"kernels": [rope, att], "tmps": [{"shape": [node.inputs[0].type.shape[0], qs], "dtype": dt}]}
