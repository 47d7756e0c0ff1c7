"""The op registry: for each IR op, its type rule, torch reference and decomposition.

An op definition does not know about targets. `infer` maps input types and attrs to
output types (raising ValueError with a reason on a mismatch); `reference` computes
the op on torch CPU tensors and is the ground truth for every kernel; `decompose`
(optional) is a function over `deepfuse.frontend.ops` that a target without a
kernel for the op gets instead.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .types import TensorType

InferFn = Callable[[list[TensorType], dict[str, Any]], list[TensorType]]


@dataclass
class OpDef:
    name: str
    infer: InferFn
    reference: Callable[..., Any]
    side_effect: bool = False  # writes an input in place (kv cache); never removed or merged
    decompose: Callable[..., Any] | None = None
    doc: str = ""


OPS: dict[str, OpDef] = {}


def register(name: str, infer: InferFn, side_effect: bool = False) -> Callable:
    """Decorator: registers `reference` under `name`."""

    def wrap(reference: Callable) -> Callable:
        OPS[name] = OpDef(name, infer, reference, side_effect, doc=(reference.__doc__ or "").strip())
        return reference

    return wrap


def decomposition(name: str) -> Callable:
    """Decorator: sets the decomposition of an already registered op."""

    def wrap(fn: Callable) -> Callable:
        OPS[name].decompose = fn
        return fn

    return wrap


def get_op(name: str) -> OpDef:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    return OPS[name]


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)
