"""Values, nodes and graphs: the program representation every layer shares.

A Graph owns its inputs (step tensors), params (named constants, with their data in
`weights` when known), nodes in topological order, and outputs. Values are compared
by identity; names only matter for printing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from .types import TensorType


@dataclass(eq=False)
class Value:
    name: str
    type: TensorType

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        ins = ", ".join(f"%{v.name}" for v in self.inputs)
        return f"{outs} = {self.op}({ins})"


@dataclass(eq=False)
class Graph:
    name: str
    inputs: list[Value]
    params: list[Value]
    nodes: list[Node]
    outputs: list[Value]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    _counter: itertools.count = field(default_factory=itertools.count, repr=False)

    def fresh(self, type: TensorType, hint: str = "v") -> Value:
        """A new value with a name not used in this graph."""
        used = {v.name for v in self.all_values()}
        while True:
            name = f"{hint}{next(self._counter)}"
            if name not in used:
                return Value(name, type)

    def all_values(self) -> list[Value]:
        vals = list(self.inputs) + list(self.params)
        for n in self.nodes:
            vals.extend(n.outputs)
        return vals

    def add_param(self, name: str, tensor: torch.Tensor) -> Value:
        """Register a constant; returns its Value (an existing name's Value for the same tensor;
        another tensor under a taken name is an error, never a silent reuse)."""
        for p in self.params:
            if p.name == name:
                if self.weights.get(name) is not None and self.weights[name] is not tensor and not (
                        self.weights[name].shape == tensor.shape and self.weights[name].dtype == tensor.dtype
                        and torch.equal(self.weights[name], tensor)):
                    raise ValueError(f"param %{name} already holds another tensor")
                return p
        v = Value(name, TensorType.of(tensor))
        self.params.append(v)
        self.weights[name] = tensor
        return v

    def users(self) -> dict[Value, list[Node]]:
        out: dict[Value, list[Node]] = {v: [] for v in self.all_values()}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(v, []).append(n)
        return out

    def producers(self) -> dict[Value, Node]:
        return {v: n for n in self.nodes for v in n.outputs}

    def replace_uses(self, old: Value, new: Value) -> None:
        for n in self.nodes:
            n.inputs = [new if v is old else v for v in n.inputs]
        self.outputs = [new if v is old else v for v in self.outputs]

    def drop_unused_params(self) -> None:
        used = {v for n in self.nodes for v in n.inputs} | set(self.outputs)
        self.params = [p for p in self.params if p in used]
        names = {p.name for p in self.params}
        self.weights = {k: w for k, w in self.weights.items() if k in names}

    def copy(self) -> Graph:
        """Structural copy (new Node objects, shared Values and weight tensors)."""
        nodes = [Node(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in self.nodes]
        return Graph(self.name, list(self.inputs), list(self.params), nodes,
                     list(self.outputs), dict(self.weights))

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts
