"""AscendC kernels for the step's last ops on Ascend 950: sampling (greedy rows and
ir/sampling.py's draw) on the vector cores, and speculative verification (spec_verify) on one
core's scalar unit."""
from __future__ import annotations

from ...ir import Node
from .emit import source
from .kernel import AIV_CORES, BLOCK, AscendKernel, align, rows_tiling

SAMPLE = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR logits, GM_ADDR temp, GM_ADDR topK, GM_ADDR topP, GM_ADDR seeds, GM_ADDR y,
                                const ${NAME}_tiling& t)
    {
$ROWS_INIT        xGm.SetGlobalBuffer((__gm__ float*)logits, (uint64_t)t.rows * $V);
        tGm.SetGlobalBuffer((__gm__ float*)temp, t.rows);
        kGm.SetGlobalBuffer((__gm__ int64_t*)topK, t.rows);
        pGm.SetGlobalBuffer((__gm__ float*)topP, t.rows);
        seedGm.SetGlobalBuffer((__gm__ int64_t*)seeds, t.rows);
        yGm.SetGlobalBuffer((__gm__ int64_t*)y, t.rows);
        pipe.InitBuffer(inQueueX, BUFFER_NUM, $CHUNK_BYTES);
        pipe.InitBuffer(workBuf, $CHUNK_BYTES);
        pipe.InitBuffer(tBuf, $CHUNK_BYTES);
        pipe.InitBuffer(zBuf, $CHUNK_BYTES);
        pipe.InitBuffer(pBuf, $CHUNK_BYTES);
        pipe.InitBuffer(gBuf, $CHUNK_BYTES);
        pipe.InitBuffer(maxBuf, $BLOCK);
        pipe.InitBuffer(outBuf, $BLOCK);
    }
$PROCESS_ROWS
private:
    __aicore__ inline static uint32_t Bits(float f) { return *reinterpret_cast<uint32_t*>(&f); }
    // the order-preserving u32 image of f's bits
    __aicore__ inline static uint32_t Key(float f)
    {
        uint32_t b = Bits(f);
        return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    }
    // murmur3's 32-bit finalizer
    __aicore__ inline static uint32_t Fmix(uint32_t h)
    {
        h ^= h >> 16;
        h *= 0x85EBCA6Bu;
        h ^= h >> 13;
        h *= 0xC2B2AE35u;
        return h ^ (h >> 16);
    }

    // logits[row, c:c+n] through the queue
    __aicore__ inline LocalTensor<float> Load(uint32_t row, uint32_t c, uint32_t n)
    {
        LocalTensor<float> xLocal = inQueueX.AllocTensor<float>();
        DataCopyPad(xLocal, xGm[(uint64_t)row * $V + c], DataCopyExtParams{1, n * 4, 0, 0, 0},
                    DataCopyPadExtParams<float>{false, 0, 0, 0});
        inQueueX.EnQue(xLocal);
        return inQueueX.DeQue<float>();
    }

    // z = x / t over a chunk into zBuf (and p = exp(z - m) into pBuf where withP), ready for scalar reads
    __aicore__ inline void LoadZ(uint32_t row, uint32_t c, uint32_t n, bool withP, float m)
    {
        WaitPipe<HardEvent::S_V>();  // the scalar reads of the previous chunk are done
        LocalTensor<float> xLocal = Load(row, c, n);
        LocalTensor<float> z = zBuf.Get<float>();
        Div(z, xLocal, tBuf.Get<float>(), n);
        inQueueX.FreeTensor(xLocal);
        if (withP) {
            LocalTensor<float> p = pBuf.Get<float>();
            Adds(p, z, -m, n);
            Exp(p, p, n);
        }
        WaitPipe<HardEvent::V_S>();
    }

    // the row's first maximum, $CHUNK floats at a time
    __aicore__ inline uint32_t Greedy(uint32_t row)
    {
        float best = 0;
        uint32_t bestIdx = 0;
        for (uint32_t c = 0; c < $V; c += $CHUNK) {
            uint32_t n = $V - c < $CHUNK ? $V - c : $CHUNK;
            LocalTensor<float> xLocal = Load(row, c, n);
            LocalTensor<float> m = maxBuf.Get<float>();
            ReduceMax(m, xLocal, workBuf.Get<float>(), n, true);
            inQueueX.FreeTensor(xLocal);
            WaitPipe<HardEvent::V_S>();
            float value = m.GetValue(0);
            float bits = m.GetValue(1);
            uint32_t idx = *reinterpret_cast<uint32_t*>(&bits);
            if (c == 0 || value > best) {
                best = value;
                bestIdx = c + idx;
            }
        }
        return bestIdx;
    }

    // the top-k threshold on Key(z): the largest with at least k keys at or above it (0: all)
    __aicore__ inline uint32_t TopK(uint32_t row, int64_t k)
    {
        LocalTensor<float> z = zBuf.Get<float>();
        uint32_t tk = 0;
        for (uint32_t step = 0x80000000u; k > 0 && k < $V && step != 0; step >>= 1) {
            uint32_t cand = tk + step;
            int64_t count = 0;
            for (uint32_t c = 0; c < $V; c += $CHUNK) {
                uint32_t n = $V - c < $CHUNK ? $V - c : $CHUNK;
                LoadZ(row, c, n, false, 0);
                for (uint32_t i = 0; i < n; i++) {
                    count += Key(z.GetValue(i)) >= cand ? 1 : 0;
                }
            }
            tk = count >= k ? cand : tk;
        }
        return tk;
    }

    // the top-p threshold on the bits of p = exp(z - m) over the tokens kept by tk (0: all)
    __aicore__ inline uint32_t TopP(uint32_t row, float topP, uint32_t tk, float m)
    {
        LocalTensor<float> z = zBuf.Get<float>();
        LocalTensor<float> p = pBuf.Get<float>();
        float total = 0;
        for (uint32_t c = 0; c < $V && topP < 1.0f; c += $CHUNK) {
            uint32_t n = $V - c < $CHUNK ? $V - c : $CHUNK;
            LoadZ(row, c, n, true, m);
            for (uint32_t i = 0; i < n; i++) {
                total += Key(z.GetValue(i)) >= tk ? p.GetValue(i) : 0.0f;
            }
        }
        float target = topP * total;
        uint32_t tp = 0;
        for (uint32_t step = 0x40000000u; topP < 1.0f && step != 0; step >>= 1) {
            uint32_t cand = tp + step;
            float mass = 0;
            for (uint32_t c = 0; c < $V; c += $CHUNK) {
                uint32_t n = $V - c < $CHUNK ? $V - c : $CHUNK;
                LoadZ(row, c, n, true, m);
                for (uint32_t i = 0; i < n; i++) {
                    float pv = p.GetValue(i);
                    mass += (Key(z.GetValue(i)) >= tk && Bits(pv) >= cand) ? pv : 0.0f;
                }
            }
            tp = (mass > 0 && mass >= target) ? cand : tp;
        }
        return tp;
    }

    // ir/sampling.py's draw: the thresholds, then the first maximum of z - log(-log u) over the kept tokens
    __aicore__ inline uint32_t Draw(uint32_t row, float temp)
    {
        uint64_t seed = (uint64_t)seedGm.GetValue(row);
        uint32_t negInf = 0xFF800000u;
        float best = *reinterpret_cast<float*>(&negInf);
        float m = best;
        Duplicate(tBuf.Get<float>(), temp, $CHUNK);
        LocalTensor<float> z = zBuf.Get<float>();
        LocalTensor<float> p = pBuf.Get<float>();
        LocalTensor<float> g = gBuf.Get<float>();
        uint32_t tk = TopK(row, kGm.GetValue(row));
        for (uint32_t c = 0; c < $V; c += $CHUNK) {
            uint32_t n = $V - c < $CHUNK ? $V - c : $CHUNK;
            LoadZ(row, c, n, false, 0);
            for (uint32_t i = 0; i < n; i++) {
                m = z.GetValue(i) > m ? z.GetValue(i) : m;
            }
        }
        uint32_t tp = TopP(row, pGm.GetValue(row), tk, m);
        uint32_t key = Fmix(Fmix((uint32_t)seed) ^ (uint32_t)(seed >> 32));
        uint32_t bestIdx = 0;
        for (uint32_t c = 0; c < $V; c += $CHUNK) {
            uint32_t n = $V - c < $CHUNK ? $V - c : $CHUNK;
            LoadZ(row, c, n, true, m);
            for (uint32_t i = 0; i < n; i++) {  // u in (0, 1) from the hash of (key, token)
                uint32_t h = Fmix(key ^ ((c + i) * 0x9E3779B1u));
                g.SetValue(i, (float)(((h >> 9) << 1) | 1u) * 5.9604644775390625e-08f);
            }
            WaitPipe<HardEvent::S_V>();
            Ln(g, g, n);
            Muls(g, g, -1.0f, n);
            Ln(g, g, n);  // log(-log(u)): the score is z minus this
            WaitPipe<HardEvent::V_S>();
            for (uint32_t i = 0; i < n; i++) {
                float s = z.GetValue(i) - g.GetValue(i);
                if (Key(z.GetValue(i)) >= tk && Bits(p.GetValue(i)) >= tp && s > best) {
                    best = s;
                    bestIdx = c + i;
                }
            }
        }
        return bestIdx;
    }

    __aicore__ inline void Compute(uint32_t row)
    {
        float temp = tGm.GetValue(row);
        uint32_t token = temp > 0 ? Draw(row, temp) : Greedy(row);
        LocalTensor<int64_t> out = outBuf.Get<int64_t>();
        WaitPipe<HardEvent::MTE3_S>();  // the previous row's copy-out of `out` is done
        out.SetValue(0, (int64_t)token);
        WaitPipe<HardEvent::S_MTE3>();
        DataCopyPad(yGm[row], out, DataCopyExtParams{1, 8, 0, 0, 0});
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueueX;
    TBuf<QuePosition::VECCALC> workBuf, tBuf, zBuf, pBuf, gBuf, maxBuf, outBuf;
    GlobalTensor<float> xGm, tGm, pGm;
    GlobalTensor<int64_t> kGm, seedGm, yGm;
    uint32_t first = 0, last = 0;
};
"""


def emit_sample(node: Node, name: str) -> AscendKernel:
    """sample(logits[R,V], temperature, top_k, top_p, seeds) -> y i64[R]: each row's first maximum
    (temperature 0) or ir/sampling.py's draw. z, p and log(-log u) run on the vector unit a chunk
    of at most 4096 tokens at a time; the thresholds' counts and sums, the hash and the choice on
    the scalar unit."""
    v = node.inputs[0].type.shape[1]
    chunk = min(align(v * 4) // 4, 4096)
    fields = rows_tiling(["shape", 0, 0], AIV_CORES)
    src = source(name, f"sampling over rows of {v} logits", fields, SAMPLE, ["logits", "temp", "topK", "topP", "seeds", "y"],
                 STAGES="            Compute(row);\n", V=v, CHUNK=chunk, CHUNK_BYTES=chunk * 4, BLOCK=BLOCK)
    return AscendKernel(name, src, [["in", i] for i in range(5)] + [["out", 0]], fields, AIV_CORES)


SPEC_VERIFY = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR tokens, GM_ADDR drafts, GM_ADDR y, const ${NAME}_tiling& t)
    {
        rows = t.rows;
        tokenGm.SetGlobalBuffer((__gm__ int64_t*)tokens, rows);
        draftGm.SetGlobalBuffer((__gm__ int64_t*)drafts, rows);
        yGm.SetGlobalBuffer((__gm__ int64_t*)y, rows);
    }
    // one core walks the rows in order: a sequence keeps its tokens until its first rejected draft
    __aicore__ inline void Process()
    {
        if (GetBlockIdx() != 0) {
            return;
        }
        bool keep = true;
        for (uint32_t r = 0; r < rows; r++) {
            int64_t token = tokenGm.GetValue(r);
            int64_t draft = draftGm.GetValue(r);
            yGm.SetValue(r, keep ? token : -1);
            keep = draft < 0 || (keep && token == draft);
        }
        DataCacheCleanAndInvalid<int64_t, CacheLine::ENTIRE_DATA_CACHE>(yGm);
    }

private:
    GlobalTensor<int64_t> tokenGm, draftGm, yGm;
    uint32_t rows = 0;
};
"""


def emit_spec_verify(node: Node, name: str) -> AscendKernel:
    """spec_verify(tokens[R], draft_tokens[R]) on one core's scalar unit (R is at most a step's tokens)."""
    fields = [["rows", "uint32_t", ["shape", 0, 0]]]
    src = source(name, "speculative verification: tokens kept until each sequence's first rejected draft", fields,
                 SPEC_VERIFY, ["tokens", "drafts", "y"])
    return AscendKernel(name, src, [["in", 0], ["in", 1], ["out", 0]], fields, 1)
