"""Numerics check for a pass: the interpreter before vs after, value by value.

Values a pass keeps (the same Value object before and after) and the graph outputs must agree within
tolerance; a mismatch names the first node, in graph order, whose output differs, which
is at or just downstream of the bad rewrite.
"""
from __future__ import annotations

import torch

from ..ir import Graph
from ..ir.interpret import interpret_all
from .manager import Pass


class NumericsError(AssertionError):
    pass


def _clone(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in inputs.items()}  # kv caches are written in place


def check_numerics(p: Pass, g: Graph, inputs: dict[str, torch.Tensor], atol: float = 1e-5,
                   rtol: float = 1e-5) -> Graph:
    """Runs `p` on a copy of g and compares both under the interpreter; returns the new graph."""
    before = interpret_all(g, _clone(inputs))
    after_g = p(g.copy())
    after = interpret_all(after_g, _clone(inputs))
    for n in after_g.nodes:
        for v in n.outputs:
            want = before.get(v)  # Graph.copy shares Values: a kept value is the same object
            if want is None or want.shape != after[v].shape:
                continue
            if not torch.allclose(after[v].float(), want.float(), atol=atol, rtol=rtol):
                diff = (after[v].float() - want.float()).abs().max().item()
                raise NumericsError(f"after pass {p.name}: %{v.name} = {n.op}(...) differs from before by {diff:.3g}")
    for v_old, v_new in zip(g.outputs, after_g.outputs):
        if not torch.allclose(after[v_new].float(), before[v_old].float(), atol=atol, rtol=rtol):
            raise NumericsError(f"after pass {p.name}: graph output %{v_new.name} differs from before")
    return after_g
