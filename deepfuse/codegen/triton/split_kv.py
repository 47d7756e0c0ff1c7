"""Split-KV paged attention for short query chunks (decodes, speculative verify chunks): the
last two kernels of a qkv_attention launch (emit.py: RoPE + cache write, the one-pass kernel,
then split and reduce).

A sequence with 1..QSPLIT queries ("short") is attended here; longer ones by the one-pass
PAGED_ATTENTION kernel (which skips the short ones). The choice is per sequence, from its own
query count, so a row's result does not depend on what else shares the step.

split: one program per (sequence, kv head, partition); the GQA group's query heads (times the
sequence's <= QSPLIT queries) are the rows of one [BQ*GP, HD] q tile. The keys the sequence's
queries can see, from `start0` (the first window position, rounded down to a page) to `length`,
are cut into P partitions (P fixed per build, never chosen from the batch) of `per` keys, a
multiple of the KT-key tile; a tile spans KT/BS pages, whose block-table entries are loaded one
tile ahead. Each program writes its partial softmax state per row: m (running max), l (sum of
exp) into ml[slot, head, part, 2] and the unnormalised acc into acc[slot, head, part, HD] (f32).
Partitions past the sequence's keys (a short context) do nothing.

reduce: one program per (sequence, kv head), its rows packed as the split's: folds the active
partitions in order 0..n-1 (no atomics; starting from the sink logit with weight 1 when the
model has sinks) and stores acc / l as the attention output.

Scratch rows are compact: slot = (query rows of the short sequences before this one) + qi, so
ml/acc hold min(T, S*QSPLIT) x H x P x (HD + 2) f32.
Assumes every sequence of a step has at least one query (so T == S means one query each).
Checked in Triton's interpreter (tests/codegen/test_triton_split_kv.py) and compiled for sm_90a
and sm_100a here (test_triton_sizing.py); not yet run on a GPU.
"""
from __future__ import annotations

from ...ir import Node
from .tiles import SMS, pow2, tiles_for

MAX_PARTITIONS = 16
QSPLIT_MAX = 8  # the most queries of a sequence attended here: a verify chunk of up to 7 drafts

# this sequence's keys and partitions (what a program needs to know whether it has work)
GEOMETRY = """    n_q = tl.load(qlens_ptr + s)
    length = tl.load(lens_ptr + s)
$START    start0 = (start0 // $BS) * $BS
    per = tl.cdiv(tl.cdiv(length - start0, $P), $KT) * $KT
    short = (n_q > 0) & (n_q <= $QSPLIT)
"""
# where its rows start in q/out (q_start) and in the scratch (slot0: short sequences' rows only)
ROWS = """        sidx = tl.arange(0, SMAX)
        qlen_all = tl.load(qlens_ptr + sidx, mask=sidx < S, other=0)
        before = sidx < s
        q_start = tl.sum(tl.where(before, qlen_all, 0), axis=0)
        slot0 = tl.sum(tl.where(before & (qlen_all <= $QSPLIT), qlen_all, 0), axis=0)
"""
START_FULL = "    start0 = length * 0\n"
START_WINDOW = "    start0 = tl.maximum(length - n_q - $WINDOW + 1, 0)\n"

SPLIT = """
@triton.jit
def $NAME(q_ptr, cache_ptr, v_ptr, tables_ptr, lens_ptr, qlens_ptr, ml_ptr, acc_ptr, S, table_stride,
          BQ: tl.constexpr, GP: tl.constexpr, SMAX: tl.constexpr):
    s = tl.program_id(0)
    hk = tl.program_id(1)
    part = tl.program_id(2)
$GEOMETRY    lo = start0 + part * per
    if short & (lo < length):
$ROWS        r = tl.arange(0, BQ * GP)
        qi = r // GP
        hg = r % GP
        row_ok = (qi < n_q) & (hg < $G)
        head = hk * $G + hg
        pos = length - n_q + qi
        d = tl.arange(0, $HD)
        qrow = (q_start + qi).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * $QW + head[:, None] * $HD + d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full((BQ * GP,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BQ * GP,), dtype=tl.float32)
        acc = tl.zeros((BQ * GP, $HD), dtype=tl.float32)
        hi = tl.minimum(lo + per, length)
        kk = tl.arange(0, $KT)
        table = tables_ptr + s * table_stride
        blk = tl.load(table + (lo + kk) // $BS, mask=lo + kk < hi, other=0).to(tl.int64)
        for start in range(lo, hi, $KT):
            kpos = start + kk
            k_ok = kpos < hi
            base = ((blk * $BS + kpos % $BS) * $HKV + hk) * $HD
            nxt = kpos + $KT  # the next tile's pages, before this tile's keys arrive
            blk = tl.load(table + nxt // $BS, mask=nxt < hi, other=0).to(tl.int64)
            kt = tl.load(cache_ptr + base[None, :] + d[:, None], mask=k_ok[None, :], other=0.0)
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
            scores = tl.dot(q, kt) * $SCALE
            seen = (kpos[None, :] <= pos[:, None]) & k_ok[None, :]
            if $WINDOW > 0:
                seen = seen & (kpos[None, :] > pos[:, None] - $WINDOW)
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = ((slot0 + qi).to(tl.int64) * $H + head) * $P + part
        tl.store(ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=row_ok)
        tl.store(acc_ptr + row[:, None] * $HD + d[None, :], acc, mask=row_ok[:, None])
"""

REDUCE = """
@triton.jit
def $NAME(ml_ptr, acc_ptr, lens_ptr, qlens_ptr, out_ptr, ${SINK_PARAM}S, QB: tl.constexpr, GP: tl.constexpr,
          SMAX: tl.constexpr):
    s = tl.program_id(0)
    hk = tl.program_id(1)
$GEOMETRY    if short:
$ROWS        r = tl.arange(0, QB * GP)
        qi = r // GP
        hg = r % GP
        ok = (qi < n_q) & (hg < $G)
        head = hk * $G + hg
        d = tl.arange(0, $HD)
$INIT        acc = tl.zeros((QB * GP, $HD), dtype=tl.float32)
        for part in range(0, tl.cdiv(length - start0, per)):
            row = ((slot0 + qi).to(tl.int64) * $H + head) * $P + part
            m_p = tl.load(ml_ptr + row * 2, mask=ok, other=-1.0e30)
            l_p = tl.load(ml_ptr + row * 2 + 1, mask=ok, other=0.0)
            a_p = tl.load(acc_ptr + row[:, None] * $HD + d[None, :], mask=ok[:, None], other=0.0)
            m_new = tl.maximum(m_i, m_p)
            alpha = tl.exp(m_i - m_new)
            beta = tl.exp(m_p - m_new)
            l_i = l_i * alpha + l_p * beta
            acc = acc * alpha[:, None] + a_p * beta[:, None]
            m_i = m_new
        o = acc / tl.where(ok, l_i, 1.0)[:, None]
        qrow = (q_start + qi).to(tl.int64)
        tl.store(out_ptr + qrow[:, None] * $QW + head[:, None] * $HD + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=ok[:, None])
"""
INIT_EMPTY = """        m_i = tl.full((QB * GP,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((QB * GP,), dtype=tl.float32)
"""
# the sink is one more logit of value zero: running max = sink, running sum = exp(0) = 1
INIT_SINK = """        m_i = tl.load(sinks_ptr + head, mask=ok, other=0.0).to(tl.float32)
        l_i = tl.full((QB * GP,), 1.0, dtype=tl.float32)
"""


def sizing(node: Node, arch: str) -> dict:
    """The split's fixed shape for this node on `arch`: BQ queries x GP heads per q tile, the
    most queries of a short sequence (QSPLIT), P partitions, KT keys per tile."""
    a = node.attrs
    g = a["num_heads"] // a["num_kv_heads"]
    tiles = tiles_for(arch, "attention_decode", node)
    if "num_warps" in tiles and a["head_dim"] >= 128:  # an f32 [rows, HD] acc: twice the threads to hold it
        tiles["num_warps"] = max(tiles["num_warps"], 8)
    gp = pow2(g)
    bq = max(1, tiles["rows"] // gp)
    return {"G": g, "GP": gp, "BQ": bq, "QSPLIT": min(bq, QSPLIT_MAX), "KT": tiles["keys"],
            "P": max(1, min(MAX_PARTITIONS, -(-SMS[arch] // a["num_kv_heads"]))), "tiles": tiles}


def emit_split_kv(node: Node, name: str, arch: str, source, spec, ptr, bs: int, smax: int) -> list[dict]:
    """The split and reduce specs of a qkv_attention node (emit.py passes its _source, _spec, the
    pointer types `ptr(kind, i)`, the cache's block size and SMAX); they read the rope kernel's q
    (tmp 0) and write scratch tmps 1 (ml) and 2 (acc), declared on the split spec."""
    a = node.attrs
    z = sizing(node, arch)
    h, hkv, hd, qw = a["num_heads"], a["num_kv_heads"], a["head_dim"], a["sizes"][0]
    window, sinks = a.get("window", 0), a.get("sinks", False)
    common = dict(G=z["G"], HD=hd, QW=qw, HKV=hkv, H=h, BS=bs, KT=z["KT"], P=z["P"], QSPLIT=z["QSPLIT"],
                  WINDOW=window, SCALE=repr(float(a["scale"])))
    geometry = GEOMETRY.replace("$START", START_WINDOW if window > 0 else START_FULL)
    split_src = source(name + "_split", SPLIT, GEOMETRY=geometry, ROWS=ROWS, **common)
    reduce_name = "reduce_" + name  # not an MMA kernel: its name does not start with the op's
    reduce_src = source(reduce_name, REDUCE, GEOMETRY=geometry, ROWS=ROWS, INIT=INIT_SINK if sinks else INIT_EMPTY,
                        SINK_PARAM="sinks_ptr, " if sinks else "", **common)
    seq = [("lens_ptr", ptr("in", 5), ["in", 5]), ("qlens_ptr", ptr("in", 6), ["in", 6])]
    scratch = [("ml_ptr", "*fp32", ["tmp", 1]), ("acc_ptr", "*fp32", ["tmp", 2])]
    # v as a pointer of its own (cache[1]), not cache + v_off: an aligned pointer parameter is what
    # lets the compiler load V rows in 16-byte vectors (an integer offset leaves them scalar)
    split_params = [("q_ptr", ptr("in", 0), ["tmp", 0]), ("cache_ptr", ptr("in", 2), ["in", 2]),
                    ("v_ptr", ptr("in", 2), ["index", 2, 1]), ("tables_ptr", ptr("in", 4), ["in", 4]), *seq, *scratch,
                    ("S", "i32", ["shape", 6, 0]), ("table_stride", "i32", ["stride", 4, 0])]
    reduce_params = [*scratch, *seq, ("out_ptr", ptr("out", 0), ["out", 0])]
    if sinks:
        last = len(node.inputs) - 1
        reduce_params.append(("sinks_ptr", ptr("in", last), ["in", last]))
    reduce_params.append(("S", "i32", ["shape", 6, 0]))
    tiles = z["tiles"]
    split = spec(name + "_split", split_src, split_params, {"BQ": z["BQ"], "GP": z["GP"], "SMAX": smax},
                 [["shape", 6, 0], hkv, z["P"]], tiles)
    split["sizing"] = {"partitions": z["P"], "keys": z["KT"], "short": z["QSPLIT"]}  # for occupancy.py
    rows = ["min", ["shape", 0, 0], ["mul", ["shape", 6, 0], z["QSPLIT"]]]
    split["scratch"] = [{"dims": [rows, h * z["P"] * 2], "dtype": "f32"}, {"dims": [rows, h * z["P"] * hd], "dtype": "f32"}]
    qb = pow2(z["QSPLIT"])
    warps = min(16, max(4, qb * z["GP"] * hd // 1024))  # at most 32 f32 of the acc tile per thread
    reduce = spec(reduce_name, reduce_src, reduce_params, {"QB": qb, "GP": z["GP"], "SMAX": smax},
                  [["shape", 6, 0], hkv, 1], {"num_warps": warps, "num_stages": 1})
    return [split, reduce]
