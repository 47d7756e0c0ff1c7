"""kernel_of: the one generated kernel of a function over frontend.ops (its decomposition
lowered and fused), for templates that take a generated prologue or epilogue.
"""
from __future__ import annotations

from collections.abc import Callable

from ..ir import Graph, TensorType
from .ir import Kernel


def kernel_of(fn: Callable, types: list[TensorType], name: str = "fn") -> tuple[Kernel, list[int], Graph]:
    """(kernel, for each of its input buffers the index of fn's argument it reads, the graph)
    for fn(*values of `types`); raises ValueError unless it becomes exactly one kernel."""
    from ..frontend import Spec, trace
    from ..passes import dce
    from ..passes.decompose import decompose_for
    from ..passes.generate_kernels import generate_kernels

    g = trace(fn, *[Spec(f"a{i}", t.dtype, t.shape) for i, t in enumerate(types)], name=name)
    weights = dict(g.weights)
    g = decompose_for(lambda n: False)(g)
    g.weights.update(weights)
    g = dce(generate_kernels()(g))
    if [n.op for n in g.nodes] != ["kernel"] or g.outputs != g.nodes[0].outputs:
        raise ValueError(f"{name} does not become one generated kernel: {[n.op for n in g.nodes]}")
    node = g.nodes[0]
    if any(v not in g.inputs for v in node.inputs):
        raise ValueError(f"{name}'s kernel reads values other than its arguments")
    return Kernel.from_json(node.attrs["kernel"]), [g.inputs.index(v) for v in node.inputs], g
