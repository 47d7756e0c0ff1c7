"""Memory planning: static buffer reuse for the step graph.

Every activation (a node output that is not a graph output) gets a buffer; activations whose
lifetimes do not overlap share one, so a step's activations live in a few buffers allocated
once, not in fresh allocations per node. Shapes are symbolic in the step's size, so a buffer
is sized per row: `dim` is the symbol (T tokens, S sequences, or None for a fixed size) and
`row` the elements per unit of it; a runtime allocates rows x row for its largest step.

    plan = plan_memory(g)             # analysis of the final graph; the graph is unchanged
    print(describe(plan, g))          # one line per activation: %v -> buf2
    plan.nbytes({"T": 512, "S": 64})  # what the buffers take at that step size

Rules: a node's outputs never share a buffer with its own inputs (kernels read inputs while
they write); outputs of view ops (split; for a target, any kernel that may return a view of
an input) get no buffer and keep their inputs' buffers alive while they are read; values
with two symbolic dims are left to the allocator. Greedy in node order, best fit among free
buffers of the same dtype and dim.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import DTYPES, Graph, Value

VIEW_OPS = frozenset({"split"})  # outputs may be views of input 0


@dataclass
class Buffer:
    dtype: str
    dim: str | None  # the symbol the buffer scales with, None for a fixed size
    row: int  # elements per unit of dim (all elements when dim is None)

    def nbytes(self, sizes: dict[str, int]) -> int:
        rows = 1 if self.dim is None else sizes[self.dim]
        return rows * self.row * DTYPES[self.dtype].itemsize


@dataclass
class MemoryPlan:
    buffers: list[Buffer] = field(default_factory=list)
    assign: dict[Value, int] = field(default_factory=dict)  # activation -> buffer index

    def nbytes(self, sizes: dict[str, int]) -> int:
        return sum(b.nbytes(sizes) for b in self.buffers)


def size_class(v: Value) -> tuple[str | None, int] | None:
    """(symbol, elements per unit of it) of v's shape, or None if it has two symbolic dims."""
    syms = [d for d in v.type.shape if isinstance(d, str)]
    if len(syms) > 1:
        return None
    row = 1
    for d in v.type.shape:
        row *= d if isinstance(d, int) else 1
    return (syms[0] if syms else None), row


def lifetimes(g: Graph, view_ops: frozenset[str] = VIEW_OPS) -> dict[Value, tuple[int, int]]:
    """Activation -> (index of its node, index of its last reader), with view outputs' readers
    counted as readers of the values they may view."""
    first = {v: i for i, n in enumerate(g.nodes) for v in n.outputs}
    last = dict(first)
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            if v in last:
                last[v] = max(last[v], i)
    for n in reversed(g.nodes):  # views of views: reverse order carries the lifetime up the chain
        if n.op in view_ops:
            end = max(last[o] for o in n.outputs)
            for v in n.inputs:
                if v in last:
                    last[v] = max(last[v], end)
    return {v: (first[v], last[v]) for v in first}


def plan_memory(g: Graph, view_ops: frozenset[str] = VIEW_OPS) -> MemoryPlan:
    """view_ops: ops whose outputs may alias their inputs (they get no buffer)."""
    plan = MemoryPlan()
    life = lifetimes(g, view_ops)
    outputs = set(g.outputs)
    ends: dict[int, list[int]] = {}  # node index -> buffers free after it
    free: list[int] = []
    for i, n in enumerate(g.nodes):
        if n.op not in view_ops:
            for v in n.outputs:
                cls = size_class(v)
                if v in outputs or cls is None:
                    continue
                buf = _take(plan, free, v.type.dtype, *cls)
                plan.assign[v] = buf
                ends.setdefault(life[v][1], []).append(buf)
        free.extend(ends.pop(i, []))
    return plan


def _take(plan: MemoryPlan, free: list[int], dtype: str, dim: str | None, row: int) -> int:
    """Best fit among free buffers of this dtype and dim (the smallest that holds `row`, else the
    largest, grown); a new buffer if none is free."""
    same = [b for b in free if plan.buffers[b].dtype == dtype and plan.buffers[b].dim == dim]
    if not same:
        plan.buffers.append(Buffer(dtype, dim, row))
        return len(plan.buffers) - 1
    fits = [b for b in same if plan.buffers[b].row >= row]
    buf = min(fits, key=lambda b: plan.buffers[b].row) if fits else max(same, key=lambda b: plan.buffers[b].row)
    plan.buffers[buf].row = max(plan.buffers[buf].row, row)
    free.remove(buf)
    return buf


def describe(plan: MemoryPlan, g: Graph, view_ops: frozenset[str] = VIEW_OPS) -> str:
    """The buffers, then one line per activation in node order, numbered as print_graph does."""
    lines = [f"buf{i}: {b.dtype}[{b.dim + ',' if b.dim else ''}{b.row}]" for i, b in enumerate(plan.buffers)]
    number = 0
    for n in g.nodes:
        for v in n.outputs:
            where = f"buf{plan.assign[v]}" if v in plan.assign else "output" if v in g.outputs else \
                "view" if n.op in view_ops else "allocator"
            lines.append(f"%{number} = {n.op} -> {where}")
            number += 1
    return "\n".join(lines) + "\n"
