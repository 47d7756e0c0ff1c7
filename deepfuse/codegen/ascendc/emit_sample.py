"""AscendC kernels for the step's last ops on Ascend 950: greedy argmax (sample) on the vector
cores, and speculative verification (spec_verify) on one core's scalar unit."""
from __future__ import annotations

from ...ir import Node
from .emit import source
from .kernel import AIV_CORES, BLOCK, AscendKernel, align, rows_tiling

ARGMAX = """\
class Kernel_$NAME {
public:
    __aicore__ inline Kernel_$NAME() {}
    __aicore__ inline void Init(GM_ADDR logits, GM_ADDR y, const ${NAME}_tiling& t)
    {
$ROWS_INIT        xGm.SetGlobalBuffer((__gm__ float*)logits, (uint64_t)t.rows * $V);
        yGm.SetGlobalBuffer((__gm__ int64_t*)y, t.rows);
        pipe.InitBuffer(inQueueX, BUFFER_NUM, $CHUNK_BYTES);
        pipe.InitBuffer(workBuf, $CHUNK_BYTES);
        pipe.InitBuffer(maxBuf, $BLOCK);
        pipe.InitBuffer(outBuf, $BLOCK);
    }
$PROCESS_ROWS
private:
    // the row's first maximum, $CHUNK floats at a time
    __aicore__ inline void Compute(uint32_t row)
    {
        float best = 0;
        uint32_t bestIdx = 0;
        for (uint32_t c = 0; c < $V; c += $CHUNK) {
            uint32_t n = $V - c < $CHUNK ? $V - c : $CHUNK;
            LocalTensor<float> xLocal = inQueueX.AllocTensor<float>();
            DataCopyPad(xLocal, xGm[(uint64_t)row * $V + c], DataCopyExtParams{1, n * 4, 0, 0, 0},
                        DataCopyPadExtParams<float>{false, 0, 0, 0});
            inQueueX.EnQue(xLocal);
            xLocal = inQueueX.DeQue<float>();
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
        LocalTensor<int64_t> out = outBuf.Get<int64_t>();
        WaitPipe<HardEvent::MTE3_S>();  // the previous row's copy-out of `out` is done
        out.SetValue(0, (int64_t)bestIdx);
        WaitPipe<HardEvent::S_MTE3>();
        DataCopyPad(yGm[row], out, DataCopyExtParams{1, 8, 0, 0, 0});
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueueX;
    TBuf<QuePosition::VECCALC> workBuf, maxBuf, outBuf;
    GlobalTensor<float> xGm;
    GlobalTensor<int64_t> yGm;
    uint32_t first = 0, last = 0;
};
"""


def emit_argmax(node: Node, name: str) -> AscendKernel:
    """sample(logits[R,V], ...) for greedy rows: the index of each row's first maximum."""
    v = node.inputs[0].type.shape[1]
    chunk = min(align(v * 4) // 4, 8192)
    fields = rows_tiling(["shape", 0, 0], AIV_CORES)
    src = source(name, f"greedy argmax over rows of {v} logits", fields, ARGMAX, ["logits", "y"],
                 STAGES="            Compute(row);\n", V=v, CHUNK=chunk, CHUNK_BYTES=chunk * 4, BLOCK=BLOCK)
    return AscendKernel(name, src, [["in", 0], ["out", 0]], fields, AIV_CORES, notes={"greedy_only": True})


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
