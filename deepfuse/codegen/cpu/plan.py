"""CPU launch plan: the final graph as a flat list of kernel launches over numbered slots.

The plan is data (JSON): slot numbers for inputs, params and node outputs, one entry
per launch (op, attrs, dtype of its first input, input slots, output slots), and for each launch the slots
whose last reader it is, so the executor drops activations as early as possible.
The memory plan (passes/plan_memory.py) adds the buffers, each launch's output buffers
(`out_buf`, -1: not planned) and where each step symbol's size is read from (`symbols`).
"""
from __future__ import annotations

from ...ir import Graph, Value
from ...passes.plan_memory import VIEW_OPS, plan_memory
from .kernels import PREPACKED, PREPACKED_Q4
from .out_kernels import OUT_FACTORIES

# kernels that write into planned buffers, or allocate their result: none returns a view of an
# input; every other kernel (a reference fallback, say) might, so it counts as a view op
NO_ALIAS = (frozenset(OUT_FACTORIES) | frozenset(PREPACKED) | frozenset(PREPACKED_Q4)) - VIEW_OPS


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
    mem = plan_memory(g, frozenset(n.op for n in g.nodes if n.op not in NO_ALIAS))
    symbols: dict[str, list] = {}
    for v in g.inputs:
        for axis, d in enumerate(v.type.shape):
            if isinstance(d, str):
                symbols.setdefault(d, [v.name, axis])
    return {
        "num_slots": len(slot),
        "buffers": [{"dtype": b.dtype, "dim": b.dim, "row": b.row} for b in mem.buffers],
        "symbols": symbols,
        "inputs": {v.name: slot[v] for v in g.inputs},
        "params": {v.name: slot[v] for v in g.params},
        "launches": [{"op": n.op, "attrs": n.attrs, "dtype": (n.inputs or n.outputs)[0].type.dtype,
                      "in": [slot[v] for v in n.inputs],
                      "out": [slot[v] for v in n.outputs], "free": sorted(frees[i]),
                      "out_buf": [mem.assign.get(v, -1) for v in n.outputs],
                      "out_shape": [list(v.type.shape) for v in n.outputs]}
                     for i, n in enumerate(g.nodes)],
        "outputs": [slot[v] for v in g.outputs],
    }
