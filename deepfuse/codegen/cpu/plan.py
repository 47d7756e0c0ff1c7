"""CPU launch plan: the final graph as a flat list of kernel launches over numbered slots.

The plan is data (JSON): slot numbers for inputs, params and node outputs, one entry
per launch (op, attrs, dtype of its first input, input slots, output slots), and for each launch the slots
whose last reader it is, so the executor drops activations as early as possible.
"""
from __future__ import annotations

from ...ir import Graph, Value


def build_plan(g: Graph) -> dict:
    slot: dict[Value, int] = {}
    for v in g.inputs + g.params:
        slot[v] = len(slot)
    for n in g.nodes:
        for v in n.outputs:
            slot[v] = len(slot)
    last_use: dict[Value, int] = {}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            last_use[v] = i
    keep = set(g.inputs) | set(g.params) | set(g.outputs)
    frees: list[list[int]] = [[] for _ in g.nodes]
    for v, i in last_use.items():
        if v not in keep:
            frees[i].append(slot[v])
    return {
        "num_slots": len(slot),
        "inputs": {v.name: slot[v] for v in g.inputs},
        "params": {v.name: slot[v] for v in g.params},
        "launches": [{"op": n.op, "attrs": n.attrs, "dtype": (n.inputs or n.outputs)[0].type.dtype,
                      "in": [slot[v] for v in n.inputs],
                      "out": [slot[v] for v in n.outputs], "free": sorted(frees[i])}
                     for i, n in enumerate(g.nodes)],
        "outputs": [slot[v] for v in g.outputs],
    }
