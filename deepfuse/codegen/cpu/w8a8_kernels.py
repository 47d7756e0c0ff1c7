"""W8A8 projections on the CPU (linear_w8a8, logits_w8a8, and the norm / SwiGLU prologue-fused
forms): weights packed at load for the native int8 GEMM (i8_gemm.cpp), the op's reference
where that cannot run."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...ir.opdefs_quant import linear_w8a8, w8a8_product
from .bound import Bound
from .native import kernels as native_kernels
from .program import RunOutput, aten_op, native_op, program_op
from .row_kernels import add_rms_rows, rms_rows, swiglu_rows, take_rows


class W8A8Weights:
    """A linear_w8a8 weight (wq u8[N,K], scale f32[N]), packed at load for the native int8 GEMM
    (i8_gemm.cpp, AVX512-VNNI; f32 and bf16 activations); kept as it is for the op's reference
    where that cannot run."""

    def __init__(self, dtype: torch.dtype, wq: torch.Tensor, scale: torch.Tensor):
        self.n, self.wq, self.scale = wq.shape[0], wq, scale
        native = native_kernels()
        self.native = native if native is not None and native.i8_gemm_available() and dtype in NATIVE_W8A8 else None
        if self.native is not None:
            self.panels = self.native.pack_w8(wq)
            self.padded_scale = F.pad(scale, (0, -self.n % 16))


NATIVE_W8A8 = (torch.float32, torch.bfloat16)


def native_linear(x: torch.Tensor, w: W8A8Weights, act_group: int,
                  out: torch.Tensor | None = None) -> Callable[[], torch.Tensor] | None:
    """w8a8_linear's native GEMM bound to these tensors, or None where it cannot run."""
    if w.native is None or x.dtype not in NATIVE_W8A8:
        return None
    return native_op(w.native, "i8_gemm", x, w.panels, w.padded_scale, w.n, act_group, out)


def w8a8_linear(x: torch.Tensor, w: W8A8Weights, act_group: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x[T,K] @ w^T -> [T,N], activations quantized per row and group of act_group (into out if given)."""
    call = native_linear(x, w, act_group, out)
    if call is not None:
        return call()
    y = linear_w8a8(x, w.wq, w.scale, act_group=act_group)
    return y if out is None else out.copy_(y)


def w8a8_logits(x: torch.Tensor, w: W8A8Weights, rows: torch.Tensor, act_group: int) -> torch.Tensor:
    """f32 logits [R,V] of x[rows] over a W8A8 head."""
    x = take_rows(x, rows)
    if w.native is not None and x.dtype in NATIVE_W8A8:
        out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
        return w.native.i8_gemm(x, w.panels, w.padded_scale, w.n, act_group, out)
    return w8a8_product(x, w.wq, w.scale, act_group)


def w8a8_logits_kernel(act_group: int) -> Callable:
    """logits_w8a8's kernel (x, w, rows) -> [R,V] f32, with bind_new: in a step program, the rows
    gathered into a buffer of the binding, then the native GEMM into the run's logits."""

    def logits(x: torch.Tensor, w: W8A8Weights, rows: torch.Tensor) -> torch.Tensor:
        return w8a8_logits(x, w, rows, act_group)

    def bind_new(x, w: W8A8Weights, rows) -> tuple[Bound, list[RunOutput]] | None:
        if w.native is None or not isinstance(x, torch.Tensor) or x.dtype not in NATIVE_W8A8 or x.dim() != 2 \
                or not isinstance(rows, torch.Tensor):
            return None
        picked = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype)  # x[rows], rewritten by each run
        out = RunOutput((rows.shape[0], w.n), torch.float32)
        return Bound([aten_op("index_select", x, rows, picked),
                      program_op("i8_gemm_to", picked, w.panels, w.padded_scale, w.n, act_group, out)]), [out]

    logits.bind_new = bind_new
    return logits


def native_swiglu_linear(x: torch.Tensor, w: W8A8Weights, act_group: int,
                         out: torch.Tensor | None = None) -> Callable[[], torch.Tensor] | None:
    """w8a8_swiglu_linear's native GEMM bound to these tensors, or None where it cannot run."""
    if w.native is None or x.dtype not in NATIVE_W8A8:
        return None
    return native_op(w.native, "i8_gemm_swiglu", x, w.panels, w.padded_scale, w.n, act_group, out)


def w8a8_swiglu_linear(x: torch.Tensor, w: W8A8Weights, act_group: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_w8a8(swiglu(x[T,2K]), w) -> [T,N]; the native GEMM makes each row's activation as it
    quantizes it (the [T,K] activation is never stored)."""
    call = native_swiglu_linear(x, w, act_group, out)
    if call is not None:
        return call()
    return w8a8_linear(swiglu_rows(x), w, act_group, out)


def native_norm_linear(x: torch.Tensor, res: torch.Tensor | None, nw: torch.Tensor, eps: float, w: W8A8Weights,
                       act_group: int, sum_out: torch.Tensor | None,
                       out: torch.Tensor | None = None) -> Callable[[], torch.Tensor] | None:
    """w8a8_norm_linear's native GEMM (the norm as its prologue, x + res written to sum_out, which
    must be given with res) bound to these tensors, or None where it cannot run."""
    rows = (x,) if res is None else (x, res, sum_out)
    if w.native is None or x.dtype not in NATIVE_W8A8 or nw.dtype != x.dtype or x.dim() != 2 \
            or any(t is None or t.stride(1) != 1 or t.shape != x.shape or t.dtype != x.dtype for t in rows):
        return None
    return native_op(w.native, "i8_gemm_norm", x, res, nw.contiguous(), eps, sum_out, w.panels, w.padded_scale, w.n,
                   act_group, out)


def w8a8_norm_linear(x: torch.Tensor, res: torch.Tensor | None, nw: torch.Tensor, eps: float, w: W8A8Weights,
                     act_group: int, sum_out: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(s, linear_w8a8(rms_norm(s, nw), w)) with s = x + res (written into sum_out when given), or
    (None, linear_w8a8(rms_norm(x, nw), w)) without res; natively the norm is the GEMM's prologue."""
    if res is not None and sum_out is None:
        sum_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    call = native_norm_linear(x, res, nw, eps, w, act_group, sum_out, out)
    if call is not None:
        return sum_out, call()
    if res is None:
        return None, w8a8_linear(rms_rows(x, nw, eps), w, act_group, out)
    s, normed = add_rms_rows(x, res, nw, eps, sum_out)
    return s, w8a8_linear(normed, w, act_group, out)
