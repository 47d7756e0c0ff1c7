"""Reference interpreter: runs any graph with each op's torch reference on CPU.

The ground truth for every kernel on every target. Inputs are checked against the
graph's input types (symbols bound consistently); in-place ops (kv cache) mutate the
tensors passed in.
"""
from __future__ import annotations

import torch

from .graph import Graph, Value
from .ops import OPS


def check_inputs(g: Graph, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """Validates step inputs against g.inputs; returns the symbol bindings."""
    bindings: dict[str, int] = {}
    for v in g.inputs:
        if v.name not in inputs:
            raise ValueError(f"missing graph input %{v.name}: {v.type}")
        t = inputs[v.name]
        if not v.type.matches(t, bindings):
            raise ValueError(f"graph input %{v.name} wants {v.type}, got {t.dtype!s}{list(t.shape)} "
                             f"(bindings so far {bindings})")
    return bindings


def interpret(g: Graph, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Runs g on inputs (by input name); returns the graph outputs in order."""
    env = interpret_all(g, inputs)
    return [env[v] for v in g.outputs]


def interpret_all(g: Graph, inputs: dict[str, torch.Tensor]) -> dict[Value, torch.Tensor]:
    """Runs g on inputs; returns every value's tensor (inputs, params, node outputs)."""
    check_inputs(g, inputs)
    env: dict[Value, torch.Tensor] = {v: inputs[v.name] for v in g.inputs}
    for p in g.params:
        if p.name not in g.weights:
            raise ValueError(f"param %{p.name} has no data")
        env[p] = g.weights[p.name]
    for n in g.nodes:
        res = OPS[n.op].reference(*[env[v] for v in n.inputs], **n.attrs)
        outs = res if isinstance(res, tuple) else (res,)
        for v, t in zip(n.outputs, outs):
            env[v] = t
    return env
