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
from .kernel import AIV_CORES, BLOCK, CTYPE, KV_BLOCK, UB_BYTES, AscendKernel, align, copy_row, rows_tiling

ROPE = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR qkv, GM_ADDR positions, GM_ADDR cache, GM_ADDR slots, ${NORM_PARAMS}GM_ADDR q,
                                const ${NAME}_tiling& t)
    {
$ROWS_INIT        vOffset = (uint64_t)t.cacheBlocks * $CACHE_ROWS;
        qkvGm.SetGlobalBuffer((__gm__ float*)qkv, (uint64_t)t.rows * $W);
        posGm.SetGlobalBuffer((__gm__ $PT*)positions, t.rows);
        slotGm.SetGlobalBuffer((__gm__ $ST*)slots, t.rows);
        cacheGm.SetGlobalBuffer((__gm__ float*)cache, 2 * vOffset);
        qGm.SetGlobalBuffer((__gm__ float*)q, (uint64_t)t.rows * $Q);
        pipe.InitBuffer(inQueue, BUFFER_NUM, $W_BYTES);
        pipe.InitBuffer(outQueue, BUFFER_NUM, $W_BYTES);
        pipe.InitBuffer(freqBuf, $HALF_BYTES * 4);  // inv_freq | freqs | cos | sin
        pipe.InitBuffer(workBuf, $HD_BYTES);
        pipe.InitBuffer(sumBuf, $BLOCK);
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
        LocalTensor<float> x = inQueue.AllocTensor<float>();
        $COPY_IN
        inQueue.EnQue(x);
    }
    __aicore__ inline void Compute(uint32_t row)
    {
        LocalTensor<float> x = inQueue.DeQue<float>();
        LocalTensor<float> y = outQueue.AllocTensor<float>();
        LocalTensor<float> f = freqBuf.Get<float>();
        float pos = (float)posGm.GetValue(row);
        Muls(f[$HALF_PAD], f, pos, $HALF);
        Cos(f[2 * $HALF_PAD], f[$HALF_PAD], $HALF);
        Sin(f[3 * $HALF_PAD], f[$HALF_PAD], $HALF);
        for (uint32_t h = 0; h < $HEADS_QK; h++) {
            LocalTensor<float> src = x[h * $HD];
$NORM_COMPUTE            Rotate(y[h * $HD], src, f[2 * $HALF_PAD], f[3 * $HALF_PAD]);
        }
        DataCopy(y[$QK], x[$QK], $KV);  // v as it is
        outQueue.EnQue(y);
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
        LocalTensor<float> y = outQueue.DeQue<float>();
        uint64_t slot = (uint64_t)slotGm.GetValue(row);
        DataCopy(qGm[(uint64_t)row * $Q], y, $Q);
        DataCopy(cacheGm[slot * $KV], y[$Q], $KV);
        DataCopy(cacheGm[vOffset + slot * $KV], y[$QK], $KV);
        outQueue.FreeTensor(y);
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue;
    TQue<QuePosition::VECOUT, BUFFER_NUM> outQueue;
    TBuf<QuePosition::VECCALC> freqBuf, workBuf, sumBuf$NORM_BUFS;
    GlobalTensor<float> qkvGm, cacheGm, qGm$NORM_GMS;
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
        ReduceSum(sum, work, work, $HD);
        WaitPipe<HardEvent::V_S>();
        float rstd = 1.0f / (float)sqrt((double)(sum.GetValue(0) / (float)$HD + $EPS));
        Muls(x, x, rstd, $HD);
        Mul(x, x, w, $HD);
    }
"""

ATTENTION = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR q, GM_ADDR cache, GM_ADDR tables, GM_ADDR seqLens, GM_ADDR queryLens, GM_ADDR out,
                                const ${NAME}_tiling& t)
    {
        first = GetBlockIdx() * t.tasksPerCore;
        last = first + t.tasksPerCore < t.tasks ? first + t.tasksPerCore : t.tasks;
        seqs = t.seqs;
        tableStride = t.tableStride;
        vOffset = (uint64_t)t.cacheBlocks * $BS * $KV;
        qGm.SetGlobalBuffer((__gm__ float*)q, (uint64_t)t.rows * $Q);
        outGm.SetGlobalBuffer((__gm__ float*)out, (uint64_t)t.rows * $Q);
        cacheGm.SetGlobalBuffer((__gm__ float*)cache, 2 * vOffset);
        tableGm.SetGlobalBuffer((__gm__ $TT*)tables, (uint64_t)t.seqs * t.tableStride);
        seqLenGm.SetGlobalBuffer((__gm__ $LT*)seqLens, t.seqs);
        queryLenGm.SetGlobalBuffer((__gm__ $QLT*)queryLens, t.seqs);
        pipe.InitBuffer(qQueue, 1, $GROUP_BYTES);
        pipe.InitBuffer(kQueue, BUFFER_NUM, $BLOCK_BYTES);
        pipe.InitBuffer(vQueue, BUFFER_NUM, $BLOCK_BYTES);
        pipe.InitBuffer(outQueue, 1, $GROUP_BYTES);
        pipe.InitBuffer(workBuf, $HD_BYTES);
        pipe.InitBuffer(scoreBuf, $SCORE_BYTES);  // a 32-byte slot per key's dot product
        pipe.InitBuffer(probBuf, $PROB_BYTES);  // a block's scores, then exp(score - max) | correction
    }
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
        LocalTensor<float> qLocal = qQueue.AllocTensor<float>();
        DataCopy(qLocal, qGm[(uint64_t)row * $Q + kvh * $GROUP_HD], $GROUP_HD);
        qQueue.EnQue(qLocal);
        qLocal = qQueue.DeQue<float>();
        LocalTensor<float> acc = outQueue.AllocTensor<float>();
        Duplicate(acc, 0.0f, $GROUP_HD);
        float m[$GROUP], l[$GROUP];
        for (uint32_t g = 0; g < $GROUP; g++) {
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        for (int64_t b = lo / $BS; b <= pos / $BS; b++) {
            uint64_t block = (uint64_t)tableGm.GetValue((uint64_t)seq * tableStride + b);
            int64_t j0 = b * $BS > lo ? b * $BS : lo;
            int64_t j1 = b * $BS + $BS - 1 < pos ? b * $BS + $BS - 1 : pos;
            LocalTensor<float> kLocal = kQueue.AllocTensor<float>();
            LocalTensor<float> vLocal = vQueue.AllocTensor<float>();
            DataCopyExtParams rows{$BS, $HD * 4, ($HKV - 1) * $HD * 4, 0, 0};
            uint64_t at = (block * $BS * $HKV + kvh) * $HD;
            DataCopyPad(kLocal, cacheGm[at], rows, DataCopyPadExtParams<float>{false, 0, 0, 0});
            DataCopyPad(vLocal, cacheGm[vOffset + at], rows, DataCopyPadExtParams<float>{false, 0, 0, 0});
            kQueue.EnQue(kLocal);
            vQueue.EnQue(vLocal);
            kLocal = kQueue.DeQue<float>();
            vLocal = vQueue.DeQue<float>();
            for (uint32_t g = 0; g < $GROUP; g++) {
                OnlineSoftmax(qLocal[g * $HD], kLocal, vLocal, acc[g * $HD], (uint32_t)(j0 - b * $BS),
                              (uint32_t)(j1 - j0 + 1), m[g], l[g]);
            }
            kQueue.FreeTensor(kLocal);
            vQueue.FreeTensor(vLocal);
        }
        for (uint32_t g = 0; g < $GROUP; g++) {
            Muls(acc[g * $HD], acc[g * $HD], 1.0f / l[g], $HD);
        }
        qQueue.FreeTensor(qLocal);
        outQueue.EnQue(acc);
        acc = outQueue.DeQue<float>();
        DataCopy(outGm[(uint64_t)row * $Q + kvh * $GROUP_HD], acc, $GROUP_HD);
        outQueue.FreeTensor(acc);
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
            ReduceSum(score[j * 8], work, work, $HD);
        }
        WaitPipe<HardEvent::V_S>();
        float blockMax = -INFINITY;
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
    TBuf<QuePosition::VECCALC> workBuf, scoreBuf, probBuf;
    GlobalTensor<float> qGm, outGm, cacheGm;
    GlobalTensor<$TT> tableGm;
    GlobalTensor<$LT> seqLenGm;
    GlobalTensor<$QLT> queryLenGm;
    uint32_t first = 0, last = 0, seqs = 0, tableStride = 0;
    uint64_t vOffset = 0;
};
"""


def inv_freq_table(head_dim: int, theta: float) -> str:
    """The rope inverse frequencies exactly as the reference computes them (fp32), as C++."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return ", ".join(f"{float(v):.9e}f" for v in inv)


def emit_qkv_attention(node: Node, name: str) -> dict:
    """qkv_attention(qkv, positions, kv_cache, slots, block_tables, seq_lens, query_lens[, q_norm, k_norm])."""
    a = node.attrs
    hd, h, hkv = a["head_dim"], a["num_heads"], a["num_kv_heads"]
    qs, ks, vs = a["sizes"]
    cache = node.inputs[2].type
    bs = cache.shape[2] if isinstance(cache.shape[2], int) else KV_BLOCK  # a step dim: fixed at compile time
    w = qs + ks + vs
    half = hd // 2
    norms = len(node.inputs) > 7
    dt = [CTYPE[v.type.dtype] for v in node.inputs]
    if 2 * 2 * align(w * 4) + 4 * align(half * 4) + align(hd * 4) + BLOCK > UB_BYTES:
        raise ValueError(f"{name}: a qkv row of {w} does not fit the unified buffer")
    rope_fields = rows_tiling(["shape", 0, 0], AIV_CORES, [["cacheBlocks", "uint32_t", ["shape", 2, 1]]])
    norm = dict(NORM_PARAMS="", NORM_INIT="", NORM_COMPUTE="", NORM_FN="", NORM_BUFS="", NORM_GMS="")
    if norms:
        norm = dict(
            NORM_PARAMS="GM_ADDR qNorm, GM_ADDR kNorm, ",
            NORM_INIT=(f"        qNormGm.SetGlobalBuffer((__gm__ float*)qNorm, {hd});\n"
                       f"        kNormGm.SetGlobalBuffer((__gm__ float*)kNorm, {hd});\n"
                       f"        pipe.InitBuffer(normBuf, {2 * align(hd * 4)});\n"
                       f"        DataCopy(normBuf.Get<float>(), qNormGm, {hd});\n"
                       f"        DataCopy(normBuf.Get<float>()[{align(hd * 4) // 4}], kNormGm, {hd});\n"
                       "        WaitPipe<HardEvent::MTE2_V>();\n"),
            NORM_COMPUTE=(f"            HeadNorm(src, normBuf.Get<float>()[h < {h} ? 0 : {align(hd * 4) // 4}]);\n"),
            NORM_FN=NORM_FN.replace("$HD", str(hd)).replace("$EPS", f"{float(a['qk_norm_eps']):.9e}f"),
            NORM_BUFS=", normBuf", NORM_GMS=", qNormGm, kNormGm")
    half_pad = align(half * 4) // 4
    body = ROPE.replace("class Kernel_$NAME", "constexpr float INV_FREQ[$HALF] = {" + inv_freq_table(hd, a["theta"])
                        + "};\n\nclass Kernel_$NAME")
    rope_params = ["qkv", "positions", "cache", "slots"] + (["qNorm", "kNorm"] if norms else []) + ["q"]
    rope_src = source(name + "_rope", f"q/k {'head RMSNorm + ' if norms else ''}RoPE and the paged KV-cache write",
                      rope_fields, body, rope_params,
                      STAGES="            CopyIn(row);\n            Compute(row);\n            CopyOut(row);\n",
                      W=w, W_BYTES=align(w * 4), Q=qs, QK=qs + ks, KV=ks, HD=hd, HD_BYTES=align(hd * 4), HALF=half,
                      HALF_PAD=half_pad, HALF_BYTES=half_pad * 4, HEADS_QK=h + hkv, BLOCK=BLOCK, PT=dt[1], ST=dt[3],
                      CACHE_ROWS=bs * ks, COPY_IN=copy_row("x", f"qkvGm[(uint64_t)row * {w}]", w, 4, False), **norm)
    rope_args = [["in", 0], ["in", 1], ["in", 2], ["in", 3]] + ([["in", 7], ["in", 8]] if norms else []) + [["tmp", 0]]
    requires = [[2, 2, bs, "KV-cache block size"]]
    rope = AscendKernel(name + "_rope", rope_src, rope_args, rope_fields, AIV_CORES, requires=requires)

    group = h // hkv
    tasks = ["mul", ["shape", 0, 0], hkv]
    att_fields = [["rows", "uint32_t", ["shape", 0, 0]], ["tasks", "uint32_t", tasks],
                  ["tasksPerCore", "uint32_t", ["cdiv", tasks, AIV_CORES]], ["seqs", "uint32_t", ["shape", 6, 0]],
                  ["tableStride", "uint32_t", ["shape", 4, 1]], ["cacheBlocks", "uint32_t", ["shape", 2, 1]]]
    att_src = source(name, f"paged GQA attention, {group} q heads per kv head, online softmax", att_fields, ATTENTION,
                     ["q", "cache", "tables", "seqLens", "queryLens", "out"],
                     Q=qs, KV=ks, HD=hd, HD_BYTES=align(hd * 4), HKV=hkv, GROUP=group, GROUP_HD=group * hd,
                     GROUP_BYTES=align(group * hd * 4), BS=bs, BLOCK_BYTES=align(bs * hd * 4),
                     SCORE_BYTES=bs * BLOCK, PROB_BYTES=align((bs + 1) * 4), WINDOW=int(a.get("window", 0)),
                     SCALE=f"{float(a['scale']):.9e}f", TT=dt[4], LT=dt[5], QLT=dt[6])
    att = AscendKernel(name, att_src, [["tmp", 0], ["in", 2], ["in", 4], ["in", 5], ["in", 6], ["out", 0]],
                       att_fields, AIV_CORES, requires=requires)
    return {"kernels": [rope, att], "tmps": [{"shape": [node.inputs[0].type.shape[0], qs], "dtype": "f32"}]}
