"""The out-kernels' calls (out_kernels.py) as native ops (program.py), for bound steps.

Each function returns the NativeOps that do what one out-kernel's call does on these tensors,
taking the same branches its Python takes (they depend on shapes, dtypes, strides and the packed
weight's kind only), or None where a branch is not one native kernel or ATen op (the kernel's own
call is then bound as it is). Intermediates the Python call allocates (a norm's rows before a
projection, SwiGLU's product) get a scratch tensor made here, once per binding.
"""
from __future__ import annotations

import torch

from .native import kernels as native_kernels
from .packed_weights import PanelWeight, Q4Panels, Q4Weights
from .program import NativeOp, aten_op, native_op
from .row_kernels import NORM_DTYPES

Ops = list[NativeOp] | None


def project(x: torch.Tensor, w, out: torch.Tensor) -> Ops:
    """out_kernels.mm_into(x, w, out): out[T,N] = x[T,K] @ w^T."""
    native = native_kernels()
    if isinstance(w, Q4Weights):
        if w.int4 is not None and x.shape[0] <= w.int4_rows:
            return [aten_op("int4_mm", x, w.int4, w.group, w.scale_zero, out)]
        w = w.dense
        if isinstance(w, Q4Panels):
            return [native_op(native, "q4_gemm", x, *w.tiles, w.n, out)]
        if not isinstance(w, PanelWeight):
            return None  # oneDNN's packed copy: allocates, then copied
    if isinstance(w, PanelWeight):
        return [native_op(native, "panel_gemm" if w.gemm is native.panel_gemm else "bf16_gemm", x, w.panels, w.n,
                          out)]
    if isinstance(w, torch.Tensor):
        return [aten_op("mm", x, w, out)]
    return None


def _rows_native(x: torch.Tensor, w: torch.Tensor | None = None):
    """The native module where its row kernels take x (and the norm weight w), else None
    (row_kernels.py's conditions)."""
    if not x.is_cpu or x.dtype not in NORM_DTYPES or x.dim() != 2 or x.stride(1) != 1:
        return None
    if w is not None and w.dtype != x.dtype:
        return None
    return native_kernels()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[Ops, torch.Tensor | None]:
    """row_kernels.rms_rows(x, w, eps): (ops, the rows they write)."""
    native = _rows_native(x, w)
    if native is None:
        return None, None
    normed = torch.empty(x.shape, dtype=x.dtype)
    return [native_op(native, "rms_norm", x, w, eps, normed)], normed


def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float,
                 sum_out: torch.Tensor) -> tuple[Ops, torch.Tensor | None]:
    """row_kernels.add_rms_rows(x, res, w, eps, sum_out): (ops, the normed rows they write)."""
    native = _rows_native(x, w)
    if native is None or res.dtype != x.dtype or res.dim() != 2 or res.stride(1) != 1:
        return None, None
    normed = torch.empty(x.shape, dtype=x.dtype)
    return [native_op(native, "add_rms_norm", x, res, w, eps, sum_out, normed)], normed


def rms_norm_into(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> Ops:
    """rms_rows(x, w, eps) written into out (an rms_norm launch's planned buffer)."""
    native = _rows_native(x, w)
    if native is None or out.dtype != x.dtype or out.stride(1) != 1:
        return None
    return [native_op(native, "rms_norm", x, w, eps, out)]


def add_rms_norm_into(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float, sum_out: torch.Tensor,
                      norm_out: torch.Tensor) -> Ops:
    """add_rms_rows(x, res, w, eps, sum_out) with its normed rows written into norm_out."""
    native = _rows_native(x, w)
    if native is None or res.dtype != x.dtype or res.dim() != 2 or res.stride(1) != 1 \
            or any(t.dtype != x.dtype or t.stride(1) != 1 for t in (sum_out, norm_out)):
        return None
    return [native_op(native, "add_rms_norm", x, res, w, eps, sum_out, norm_out)]


def swiglu(x: torch.Tensor) -> tuple[Ops, torch.Tensor | None]:
    """row_kernels.swiglu_rows(x): (ops, the rows they write)."""
    native = _rows_native(x)
    if native is None:
        return None, None
    y = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    return [native_op(native, "swiglu", x, y)], y


def swiglu_into(x: torch.Tensor, out: torch.Tensor) -> Ops:
    """swiglu_rows(x) written into out (a swiglu launch's planned buffer)."""
    native = _rows_native(x)
    if native is None or out.dtype != x.dtype or out.dim() != 2 or out.stride(1) != 1:
        return None
    return [native_op(native, "swiglu", x, out)]


def then_project(first: tuple[Ops, torch.Tensor | None], w, out: torch.Tensor) -> Ops:
    """first's ops, then its rows projected into out."""
    ops, rows = first
    if ops is None:
        return None
    proj = project(rows, w, out)
    return None if proj is None else ops + proj
