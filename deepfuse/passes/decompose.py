"""Decomposition: replaces ops a target has no kernel for by their registered decomposition."""
from __future__ import annotations

from collections.abc import Callable

from ..ir import OPS, Graph


def decompose_unsupported(supported: set[str]) -> Callable[[Graph], Graph]:
    """A pass that expands every op not in `supported` that has a decomposition."""

    def decompose(g: Graph) -> Graph:
        while any(n.op not in supported and OPS[n.op].decompose is not None for n in g.nodes):
            expand(g)  # again: a decomposition may use ops that decompose further
        return g

    def expand(g: Graph) -> None:
        from ..frontend import trace_into

        out = []
        for n in g.nodes:
            fn = OPS[n.op].decompose
            if n.op in supported or fn is None:
                out.append(n)
                continue
            nodes, results = trace_into(g, fn, n.inputs, n.attrs)
            out.extend(nodes)
            for old, new in zip(n.outputs, results):
                for m in g.nodes + nodes:
                    m.inputs = [new if v is old else v for v in m.inputs]
                g.outputs = [new if v is old else v for v in g.outputs]
        g.nodes = out

    return decompose
