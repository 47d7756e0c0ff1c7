"""Verifier: every value defined once before use, known ops, types that follow the op rules.

Errors name the node (`%12 = rope(...)`) so a broken pass is easy to find.
"""
from __future__ import annotations

from ..errors import DeepfuseError
from .graph import Graph, Node
from .ops import OPS


class VerifyError(DeepfuseError):
    """A graph that breaks the IR's rules. A DeepfuseError (so a ValueError): a graph file is
    user input, and the CLI shows this message instead of a traceback."""


def _where(i: int, n: Node) -> str:
    return f"node {i} ({n!r})"


def verify(g: Graph) -> None:
    """Raises VerifyError naming the first bad node; returns None when the graph is sound."""
    defined = set(g.inputs) | set(g.params)
    if len(defined) != len(g.inputs) + len(g.params):
        raise VerifyError("an input or param is declared twice")
    names = [v.name for v in g.params]
    if len(set(names)) != len(names):
        raise VerifyError("two params share a name")
    for i, n in enumerate(g.nodes):
        if n.op not in OPS:
            raise VerifyError(f"{_where(i, n)}: unknown op {n.op!r}")
        for v in n.inputs:
            if v not in defined:
                raise VerifyError(f"{_where(i, n)}: uses %{v.name} before it is defined")
        try:
            want = OPS[n.op].infer([v.type for v in n.inputs], n.attrs)
        except (ValueError, KeyError, TypeError, IndexError, ArithmeticError) as e:  # a rule on bad attrs
            raise VerifyError(f"{_where(i, n)}: {e}") from None
        got = [v.type for v in n.outputs]
        if want != got:
            raise VerifyError(f"{_where(i, n)}: output types {', '.join(map(str, got))} "
                              f"but {n.op} gives {', '.join(map(str, want))}")
        for v in n.outputs:
            if v in defined:
                raise VerifyError(f"{_where(i, n)}: redefines %{v.name}")
            defined.add(v)
    for v in g.outputs:
        if v not in defined:
            raise VerifyError(f"graph output %{v.name} is never defined")
