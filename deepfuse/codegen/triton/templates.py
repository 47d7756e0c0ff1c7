"""Triton kernel templates. emit.py fills the $-placeholders from an IR node (sizes, eps,
RoPE theta, head counts: compile-time constants of that node) and from the target's tile
table (BM/BN/BK...). Every kernel accumulates in fp32 and stores in its output's dtype.

Layouts: activations row-major [rows, width]; projection weights [N, K] (as in `linear`);
the paged cache [2, num_blocks, block_size, Hkv, hd] contiguous (v at offset `v_off`; attention
reads v through its own pointer, cache[1], so that V rows load as 16-byte vectors).
"""
from __future__ import annotations

HEADER = "import triton\nimport triton.language as tl\n\n\n"

# GEMM y[M,N] = A[M,K] @ W[N,K]^T with A produced by a prologue:
#   plain: A = x rows;  take: A = x[rows] (logits: the sampled rows);
#   generated (prologue.py): A = the kernel IR of rms_norm(x), add_rms_norm(x, res) (its sum s
#   stored by the pid_n == 0 programs) or swiglu(x), rendered into $PRE and $LOAD_A
GEMM = """
@triton.jit
def $NAME($PARAMS, y_ptr, M, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr$EXTRA):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_ok = rm < M
$ROWS$PRE    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, $K, BK):
        kk = k0 + rk
        k_ok = kk < $K
$LOAD_A$LOAD_B$DOT$FINISH$STORE"""
# the accumulation of one K tile (W8A8 has its own: DOT_W8A8) and what follows the K loop
DOT = "        acc += tl.dot(a.to(b.dtype), b)\n"

# the GEMM's store of its [BM, BN] tile; a generated epilogue (epilogue.py) takes its place
GEMM_STORE = """    tl.store(y_ptr + rm[:, None] * $N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (rn[None, :] < $N))
"""

LOAD_B_DENSE = "        b = tl.load(w_ptr + rn[None, :] * $K + kk[:, None], mask=(rn[None, :] < $N) & k_ok[:, None], other=0.0)\n"
# int4 weights in Q4_1 layout (ir/opdefs_quant.py): nibble kk of row n, scale and min per group;
# the weight is rounded to the activation dtype, as the reference's dense weight is
LOAD_B_Q4 = """        wmask = (rn[None, :] < $N) & k_ok[:, None]
        byte = tl.load(packed_ptr + rn[None, :] * ($K // 2) + kk[:, None] // 2, mask=wmask, other=0)
        q = ((byte >> ((kk[:, None] % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
        grp = rn[None, :] * ($K // $G) + kk[:, None] // $G
        sc = tl.load(scales_ptr + grp, mask=wmask, other=0.0)
        mn = tl.load(mins_ptr + grp, mask=wmask, other=0.0)
        b = (q * sc + mn).to(x_ptr.dtype.element_ty)
"""
# W8A8 (ir/opdefs_quant.py): the weight offset binary (wq - 128 as int8); the K tile is one
# activation group (BK = act_group), quantized here per row: q = rint(a * (127 / max|a|)) (a true
# f32 division; rint by floor, ties to even), d = max|a| / 127; the group's exact int8 x int8 ->
# int32 dot, times d, is added to the f32 accumulator in group order (compiled without fp fusion,
# so the product and the sum round as the reference's do); the weight scale follows the loop
LOAD_B_W8 = """        wq = tl.load(wq_ptr + rn[None, :] * $K + kk[:, None], mask=(rn[None, :] < $N) & k_ok[:, None], other=128)
        b = (wq.to(tl.int16) - 128).to(tl.int8)
"""
DOT_W8A8 = """        a = a.to(x_ptr.dtype.element_ty).to(tl.float32)
        amax = tl.max(tl.abs(a), axis=1)
        safe = tl.where(amax > 0, amax, 1.0)
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full((BM,), 127.0, tl.float32), safe), 0.0)
        v = a * inv[:, None]
        fl = tl.floor(v)
        up = ((v - fl) > 0.5) | (((v - fl) == 0.5) & ((fl.to(tl.int32) & 1) == 1))
        q = tl.minimum(tl.maximum(fl + tl.where(up, 1.0, 0.0), -127.0), 127.0).to(tl.int8)
        d = tl.math.div_rn(amax, tl.full((BM,), 127.0, tl.float32))
        acc += tl.dot(q, b, out_dtype=tl.int32).to(tl.float32) * d[:, None]
"""
FINISH_W8A8 = "    acc = acc * tl.load(wscale_ptr + rn, mask=rn < $N, other=0.0)[None, :]\n"
ROWS_PLAIN = "    xrow = rm\n"
ROWS_TAKE = "    xrow = tl.load(rows_ptr + rm, mask=row_ok, other=0)\n"
X_TILE = "tl.load(x_ptr + xrow[:, None] * $XW + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)"
LOAD_PLAIN = f"        a = {X_TILE}\n"

EMBEDDING = """
@triton.jit
def $NAME(table_ptr, ids_ptr, y_ptr, BD: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BD)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    v = tl.load(table_ptr + tok * $D + d, mask=d < $D, other=0.0)
    tl.store(y_ptr + row * $D + d, v, mask=d < $D)
"""

# split + RoPE (rotate-half) of q and k + the paged-cache write of k and v; one token per program
ROPE_CACHE = """
@triton.jit
def $NAME(qkv_ptr, pos_ptr, cache_ptr, slots_ptr, ${NORM_PARAMS}q_ptr, v_off):
    t = tl.program_id(0)
    half = tl.arange(0, $HALF)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    inv_freq = tl.exp2(-(2.0 * half.to(tl.float32) / $HD) * $LOG2_THETA)
    ang = pos * inv_freq
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    row = qkv_ptr + t * $W
    for h in tl.static_range($H):
        x1 = tl.load(row + h * $HD + half).to(tl.float32)
        x2 = tl.load(row + h * $HD + $HALF + half).to(tl.float32)
$QNORM        tl.store(q_ptr + t * $QW + h * $HD + half, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty))
        tl.store(q_ptr + t * $QW + h * $HD + $HALF + half, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty))
    for h in tl.static_range($HKV):
        x1 = tl.load(row + $QW + h * $HD + half).to(tl.float32)
        x2 = tl.load(row + $QW + h * $HD + $HALF + half).to(tl.float32)
$KNORM        dst = cache_ptr + (slot * $HKV + h) * $HD
        tl.store(dst + half, (x1 * cos - x2 * sin).to(cache_ptr.dtype.element_ty))
        tl.store(dst + $HALF + half, (x2 * cos + x1 * sin).to(cache_ptr.dtype.element_ty))
        v1 = tl.load(row + $QW + $KW + h * $HD + half)
        v2 = tl.load(row + $QW + $KW + h * $HD + $HALF + half)
        tl.store(dst + v_off + half, v1)
        tl.store(dst + v_off + $HALF + half, v2)
"""

# Qwen3's per-head RMSNorm of q or k (weights at $W) before RoPE, rounded as the reference rounds
HEAD_NORM = """        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / $HD + $EPS)
        x1 = (x1 * rstd).to(q_ptr.dtype.element_ty).to(tl.float32) * tl.load($W + half).to(tl.float32)
        x2 = (x2 * rstd).to(q_ptr.dtype.element_ty).to(tl.float32) * tl.load($W + $HALF + half).to(tl.float32)
        x1 = x1.to(q_ptr.dtype.element_ty).to(tl.float32)
        x2 = x2.to(q_ptr.dtype.element_ty).to(tl.float32)
"""

# paged attention over the cache: one program per (sequence, kv head, block of BQ queries);
# its BQ x GP rows (GP: the GQA group padded to a power of two) share every K/V tile; online
# softmax over cache blocks; causal and sliding-window masks from absolute positions. $SOFTMAX_INIT
# starts the online softmax: empty, or (with learned sinks) at the sink logit with weight 1.
PAGED_ATTENTION = """
@triton.jit
def $NAME(q_ptr, cache_ptr, v_ptr, tables_ptr, lens_ptr, qlens_ptr, out_ptr, ${SINK_PARAM}S, table_stride,
          BQ: tl.constexpr, GP: tl.constexpr, SMAX: tl.constexpr):
    s = tl.program_id(0)
    hk = tl.program_id(1)
    qb = tl.program_id(2)
    sidx = tl.arange(0, SMAX)
    qlen_all = tl.load(qlens_ptr + sidx, mask=sidx < S, other=0)
    q_start = tl.sum(tl.where(sidx < s, qlen_all, 0), axis=0)
    n_q = tl.load(qlens_ptr + s)
    length = tl.load(lens_ptr + s)
    if (qb * BQ < n_q) & (n_q > $QSPLIT):  # shorter sequences are split_kv.py's
        r = tl.arange(0, BQ * GP)
        qi = qb * BQ + r // GP
        hg = r % GP
        row_ok = (qi < n_q) & (hg < $G)
        head = hk * $G + hg
        pos = length - n_q + qi
        d = tl.arange(0, $HD)
        qrow = (q_start + qi).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * $QW + head[:, None] * $HD + d[None, :], mask=row_ok[:, None], other=0.0)
$SOFTMAX_INIT        acc = tl.zeros((BQ * GP, $HD), dtype=tl.float32)
        last = tl.minimum(length, length - n_q + (qb + 1) * BQ)
        first = 0
        if $WINDOW > 0:
            first = tl.maximum(length - n_q + qb * BQ - $WINDOW + 1, 0)
        kb = tl.arange(0, $BS)
        for start in range((first // $BS) * $BS, last, $BS):
            blk = tl.load(tables_ptr + s * table_stride + start // $BS).to(tl.int64)
            kpos = start + kb
            base = ((blk * $BS + kb) * $HKV + hk) * $HD
            kt = tl.load(cache_ptr + base[None, :] + d[:, None])
            v = tl.load(v_ptr + base[:, None] + d[None, :])
            scores = tl.dot(q, kt) * $SCALE
            seen = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] < length)
            if $WINDOW > 0:
                seen = seen & (kpos[None, :] > pos[:, None] - $WINDOW)
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out_ptr + qrow[:, None] * $QW + head[:, None] * $HD + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
"""

SOFTMAX_EMPTY = """        m_i = tl.full((BQ * GP,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BQ * GP,), dtype=tl.float32)
"""
# the sink is one more logit whose value is zero: running max = sink, running sum = exp(0) = 1
SOFTMAX_SINK = """        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full((BQ * GP,), 1.0, dtype=tl.float32)
"""

# speculative verification: one program walks the sample rows in order; a sequence's rows are
# kept until its first rejected draft (drafts < 0 end a sequence)
SPEC_VERIFY = """
@triton.jit
def $NAME(tokens_ptr, drafts_ptr, y_ptr, R):
    one = tl.arange(0, 1)
    keep = tl.full((1,), 1, tl.int64)
    for r in range(0, R):
        t = tl.load(tokens_ptr + r + one)
        d = tl.load(drafts_ptr + r + one)
        tl.store(y_ptr + r + one, tl.where(keep == 1, t, -1))
        keep = tl.where(d < 0, 1, tl.where(t == d, keep, 0))
"""

# fused MoE over (token, expert) pairs sorted by expert and padded so each BM block of rows
# belongs to one expert (moe_align.py): rows[i] = t * KT + j, or the sentinel M
MOE_ROWS = """    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(rows_ptr + pid_m * BM) >= M:  # past the experts' rows (moe_align.py): padding only
        return
    r = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(rows_ptr + r)
    ok = pair < M
"""
MOE_UP = """
@triton.jit
def $NAME(x_ptr, w13_ptr, rows_ptr, block_expert_ptr, h_ptr, M,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
$MOE_ROWS    tok = (pair // $KT).to(tl.int64)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_ok = rn < $I
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    w_e = w13_ptr + e * (2 * $I * $D)
    for k0 in range(0, $D, BK):
        kk = k0 + rk
        k_ok = kk < $D
        a = tl.load(x_ptr + tok[:, None] * $D + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(w_e + rn[None, :] * $D + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        bu = tl.load(w_e + ($I + rn[None, :]) * $D + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g += tl.dot(a, bg)
        acc_u += tl.dot(a, bu)
    gate = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = (gate * tl.sigmoid(gate)).to(h_ptr.dtype.element_ty).to(tl.float32) * up
    tl.store(h_ptr + r[:, None] * $I + rn[None, :], h.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])
"""

MOE_DOWN = """
@triton.jit
def $NAME(h_ptr, w2_ptr, rows_ptr, block_expert_ptr, weights_ptr, ys_ptr, M,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
$MOE_ROWS    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_ok = rn < $D
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    w_e = w2_ptr + e * ($D * $I)
    for k0 in range(0, $I, BK):
        kk = k0 + rk
        k_ok = kk < $I
        a = tl.load(h_ptr + r[:, None] * $I + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_e + rn[None, :] * $I + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, b)
    wt = tl.load(weights_ptr + pair, mask=ok, other=0.0)
    y = acc.to(ys_ptr.dtype.element_ty).to(tl.float32) * wt[:, None]
    tl.store(ys_ptr + r[:, None] * $D + rn[None, :], y.to(ys_ptr.dtype.element_ty), mask=n_ok[None, :])
"""

# out[t] = sum over its KT (token, expert) pairs, in expert-choice order: no atomics, so the
# sum's order does not depend on the batch
MOE_COMBINE = """
@triton.jit
def $NAME(ys_ptr, pos_ptr, y_ptr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    ok = d < $D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range($KT):
        p = tl.load(pos_ptr + t * $KT + j).to(tl.int64)
        acc += tl.load(ys_ptr + p * $D + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * $D + d, acc.to(y_ptr.dtype.element_ty), mask=ok)
"""
