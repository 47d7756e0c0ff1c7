"""SwiGLU fusion: mul(silu(gate), up), with gate/up the two halves of one split -> swiglu(x).

Runs after fuse_sibling_linears merged gate_proj and up_proj; one op replaces three
(split, silu, mul) and reads the merged projection once.
"""
from __future__ import annotations

from ..ir import Graph, Node


def fuse_swiglu(g: Graph) -> Graph:
    producers, users = g.producers(), g.users()
    replace: dict[int, Node] = {}
    for n in g.nodes:
        if n.op != "mul":
            continue
        act, up = n.inputs
        silu = producers.get(act)
        if silu is None or silu.op != "silu" or len(users[act]) != 1:
            continue
        split = producers.get(silu.inputs[0])
        if (split is None or split.op != "split" or len(split.outputs) != 2
                or split.outputs != [silu.inputs[0], up] or split.attrs.get("axis", -1) not in (-1, 1)
                or split.attrs["sizes"][0] != split.attrs["sizes"][1]):
            continue
        replace[id(n)] = Node("swiglu", [split.inputs[0]], [n.outputs[0]])
    g.nodes = [replace.get(id(n), n) for n in g.nodes]
    return g
