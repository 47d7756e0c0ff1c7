"""The GEMM templates' prologues (rms_norm_linear, add_rms_norm_linear, swiglu_linear, dense or
int4) as generated kernels: the prologue op's decomposition, lowered to the kernel IR and
rendered by emit_generated, writing the GEMM's A operand into the launch's scratch tensor 0
(add_rms_norm_linear's sum goes to its output 0). Any op a prologue-fusion pass puts before a
GEMM gets its kernel the same way; no prologue is hand-written.
"""
from __future__ import annotations

from ...frontend import ops
from ...ir import Node, Value
from ...kernel.build import kernel_of
from .emit_generated import emit_generated
from .kernel import AscendKernel

PROLOGUES = {  # op -> (function of the prologue's inputs, how many of the node's inputs it reads)
    "rms_norm_linear": (lambda a: (lambda x, w: ops.rms_norm(x, w, eps=a["eps"])), 2),
    "add_rms_norm_linear": (lambda a: (lambda x, r, w: ops.add_rms_norm(x, r, w, eps=a["eps"])), 3),
    "swiglu_linear": (lambda a: (lambda x: ops.swiglu(x)), 1),
}


def emit_prologue(node: Node, name: str) -> AscendKernel:
    """The prologue kernel of a prologue-fused GEMM node: its A operand into ["tmp", 0]."""
    make, n_in = PROLOGUES[node.op]
    k, reads, g = kernel_of(make(node.attrs), [v.type for v in node.inputs[:n_in]], name)
    outs = [Value(f"p{j}", v.type) for j, v in enumerate(g.outputs)]
    kernel_node = Node("kernel", [node.inputs[i] for i in reads], outs, {"kernel": k.to_json(), "ops": []})
    (kern,) = emit_generated(kernel_node, name)["kernels"]
    last = len(outs) - 1  # the normalised (or gated) rows: scratch 0; add_rms_norm's sum: output 0

    def form(f):
        if not isinstance(f, list) or not f:
            return f
        if f[0] in ("in", "shape") and isinstance(f[1], int):
            return [f[0], reads[f[1]], *f[2:]]
        if f[0] == "out":
            return ["tmp", 0] if f[1] == last else ["out", f[1]]
        return [form(x) if isinstance(x, list) else x for x in f]

    return AscendKernel(kern.name, kern.source, [form(a) for a in kern.args],
                        [[fld, ct, form(e)] for fld, ct, e in kern.tiling], kern.block_dim, kern.core, kern.workspace,
                        kern.requires, kern.notes)
