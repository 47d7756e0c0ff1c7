"""Capture: trace(fn, *specs) -> ir.Graph, and the `ops` namespace models use."""
from . import ops
from .tracer import Spec, Tracer, trace, trace_into

__all__ = ["Spec", "Tracer", "ops", "trace", "trace_into"]
