"""generate_kernels: every group of lowerable primitive ops (kernel/schedule.py) becomes one
`kernel` node holding its kernel IR (kernel/lower.py), which each target renders.

`keeps(node)` says the target runs the node with a hand-written kernel; such nodes are never lowered.
Loads see through split and reshape, so those nodes usually die here (a dce follows).
"""
from __future__ import annotations

from collections.abc import Callable

from ..ir import Graph, Node
from ..kernel.lower import lower_group, space_of
from ..kernel.schedule import schedule


def stable_topo(g: Graph) -> None:
    """Reorders g.nodes so every node follows its operands' producers, otherwise keeping order."""
    producers = g.producers()
    order = {n: i for i, n in enumerate(g.nodes)}
    placed: set[Node] = set()
    visiting: set[Node] = set()
    out: list[Node] = []

    def place(n: Node) -> None:
        stack = [(n, False)]
        while stack:
            m, ready = stack.pop()
            if m in placed:
                continue
            if ready:
                placed.add(m)
                visiting.discard(m)
                out.append(m)
                continue
            if m in visiting:
                raise ValueError(f"the graph has a cycle through {m.op}")
            visiting.add(m)
            stack.append((m, True))
            deps = sorted({producers[v] for v in m.inputs if v in producers} - placed, key=order.__getitem__,
                          reverse=True)
            stack.extend((d, False) for d in deps)

    for n in g.nodes:
        place(n)
    g.nodes = out


def generate_kernels(keeps: Callable[[Node], bool] = lambda n: False) -> Callable[[Graph], Graph]:
    def run(g: Graph) -> Graph:
        lowerable = {n for n in g.nodes if not keeps(n) and space_of(n) is not None}
        groups = schedule(g, lowerable)
        users = g.users()
        graph_outputs = set(g.outputs)
        replaced: dict[Node, Node | None] = {}
        grouped = frozenset(n for grp in groups for n in grp.nodes if not all(m.op == "reshape" for m in grp.nodes))
        for i, grp in enumerate(groups):
            if all(n.op == "reshape" for n in grp.nodes):
                continue
            members = set(grp.nodes)
            outputs = [v for n in grp.nodes for v in n.outputs
                       if v in graph_outputs or any(u not in members for u in users.get(v, []))]
            kernel, inputs = lower_group(g, grp.nodes, grp.space, f"gen{i}", outputs, grouped)
            kernel.notes = list(grp.reasons)
            node = Node("kernel", inputs, outputs, {"kernel": kernel.to_json(), "ops": [n.op for n in grp.nodes]})
            for n in grp.nodes:
                replaced[n] = None
            replaced[grp.nodes[-1]] = node
        g.nodes = [replaced.get(n, n) for n in g.nodes if replaced.get(n, n) is not None]
        stable_topo(g)
        return g

    run.module = __import__(__name__, fromlist=["_"])  # the pass id hashes this module
    return run
