"""Single-node graphs of every W8A8 projection form (linear_w8a8, logits_w8a8 and the norm /
SwiGLU prologue forms with act_group) and random inputs for them: shared by the Triton and
AscendC kernel tests, which run each graph's kernels against ir.interpret.

Shapes: K = 128 (two groups of 64), N = 40 (part of a tile); row 0's first group is all zero
(its d is 0, no division by it)."""
from __future__ import annotations

import torch

from deepfuse.frontend import Spec, ops, trace
from deepfuse.frontend.tracer import apply
from deepfuse.ir.opdefs_quant import quantize_w8

K, N, G = 128, 40, 64
FORMS = ["linear_w8a8", "logits_w8a8", "rms_norm_linear", "add_rms_norm_linear", "swiglu_linear"]


def case(form: str, rows: int = 5, seed: int = 0) -> tuple:
    """-> (graph, inputs) of one node of `form` over a W8A8 projection [N, K], f32."""
    torch.manual_seed(seed)
    wq, scale = quantize_w8(torch.randn(N, K))
    w = {"wq": wq, "scale": scale, "nw": torch.randn(K)}
    x = torch.randn(rows, 2 * K if form == "swiglu_linear" else K) * 3
    x[0, :G] = 0
    specs, ins = [Spec("x", "f32", ("T", x.shape[1]))], {"x": x}
    if form == "linear_w8a8":
        fn = lambda x: ops.linear_w8a8(x, wq, scale, act_group=G)
    elif form == "logits_w8a8":
        specs.append(Spec("rows", "i32", ("R",)))
        ins["rows"] = torch.tensor([r for r in (0, 2, rows - 1) if r < rows], dtype=torch.int32)
        fn = lambda x, r: apply("logits_w8a8", x, wq, scale, r, act_group=G)
    elif form == "rms_norm_linear":
        fn = lambda x: ops.rms_norm_linear(x, w["nw"], wq, scale, eps=1e-5, act_group=G)
    elif form == "add_rms_norm_linear":
        specs.append(Spec("res", "f32", ("T", K)))
        ins["res"] = torch.randn(rows, K)
        ins["res"][0, :G] = 0
        fn = lambda x, r: ops.add_rms_norm_linear(x, r, w["nw"], wq, scale, eps=1e-5, act_group=G)
    else:
        fn = lambda x: ops.swiglu_linear(x, wq, scale, act_group=G)
    return trace(fn, *specs, weights=w), ins
