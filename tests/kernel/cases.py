"""Graph functions whose decompositions every kernel renderer is checked on: each case is
(name, fn over deepfuse.frontend.ops, input specs as (name, shape, kind)), where kind is "act"
(random activations), "weight" (a [C] vector) or "pos" (positive values, for log/sqrt)."""
from __future__ import annotations

import torch

from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import DTYPES, Graph
from deepfuse.kernel.ir import Kernel
from deepfuse.passes import dce
from deepfuse.passes.decompose import decompose_unsupported
from deepfuse.passes.generate_kernels import generate_kernels

D = 96  # not a power of two, not a multiple of 64: tails everywhere


def _glu(x):
    gate, up = ops.split(x, sizes=[D, D], axis=-1)
    return ops.mul(ops.gelu_tanh(gate), up)


CASES = {
    "rms_norm": (lambda x, w: ops.rms_norm(x, w, eps=1e-6), [("x", ("T", D), "act"), ("w", (D,), "weight")]),
    "add_rms_norm": (lambda x, r, w: ops.add_rms_norm(x, r, w, eps=1e-5),
                     [("x", ("T", D), "act"), ("r", ("T", D), "act"), ("w", (D,), "weight")]),
    "swiglu": (lambda x: ops.swiglu(x), [("x", ("T", 2 * D), "act")]),
    "silu_mul": (lambda x, y: ops.mul(ops.silu(x), y), [("x", ("T", D), "act"), ("y", ("T", D), "act")]),
    "gelu_tanh_glu": (_glu, [("x", ("T", 2 * D), "act")]),
    "softmax": (lambda x: ops.softmax(x), [("x", ("T", D), "act")]),
    "softcap": (lambda x: ops.softcap(x, cap=3.0), [("x", ("T", D), "act")]),
    "head_rms_norm": (lambda x, w: ops.head_rms_norm(x, w, eps=1e-6, head_dim=32),
                      [("x", ("T", 4 * 32), "act"), ("w", (32,), "weight")]),
    "where_clamp": (lambda x, y: ops.where(ops.gt(x, y), ops.minimum(x, 1.5), ops.maximum(ops.neg(y), -0.5)),
                    [("x", ("T", D), "act"), ("y", ("T", D), "act")]),
    "math": (lambda x: ops.add(ops.mul(ops.log(x), ops.sqrt(x)), ops.div(ops.erf(x), ops.abs(ops.sub(x, 2.0)))),
             [("x", ("T", D), "pos")]),
}


def case_graph(name: str, dtype: str = "f32") -> Graph:
    fn, specs = CASES[name]
    return trace(fn, *[Spec(n, dtype, shape) for n, shape, _ in specs], name=name)


def case_inputs(name: str, dtype: str = "f32", rows: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, shape, kind in CASES[name][1]:
        dims = [rows if isinstance(d, str) else d for d in shape]
        t = torch.randn(dims, generator=gen)
        if kind == "pos":
            t = t.abs() + 0.1
        elif kind == "weight":
            t = 1.0 + 0.1 * t
        out[n] = t.to(DTYPES[dtype])
    return out


def generated(name: str, dtype: str = "f32") -> Graph:
    """The case's graph, decomposed to primitives and turned into generated kernels."""
    g = case_graph(name, dtype)
    weights = dict(g.weights)
    g = decompose_unsupported(set())(g)
    g.weights.update(weights)
    return dce(generate_kernels()(g))


def kernels_of(g: Graph) -> list[Kernel]:
    return [Kernel.from_json(n.attrs["kernel"]) for n in g.nodes if n.op == "kernel"]
