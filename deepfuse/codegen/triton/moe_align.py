"""fused_moe's routing and its sort by expert as two kernels (the first two of the launch; emit.py
then adds the grouped GEMMs and the combine, templates.MOE_*).

route: one program per BT tokens. Router logits x @ router_w^T (f32 accumulation, rounded to
x's dtype as the reference's linear is), softmax or sigmoid scores, experts chosen by score +
score_bias, within the topk_group best of n_group groups (a group ranks by the sum of its two
best scores), top_k by repeated arg-max (the lowest index among equal scores); weights are the
chosen scores, optionally renormalised, times routed_scaling; num_shared always-on experts
(numbered after the routed ones) follow with weight 1. Writes ids i32[T*KT], weights f32[T*KT].

align: one program. Counts the (token, expert) pairs per expert, pads each expert's rows to a
multiple of BLOCK and lays them out in expert order, pairs of one expert in pair order (a
stable sort): rows i32[P] (pair id, or the sentinel NP for padding), pos_of i32[NP] (each
pair's row), block_expert i32[P / BLOCK]. P is a bound known from the shapes alone (each expert
pads fewer than BLOCK rows), so the scratch is sized without reading anything back; blocks past
the experts' rows hold only the sentinel and the GEMMs return at once for them.
Ids and weights match ir.opdefs_moe.route; rows, pos_of and block_expert are exactly those of a
stable argsort by expert (tests/codegen/test_triton_moe_align.py).
"""
from __future__ import annotations

from ...ir import Node
from ...ir.opdefs_moe import routing_attrs
from .tiles import pow2

ROUTE = """
@triton.jit
def $NAME(x_ptr, router_ptr, $BIAS_PARAM ids_ptr, weights_ptr, T, BT: tl.constexpr, BD: tl.constexpr):
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = rt < T
    re = tl.arange(0, $EP)
    e_ok = re < $E
    acc = tl.zeros((BT, $EP), dtype=tl.float32)
    for d0 in range(0, $D, BD):
        rd = d0 + tl.arange(0, BD)
        d_ok = rd < $D
        a = tl.load(x_ptr + rt[:, None].to(tl.int64) * $D + rd[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(router_ptr + re[None, :] * $D + rd[:, None], mask=d_ok[:, None] & e_ok[None, :], other=0.0)
        acc += tl.dot(a, w.to(a.dtype)$PREC)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
$SCORES    choice = tl.where(e_ok[None, :], scores$BIAS, float("-inf"))
$GROUPS    rk = tl.arange(0, $KP)
    ids = tl.zeros((BT, $KP), dtype=tl.int32)
    wts = tl.zeros((BT, $KP), dtype=tl.float32)
    for j in tl.static_range($K):
        best = tl.max(choice, axis=1)
        pick = tl.min(tl.where(choice == best[:, None], re[None, :], $EP), axis=1)
        hit = re[None, :] == pick[:, None]
        wj = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        ids = tl.where(rk[None, :] == j, pick[:, None], ids)
        wts = tl.where(rk[None, :] == j, wj[:, None], wts)
        choice = tl.where(hit, float("-inf"), choice)
$RENORM    wts = wts * $SCALING
    for j in tl.static_range($SHARED):
        ids = tl.where(rk[None, :] == $K + j, $E + j, ids)
        wts = tl.where(rk[None, :] == $K + j, 1.0, wts)
    out = rt[:, None].to(tl.int64) * $KT + rk[None, :]
    ok = t_ok[:, None] & (rk[None, :] < $KT)
    tl.store(ids_ptr + out, ids, mask=ok)
    tl.store(weights_ptr + out, wts, mask=ok)
"""
SOFTMAX = """    z = tl.where(e_ok[None, :], logits, float("-inf"))
    z = tl.exp(z - tl.max(z, axis=1)[:, None])
    scores = z / tl.sum(z, axis=1)[:, None]
"""
SIGMOID = "    scores = tl.where(e_ok[None, :], tl.sigmoid(logits), 0.0)\n"
RENORM = "    wts = wts / (tl.sum(wts, axis=1)[:, None] + 1e-20)\n"
# keep only the experts of the TOPK_GROUP best groups (a group's score: its two best choices)
GROUPS = """    grp = re // $EG
    rg = tl.arange(0, $GP)
    gscore = tl.full((BT, $GP), float("-inf"), dtype=tl.float32)
    for g in tl.static_range($G):
        c = tl.where(grp[None, :] == g, choice, float("-inf"))
        first = tl.max(c, axis=1)
        at = tl.min(tl.where(c == first[:, None], re[None, :], $EP), axis=1)
        second = tl.max(tl.where(re[None, :] == at[:, None], float("-inf"), c), axis=1)
        gscore = tl.where(rg[None, :] == g, (first + second)[:, None], gscore)
    keep = tl.zeros((BT, $EP), dtype=tl.int1)
    for j in tl.static_range($TOPK_GROUP):
        gbest = tl.max(gscore, axis=1)
        gpick = tl.min(tl.where(gscore == gbest[:, None], rg[None, :], $GP), axis=1)
        keep = keep | (grp[None, :] == gpick[:, None])
        gscore = tl.where(rg[None, :] == gpick[:, None], float("-inf"), gscore)
    choice = tl.where(keep, choice, float("-inf"))
"""

ALIGN = """
@triton.jit
def $NAME(ids_ptr, rows_ptr, block_expert_ptr, pos_ptr, NP, TOTAL, BP: tl.constexpr, BLOCK: tl.constexpr):
    re = tl.arange(0, $EP)
    counts = tl.zeros(($EP,), dtype=tl.int32)
    for p0 in range(0, NP, BP):
        rp = p0 + tl.arange(0, BP)
        e = tl.load(ids_ptr + rp, mask=rp < NP, other=$EP)
        counts += tl.sum((e[:, None] == re[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    start = tl.cumsum(padded, axis=0) - padded
    blocks_through = tl.cumsum(padded // BLOCK, axis=0)
    for r0 in range(0, TOTAL, BP):
        rr = r0 + tl.arange(0, BP)
        tl.store(rows_ptr + rr, tl.zeros((BP,), dtype=tl.int32) + NP, mask=rr < TOTAL)
    for b0 in range(0, TOTAL // BLOCK, BP):
        rb = b0 + tl.arange(0, BP)
        be = tl.sum((blocks_through[None, :] <= rb[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + rb, tl.minimum(be, $NE - 1), mask=rb < TOTAL // BLOCK)
    tl.debug_barrier()  # the padding is written before any pair's row lands on it
    seen = tl.zeros(($EP,), dtype=tl.int32)
    for p0 in range(0, NP, BP):
        rp = p0 + tl.arange(0, BP)
        p_ok = rp < NP
        e = tl.load(ids_ptr + rp, mask=p_ok, other=$EP)
        hot = (e[:, None] == re[None, :]).to(tl.int32)
        dest = tl.sum(hot * (tl.cumsum(hot, axis=0) - 1 + seen[None, :] + start[None, :]), axis=1)
        tl.store(rows_ptr + dest, rp, mask=p_ok)
        tl.store(pos_ptr + rp, dest, mask=p_ok)
        seen += tl.sum(hot, axis=0)
"""


def emit_route_align(node: Node, name: str, suffix: str, block: int, source, spec, ptr,
                     row_tiles: dict) -> list[dict]:
    """The route and align specs (named name_route / name_align, then `suffix`) of a fused_moe
    node whose GEMMs take `block` rows per program (ptr(kind, i): the pointer type of the node's
    input or output i, as emit.py passes it).
    The route spec declares the launch's scratch in the order the MoE kernels address it:
    tmp 0 rows, 1 block_expert, 2 pos_of, 3 weights, 4 h [P, I], 5 ys [P, D], 6 ids."""
    x, router, w13 = (node.inputs[i].type for i in (0, 1, 2))
    bias = len(node.inputs) > 4
    a, r = node.attrs, routing_attrs(node.attrs)
    e, ne, d, i = router.shape[0], w13.shape[0], x.shape[1], w13.shape[1] // 2
    k, shared = a["top_k"], a.get("num_shared", 0)
    kt = k + shared
    groups = "" if r["n_group"] <= 1 else GROUPS.replace("$EG", str(e // r["n_group"])).replace(
        "$GP", str(pow2(r["n_group"]))).replace("$G", str(r["n_group"])).replace("$TOPK_GROUP", str(r["topk_group"]))
    route_src = source(f"{name}_route{suffix}", ROUTE, E=e, EP=max(16, pow2(e)), D=d, K=k, KP=pow2(kt), KT=kt,
                       SHARED=shared, SCORES=SOFTMAX if r["scoring"] == "softmax" else SIGMOID,
                       BIAS=" + tl.load(bias_ptr + re, mask=e_ok, other=0.0).to(tl.float32)[None, :]" if bias else "",
                       BIAS_PARAM="bias_ptr," if bias else "", GROUPS=groups,
                       RENORM=RENORM if a["renormalize"] else "", SCALING=repr(float(r["routed_scaling"])),
                       PREC=', input_precision="ieee"' if x.dtype == "f32" else "")
    params = [("x_ptr", ptr("in", 0), ["in", 0]), ("router_ptr", ptr("in", 1), ["in", 1])]
    if bias:
        params.append(("bias_ptr", ptr("in", 4), ["in", 4]))
    params += [("ids_ptr", "*i32", ["tmp", 6]), ("weights_ptr", "*fp32", ["tmp", 3]), ("T", "i32", ["shape", 0, 0])]
    bt = 16  # tl.dot's least M
    route = spec(f"{name}_route{suffix}", route_src, params, {"BT": bt, "BD": 64}, [["cdiv", ["shape", 0, 0], bt], 1, 1],
                 row_tiles)
    n_pairs = ["mul", ["shape", 0, 0], kt]
    blocks = ["cdiv", ["add", n_pairs, ["mul", ["min", ne, n_pairs], block - 1]], block]
    total = ["mul", blocks, block]
    route["scratch"] = [{"dims": [total], "dtype": "i32"}, {"dims": [blocks], "dtype": "i32"},
                        {"dims": [n_pairs], "dtype": "i32"}, {"dims": [n_pairs], "dtype": "f32"},
                        {"dims": [total, i], "dtype": x.dtype}, {"dims": [total, d], "dtype": x.dtype},
                        {"dims": [n_pairs], "dtype": "i32"}]
    align_src = source(f"{name}_align{suffix}", ALIGN, EP=max(16, pow2(ne)), NE=ne)
    align = spec(f"{name}_align{suffix}", align_src,
                 [("ids_ptr", "*i32", ["tmp", 6]), ("rows_ptr", "*i32", ["tmp", 0]),
                  ("block_expert_ptr", "*i32", ["tmp", 1]), ("pos_ptr", "*i32", ["tmp", 2]),
                  ("NP", "i32", ["tmp_shape", 2, 0]), ("TOTAL", "i32", ["tmp_shape", 0, 0])],
                 {"BP": 64, "BLOCK": block}, [1, 1, 1], {"num_warps": 4, "num_stages": 1})
    return [route, align]
