"""QKV + RoPE + paged KV-cache write: the merged projection's split, the two RoPEs and the
attention's cache write become one op.

    q, k, v = split(qkv); q' = rope(q); k' = rope(k); attention(q', k', v, cache, slots, ...)
 -> q', k', v = qkv_rope_cache(qkv, pos, cache, slots); attention(..., write_kv=False)

With Qwen3's per-head q/k RMSNorm between the split and the RoPEs
(rope(head_rms_norm(q, wq))), the norms move into the fused op too (its q_norm, k_norm inputs).

Three outputs feed one consumer, which a single-rooted pattern cannot express, so this pass
is a plain function over the graph. Runs after fuse_sibling_linears.
"""
from __future__ import annotations

from ..ir import Graph, Node


def _head_norms(rq: Node, rk: Node, producers: dict, users: dict) -> tuple[list[Node], dict] | None:
    """The head_rms_norm nodes feeding both RoPEs (read by them alone), and their attrs; None if
    the RoPEs read the split directly."""
    nq, nk = producers.get(rq.inputs[0]), producers.get(rk.inputs[0])
    if not (nq and nk and nq.op == nk.op == "head_rms_norm" and nq.attrs == nk.attrs):
        return None
    if nq.attrs["head_dim"] != rq.attrs["head_dim"] or len(users[nq.outputs[0]]) != 1 or len(users[nk.outputs[0]]) != 1:
        return None
    return [nq, nk], {"qk_norm_eps": nq.attrs["eps"]}


def fuse_qkv_rope(g: Graph) -> Graph:
    producers, users = g.producers(), g.users()
    for att in [n for n in g.nodes if n.op == "attention" and n.attrs.get("write_kv", True)]:
        q_r, k_r, v, cache, slots = att.inputs[:5]
        rq, rk, split = producers.get(q_r), producers.get(k_r), producers.get(v)
        if not (rq and rk and split and rq.op == rk.op == "rope" and split.op == "split" and rq.attrs == rk.attrs):
            continue
        norms, norm_attrs = _head_norms(rq, rk, producers, users) or ([], {})
        q_in, k_in = (norms[0].inputs[0], norms[1].inputs[0]) if norms else (rq.inputs[0], rk.inputs[0])
        if split.outputs != [q_in, k_in, v] or rq.inputs[1] is not rk.inputs[1]:
            continue
        if split.attrs.get("axis", -1) not in (-1, 1) or any(len(users[o]) != 1 for o in split.outputs[:2]) \
                or len(users[q_r]) != 1 or len(users[k_r]) != 1 or len(users[v]) != 1:
            continue
        weights = [n.inputs[1] for n in norms]
        fused = Node("qkv_rope_cache", [split.inputs[0], rq.inputs[1], cache, slots, *weights], [q_r, k_r, v],
                     {"sizes": list(split.attrs["sizes"]), **rq.attrs, **norm_attrs})
        att.attrs = {**att.attrs, "write_kv": False}
        # the fused op takes the split's place: its inputs are defined before it, its users after
        gone = {id(rq), id(rk), *(id(n) for n in norms)}
        g.nodes = [fused if n is split else n for n in g.nodes if id(n) not in gone]
    return g
