"""JAX-style capture: `trace(fn, *specs)` calls fn with Tracers and records IR.

While a trace is active, every call through `deepfuse.frontend.ops` whose arguments
include a Tracer appends a Node to the graph; torch tensors met along the way (model
weights) become named params. Outside a trace the same calls run the op's torch
reference eagerly, so one model definition serves both modes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ir import OPS, Graph, Node, TensorType, Value
from ..ir.types import Dim


@dataclass(frozen=True)
class Spec:
    """A graph input: name, dtype (e.g. "i32") and shape (ints or symbols such as "T")."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    @property
    def type(self) -> TensorType:
        return TensorType(self.dtype, tuple(self.shape))


class Tracer:
    """Stands for a Value while tracing; has .shape and .dtype like a tensor."""

    def __init__(self, ctx: TraceContext, value: Value):
        self.ctx, self.value = ctx, value

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.value.type.shape

    @property
    def dtype(self) -> str:
        return self.value.type.dtype

    def __add__(self, other: Any) -> Any:
        return apply("add", self, other)

    def __mul__(self, other: Any) -> Any:
        return apply("mul", self, other)

    def __repr__(self) -> str:
        return f"Tracer({self.value!r})"


class TraceContext:
    """Appends nodes to `nodes` of `graph`, lifting torch tensors to params by name."""

    def __init__(self, graph: Graph, nodes: list[Node], weight_names: dict[int, str]):
        self.graph, self.nodes, self.weight_names = graph, nodes, weight_names

    def value_of(self, arg: Any) -> Value:
        if isinstance(arg, Tracer):
            return arg.value
        if isinstance(arg, torch.Tensor):
            name = self.weight_names.get(id(arg))
            if name is None:  # a new constant: a name no param has (not even a dropped one's successor)
                taken, i = {p.name for p in self.graph.params} | set(self.graph.weights), len(self.graph.params)
                while f"const{i}" in taken:
                    i += 1
                name = f"const{i}"
            return self.graph.add_param(name, arg)
        raise TypeError(f"cannot trace argument of type {type(arg).__name__}")

    def emit(self, op: str, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
        ins = [self.value_of(a) for a in args]
        try:
            types = OPS[op].infer([v.type for v in ins], attrs)
        except ValueError as e:
            raise ValueError(f"while tracing {op}: {e}") from None
        outs = [self.graph.fresh(t) for t in types]
        self.nodes.append(Node(op, ins, outs, dict(attrs)))
        tracers = tuple(Tracer(self, v) for v in outs)
        return tracers[0] if len(tracers) == 1 and op != "split" else tracers


_ACTIVE: list[TraceContext] = []


def apply(op: str, *args: Any, **attrs: Any) -> Any:
    """Records `op` if any argument is a Tracer, else runs its torch reference."""
    if any(isinstance(a, Tracer) for a in args):
        return args_ctx(args).emit(op, args, attrs)
    return OPS[op].reference(*args, **attrs)


def constant_like(value: float, like: Any) -> torch.Tensor:
    """A 0-d tensor holding `value` in the dtype of `like` (a Tracer or a tensor): under trace it
    becomes a 0-d param, which lowering inlines as a literal."""
    from ..ir import DTYPES

    dtype = DTYPES[like.dtype] if isinstance(like, Tracer) else like.dtype
    return torch.tensor(value, dtype=dtype)


def args_ctx(args: Sequence[Any]) -> TraceContext:
    for a in args:
        if isinstance(a, Tracer):
            return a.ctx
    raise AssertionError("no tracer among arguments")


def _outputs(result: Any) -> list[Tracer]:
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    if not all(isinstance(o, Tracer) for o in outs):
        raise TypeError("a traced function must return Tracers (graph values)")
    return outs


def trace(fn: Callable, *specs: Spec, weights: dict[str, torch.Tensor] | None = None,
          name: str | None = None) -> Graph:
    """Captures fn(*inputs) into a Graph. `weights` names the tensors fn closes over."""
    g = Graph(name or getattr(fn, "__name__", "graph"), [], [], [], [])
    ctx = TraceContext(g, g.nodes, {id(t): n for n, t in (weights or {}).items()})
    g.inputs = [Value(s.name, s.type) for s in specs]
    g.outputs = [t.value for t in _outputs(fn(*[Tracer(ctx, v) for v in g.inputs]))]
    return g


def trace_into(g: Graph, fn: Callable, inputs: Sequence[Value], attrs: dict[str, Any]) -> tuple[list[Node], list[Value]]:
    """Traces fn(*inputs, **attrs) as new nodes of g (not inserted); returns (nodes, outputs)."""
    nodes: list[Node] = []
    ctx = TraceContext(g, nodes, {id(t): n for n, t in g.weights.items()})
    outs = _outputs(fn(*[Tracer(ctx, v) for v in inputs], **attrs))
    return nodes, [t.value for t in outs]
