"""Split biases: when every part of a split gets its own bias, add one concatenated bias before
the split instead.

    q, k, v = split(qkv); q' = add_bias(q, bq); k' = add_bias(k, bk); v' = add_bias(v, bv)
 -> q', k', v' = split(add_bias(qkv, concat(bq, bk, bv)))

After fuse_sibling_linears this puts Qwen2's q/k/v biases on the merged projection, where the
bias becomes the GEMM's epilogue (one launch, not three) and the split is free for the attention
fusions. The bias concat is left to fold_constants.
"""
from __future__ import annotations

from ..ir import Graph, Node, TensorType


def fuse_split_biases(g: Graph) -> Graph:
    params, users = set(g.params), g.users()
    replace: dict[Node, list[Node]] = {}
    drop: set[Node] = set()
    for n in g.nodes:
        if n.op != "split" or n.attrs.get("axis", -1) not in (-1, n.inputs[0].type.rank - 1):
            continue
        biased = [users.get(v, []) for v in n.outputs]
        if not all(len(u) == 1 and u[0].op == "add_bias" and u[0].inputs[0] is v and u[0].inputs[1] in params
                   for u, v in zip(biased, n.outputs)) or any(v in g.outputs for v in n.outputs):
            continue
        adds = [u[0] for u in biased]
        y = n.inputs[0]
        b = g.fresh(TensorType(adds[0].inputs[1].type.dtype, (y.type.shape[-1],)), "b")
        z = g.fresh(y.type, "y")
        replace[n] = [Node("concat", [a.inputs[1] for a in adds], [b], {"axis": 0}), Node("add_bias", [y, b], [z]),
                      Node("split", [z], [a.outputs[0] for a in adds], dict(n.attrs))]
        drop.update(adds)
    out = []
    for n in g.nodes:
        if n in replace:
            out.extend(replace[n])
        elif n not in drop:
            out.append(n)
    g.nodes = out
    return g
