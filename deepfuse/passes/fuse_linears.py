"""Sibling-linear fusion: linears that read the same activation become one wider linear.

    q = linear(x, Wq); k = linear(x, Wk); v = linear(x, Wv)
 -> qkv = linear(x, concat(Wq, Wk, Wv)); q, k, v = split(qkv)

One GEMM instead of three reads x once and amortises dispatch; the weight concat is
left to fold_constants. Only weights that are params of one dtype are merged.
"""
from __future__ import annotations

from ..ir import Graph, Node, TensorType


def fuse_sibling_linears(g: Graph) -> Graph:
    params = set(g.params)
    groups: dict[int, list[Node]] = {}
    for n in g.nodes:
        if n.op == "linear" and n.inputs[1] in params:
            groups.setdefault(id(n.inputs[0]), []).append(n)
    replace: dict[int, list[Node]] = {}
    drop: set[int] = set()
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        x = nodes[0].inputs[0]
        ws = [n.inputs[1] for n in nodes]
        rows = [w.type.shape[0] for w in ws]
        w_type = TensorType(ws[0].type.dtype, (sum(rows), ws[0].type.shape[1]))
        w = g.fresh(w_type, "w")
        y = g.fresh(TensorType(x.type.dtype, (x.type.shape[0], sum(rows))), "y")
        new = [Node("concat", ws, [w], {"axis": 0}), Node("linear", [x, w], [y]),
               Node("split", [y], [n.outputs[0] for n in nodes], {"sizes": rows, "axis": -1})]
        replace[id(nodes[0])] = new
        drop.update(id(n) for n in nodes[1:])
    out = []
    for n in g.nodes:
        if id(n) in replace:
            out.extend(replace[id(n)])
        elif id(n) not in drop:
            out.append(n)
    g.nodes = out
    return g
