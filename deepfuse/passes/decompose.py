"""Decomposition: an op the target has no hand kernel for is replaced by its registered
decomposition when every piece of it then runs as a kernel there (a hand kernel, or a
primitive the kernel generator lowers); otherwise it stays whole and runs its reference
(listed as a host step). So a decomposition never turns one reference launch into many.
"""
from __future__ import annotations

from collections.abc import Callable

from ..ir import OPS, Graph, Node, Value
from ..kernel.lower import space_of

Keep = Callable[[Node], bool]


def decompose_unsupported(supported: set[str]) -> Callable[[Graph], Graph]:
    """Expands every op not in `supported` that has a decomposition, whatever its pieces are."""
    return decompose_for(lambda n: n.op in supported, runs_anything=True)


def decompose_for(keep: Keep, runs_anything: bool = False) -> Callable[[Graph], Graph]:
    """A pass expanding each node that `keep` refuses and that has a decomposition whose pieces
    all run as kernels (kept, lowerable, or views); runs_anything: expand regardless."""

    def runs(n: Node) -> bool:
        return runs_anything or keep(n) or space_of(n) is not None or is_view(n)

    def decompose(g: Graph) -> Graph:
        from ..frontend import trace_into

        out: list[Node] = []
        for n in g.nodes:
            traced: list[Node] = []  # every node traced for n, so a nested expansion rewires its siblings
            done = expand(g, n, trace_into, traced)
            out.extend(done[0] if done is not None else [n])
        g.nodes = out
        return g

    def expand(g: Graph, n: Node, trace_into, traced: list[Node]) -> tuple[list[Node], list[Value]] | None:
        """(n's full expansion, the values now standing for n's outputs), with n's outputs
        rewired to them; None where n stays whole."""
        fn = OPS[n.op].decompose
        if keep(n) or fn is None or (not runs_anything and space_of(n) is not None):  # lowered as it is
            return None
        nodes, results = trace_into(g, fn, n.inputs, n.attrs)
        traced.extend(nodes)
        flat: list[Node] = []
        for m in nodes:
            done = expand(g, m, trace_into, traced)
            if done is None and not runs(m):
                return None
            if done is None:
                flat.append(m)
                continue
            flat.extend(done[0])
            stands = dict(zip(m.outputs, done[1]))
            results = [stands.get(r, r) for r in results]
        _rewire(g, n.outputs, results, traced)
        return flat, results

    return decompose


def is_view(n: Node) -> bool:
    """A split or reshape that generated kernels read in place (lower.view_of), no launch of its own."""
    if n.op == "reshape":
        return True
    x = n.inputs[0].type if n.inputs else None
    return n.op == "split" and x is not None and x.rank == 2 and n.attrs.get("axis", -1) in (-1, 1) \
        and isinstance(x.shape[1], int)


def _rewire(g: Graph, old: list[Value], new: list[Value], added: list[Node]) -> None:
    for o, v in zip(old, new):
        for m in g.nodes + added:
            m.inputs = [v if x is o else x for x in m.inputs]
        g.outputs = [v if x is o else x for x in g.outputs]
