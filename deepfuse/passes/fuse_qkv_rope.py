"""QKV + RoPE + paged KV-cache write: the merged projection's split, the two RoPEs and the
attention's cache write become one op.

    q, k, v = split(qkv); q' = rope(q); k' = rope(k); attention(q', k', v, cache, slots, ...)
 -> q', k', v = qkv_rope_cache(qkv, pos, cache, slots); attention(..., write_kv=False)

Three outputs feed one consumer, which a single-rooted pattern cannot express, so this pass
is a plain function over the graph. Runs after fuse_sibling_linears.
"""
from __future__ import annotations

from ..ir import Graph, Node


def fuse_qkv_rope(g: Graph) -> Graph:
    producers, users = g.producers(), g.users()
    for att in [n for n in g.nodes if n.op == "attention" and n.attrs.get("write_kv", True)]:
        q_r, k_r, v, cache, slots = att.inputs[:5]
        rq, rk, split = producers.get(q_r), producers.get(k_r), producers.get(v)
        if not (rq and rk and split and rq.op == rk.op == "rope" and split.op == "split" and rq.attrs == rk.attrs):
            continue
        if split.outputs != [rq.inputs[0], rk.inputs[0], v] or rq.inputs[1] is not rk.inputs[1]:
            continue
        if split.attrs.get("axis", -1) not in (-1, 1) or any(len(users[o]) != 1 for o in split.outputs[:2]) \
                or len(users[q_r]) != 1 or len(users[k_r]) != 1 or len(users[v]) != 1:
            continue
        fused = Node("qkv_rope_cache", [split.inputs[0], rq.inputs[1], cache, slots], [q_r, k_r, v],
                     {"sizes": list(split.attrs["sizes"]), **rq.attrs})
        att.attrs = {**att.attrs, "write_kv": False}
        # the fused op takes the split's place: its inputs are defined before it, its users after
        g.nodes = [fused if n is split else n for n in g.nodes if n is not rq and n is not rk]
    return g
