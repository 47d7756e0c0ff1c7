"""Cleanup passes: dead-code elimination, common-subexpression elimination, constant folding.

They never remove or merge side-effecting ops (kv-cache writes) and never touch inputs.
"""
from __future__ import annotations

import json

from ..ir import OPS, Graph


def dce(g: Graph) -> Graph:
    """Drops pure nodes whose outputs nobody uses, and params nobody reads."""
    live = set(g.outputs)
    kept = []
    for n in reversed(g.nodes):
        if OPS[n.op].side_effect or any(v in live for v in n.outputs):
            kept.append(n)
            live.update(n.inputs)
    g.nodes = kept[::-1]
    g.drop_unused_params()
    return g


def cse(g: Graph) -> Graph:
    """Merges pure nodes with the same op, inputs and attributes."""
    seen: dict[tuple, list] = {}
    kept = []
    for n in g.nodes:
        if OPS[n.op].side_effect:
            kept.append(n)
            continue
        key = (n.op, tuple(id(v) for v in n.inputs), json.dumps(n.attrs, sort_keys=True))
        if key in seen:
            for old, new in zip(n.outputs, seen[key]):
                g.replace_uses(old, new)
        else:
            seen[key] = n.outputs
            kept.append(n)
    g.nodes = kept
    return g


def _folded_name(g: Graph, op: str, names: list[str]) -> str:
    """A readable name: common prefix + distinct middles + common suffix (for concat)."""
    if op == "concat" and len(names) > 1:
        pre = names[0].rsplit(".", 2)[0] + "." if names[0].count(".") >= 2 else ""
        suf = "." + names[0].rsplit(".", 1)[1] if "." in names[0] else ""
        if all(n.startswith(pre) and n.endswith(suf) for n in names):
            base = pre + "_".join(n[len(pre):len(n) - len(suf)] for n in names) + suf
        else:
            base = "_".join(names)
    else:
        base = f"{names[0]}.{op}" if names else op
    taken = {p.name for p in g.params}
    name, k = base, 1
    while name in taken:
        name, k = f"{base}.{k}", k + 1
    return name


def fold_constants(g: Graph) -> Graph:
    """Evaluates pure nodes whose inputs are all params with data; their results become params."""
    params = set(g.params)
    kept = []
    for n in g.nodes:
        foldable = (not OPS[n.op].side_effect and n.inputs and all(v in params for v in n.inputs)
                    and all(v.name in g.weights for v in n.inputs) and n.op != "embedding")
        if not foldable:
            kept.append(n)
            continue
        res = OPS[n.op].reference(*[g.weights[v.name] for v in n.inputs], **n.attrs)
        outs = res if isinstance(res, tuple) else (res,)
        for v, t in zip(n.outputs, outs):
            new = g.add_param(_folded_name(g, n.op, [x.name for x in n.inputs]), t.contiguous())
            params.add(new)
            g.replace_uses(v, new)
    g.nodes = kept
    g.drop_unused_params()
    return g
