"""Decode GEMMs: the kernels of a GEMM launch of at most DECODE_ROWS rows (every decode
bucket; tiles.py), with swapped operands and a fixed split of K.

y[M, N] = A[M, K] @ W[N, K]^T is computed as its transpose, acc[BN, BM] += W[BN, BK] @ A^T[BK, BM],
so the weight's rows fill the MMA's M side (BN = 64: one wgmma on sm90, a tcgen05 M=64 MMA on
sm100) and the step's few rows its N side (BM = 64 at every bucket). The A and W tiles are the
prefill template's own loads (generated prologues, int4 weights); only the dot and the store differ.

K is cut into SPLIT chunks of KCHUNK, fixed per GEMM and arch from N, K and the SM count (never
from M), so that cdiv(N, BN) * SPLIT programs cover the SMs: program (m, n, k) writes its f32
partial tile into part[k, M, N]; the reduce kernel adds part[0], part[1], ... in that order and
stores y through the template's store slot, where a generated epilogue renders (epilogue.py).
No atomics. W8A8 GEMMs keep the one template kernel at every M (emit.py): their f32 sums of
exact group dots must stay in the reference's order, which a split would change.
Checked in Triton's interpreter (tests/codegen/test_triton_splitk.py) and compiled for sm_90a
and sm_100a here (test_triton_sizing.py); not yet run on a GPU.
"""
from __future__ import annotations

from . import templates as T
from .generated import with_helpers
from .tiles import DECODE_ROWS, SMS

GEMM_DECODE = """
@triton.jit
def $NAME($PARAMS, $OUT, M, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr$EXTRA):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_ok = rm < M
$ROWS$PRE    acc = tl.zeros((BN, BM), dtype=tl.float32)
    k_lo = pid_k * $KCHUNK
    for k0 in range(k_lo, tl.minimum(k_lo + $KCHUNK, $K), BK):
        kk = k0 + rk
        k_ok = kk < $K
$LOAD_A$LOAD_B$DOT    acc = tl.trans(acc)
$FINISH$STORE"""

DOT_SWAPPED = "        acc += tl.dot(tl.trans(b), tl.trans(a.to(b.dtype)))\n"

PART_STORE = """    tl.store(part_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * $N + rn[None, :], acc,
             mask=row_ok[:, None] & (rn[None, :] < $N))
"""

REDUCE = """
@triton.jit
def $NAME(part_ptr, y_ptr, M, BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    row_ok = rm < M
    mask = row_ok[:, None] & (rn[None, :] < $N)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.static_range($SPLIT):
        acc += tl.load(part_ptr + (k * M + rm[:, None]).to(tl.int64) * $N + rn[None, :], mask=mask, other=0.0)
$STORE"""
REDUCE_TILE = {"BM": 16, "BN": 32}


def split_of(n: int, k: int, bn: int, bk: int, arch: str) -> tuple[int, int]:
    """(SPLIT, K tiles per split) for an [N, K] weight: SPLIT is the fewest chunks for which
    cdiv(n, bn) * SPLIT >= the SM count, within the K tiles there are."""
    k_tiles, n_tiles = -(-k // bk), -(-n // bn)
    chunk = max(1, k_tiles * n_tiles // SMS[arch])
    return -(-k_tiles // chunk), chunk


def emit_decode(name: str, parts: dict, params: list, m: list, tiles: dict, arch: str, source, spec) -> list[dict]:
    """The decode specs of one GEMM: the swapped GEMM (writing y, or partials into tmp 0 when
    split), then the reduce. parts: the prefill template's substitutions (emit.emit_gemm);
    params: its (name, type, form) list before the output; m: the row count's form."""
    n, k = parts["N"], parts["K"]
    consts = {c: tiles[c] for c in ("BM", "BN", "BK")}
    split, chunk = split_of(n, k, consts["BN"], consts["BK"], arch)
    # a prologue's other output is stored by one program per row block: pid_k == 0 too
    pre = parts["PRE"].replace("if pid_n == 0:", "if (pid_n == 0) & (pid_k == 0):")
    out = "y_ptr" if split == 1 else "part_ptr"
    src = source(name + "_decode", GEMM_DECODE, **{**parts, "PRE": pre, "DOT": DOT_SWAPPED, "OUT": out,
                                                    "STORE": T.GEMM_STORE if split == 1 else PART_STORE,
                                                    "KCHUNK": chunk * consts["BK"]})
    y_param = params[-1] if params[-1][0] == "y_ptr" else None
    body = [p for p in params if p is not y_param]
    outs = [y_param] if split == 1 else [("part_ptr", "*fp32", ["tmp", 0])]
    grid = [["cdiv", m, consts["BM"]], ["cdiv", ["const", n], consts["BN"]], split]
    gemm = spec(name + "_decode", with_helpers(src), body + outs + [("M", "i32", m)], consts, grid, tiles)
    gemm["when"] = ["le", m, DECODE_ROWS]
    gemm["sizing"] = {"split": split}  # for occupancy.py
    if split == 1:
        return [gemm]
    gemm["scratch"] = [{"dims": [split, m, n], "dtype": "f32"}]
    red_name = "reduce_" + name  # no MMA: a name that does not start with the op's
    red = spec(red_name, source(red_name, REDUCE, N=n, SPLIT=split, STORE=T.GEMM_STORE),
               [("part_ptr", "*fp32", ["tmp", 0]), y_param, ("M", "i32", m)], dict(REDUCE_TILE),
               [["cdiv", m, REDUCE_TILE["BM"]], ["cdiv", ["const", n], REDUCE_TILE["BN"]], 1],
               {"num_warps": 4, "num_stages": 1})
    red["when"] = ["le", m, DECODE_ROWS]
    return [gemm, red]
