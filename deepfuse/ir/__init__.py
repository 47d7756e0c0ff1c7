"""The typed IR: types, graphs, op registry, text format, verifier, interpreter."""
from . import (  # noqa: F401  (registers the ops; opdefs_prim: primitives and decompositions)
    opdefs_basic,
    opdefs_collective,
    opdefs_ep,
    opdefs_fused,
    opdefs_kernel,
    opdefs_llm,
    opdefs_moe,
    opdefs_prim,
    opdefs_quant,
    opdefs_shard,
)
from .graph import Graph, Node, Value
from .interpret import interpret
from .ops import OPS, OpDef, get_op
from .text import IRSyntaxError, parse_graph, print_graph
from .types import DTYPES, TensorType, parse_type
from .verify import VerifyError, verify

__all__ = [
           "DTYPES",
           "IRSyntaxError",
           "OPS",
           "Graph",
           "Node",
           "OpDef",
           "TensorType",
           "Value",
           "VerifyError",
           "get_op",
           "interpret",
           "parse_graph",
           "parse_type",
           "print_graph",
           "verify",
]
