"""int4 x int8 projections on the CPU (linear_q4a8, and the norm / SwiGLU prologue-fused forms with
an int4-a8 projection): the Q4_1 weight packed at load into the native kernel's blocks
(q4a8_gemm.cpp, AVX512-VNNI; f32 and bf16 activations), the op's reference where that cannot run.
One kernel at every row count, so a row's result never depends on the batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ir.opdefs_quant import linear_q4a8, unpack_q4
from .native import kernels as native_kernels
from .program import NativeOp, native_op
from .row_kernels import add_rms_rows, rms_rows, swiglu_rows

GROUP = 32  # the native kernel's group (weights and activations)
NATIVE_Q4A8 = (torch.float32, torch.bfloat16)


def pack_q4a8(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """An int4 weight (packed u8[N,K/2], scales and mins f32[N,K/32]) as q4a8_gemm's blocks
    u8[ceil(N/16), K/32, 320]: per 16 columns and group, 256 bytes of nibbles (byte 64v + 4c + e:
    column c's k = 4v + e low, k = 16 + 4v + e high), then the 16 scales and 16 mins as f16."""
    q = unpack_q4(packed)
    n, k = q.shape
    nb, g, pad = -(-n // 16), k // GROUP, -n % 16
    t = F.pad(q, (0, 0, 0, pad)).view(nb, 16, g, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [nb, g, v, c, e, half]
    nibbles = (t[..., 0] | (t[..., 1] << 4)).reshape(nb, g, 256)
    halves = [F.pad(a.half(), (0, 0, 0, pad)).view(nb, 16, g).transpose(1, 2).contiguous().view(torch.uint8)
              for a in (scales, mins)]
    return torch.cat((nibbles, *halves), dim=-1).contiguous()


class Q4A8Weights:
    """A linear_q4a8 weight (packed u8[N,K/2], scales and mins f32[N,K/G]): the native kernel's
    blocks where it runs (groups of 32, f32 or bf16 activations), else the tensors as they are
    for the op's reference."""

    def __init__(self, dtype: torch.dtype, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
        self.n, self.group = packed.shape[0], packed.shape[1] * 2 // scales.shape[1]
        native = native_kernels()
        ok = native is not None and native.q4a8_gemm_available() and dtype in NATIVE_Q4A8 and self.group == GROUP
        self.native = native if ok else None
        if self.native is not None:
            self.blocks = pack_q4a8(packed, scales, mins)
        else:
            self.packed, self.scales, self.mins = packed, scales, mins


def native_linear(x: torch.Tensor, w: Q4A8Weights, out: torch.Tensor | None = None) -> NativeOp | None:
    """q4a8_linear's native kernel bound to these tensors, or None where it cannot run."""
    if w.native is None or x.dtype not in NATIVE_Q4A8:
        return None
    return native_op(w.native, "q4a8_gemm", x, w.blocks, w.n, out)


def q4a8_linear(x: torch.Tensor, w: Q4A8Weights, out: torch.Tensor | None = None) -> torch.Tensor:
    """x[T,K] @ w^T -> [T,N], x quantized per row and group of 32 (into out if given)."""
    call = native_linear(x, w, out)
    if call is not None:
        return call()
    if w.native is not None:
        raise TypeError(f"linear_q4a8: {x.dtype} activations on weights packed for {NATIVE_Q4A8}")
    y = linear_q4a8(x, w.packed, w.scales, w.mins, group_size=w.group)
    return y if out is None else out.copy_(y)


def native_swiglu_linear(x: torch.Tensor, w: Q4A8Weights, out: torch.Tensor | None = None) -> NativeOp | None:
    """q4a8_swiglu_linear's native kernel bound to these tensors, or None where it cannot run."""
    if w.native is None or x.dtype not in NATIVE_Q4A8:
        return None
    return native_op(w.native, "q4a8_gemm_swiglu", x, w.blocks, w.n, out)


def q4a8_swiglu_linear(x: torch.Tensor, w: Q4A8Weights, out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_q4a8(swiglu(x[T,2K]), w) -> [T,N]; natively each row's activation is made as the
    kernel quantizes it (the [T,K] activation is never stored)."""
    call = native_swiglu_linear(x, w, out)
    return call() if call is not None else q4a8_linear(swiglu_rows(x), w, out)


def native_norm_linear(x: torch.Tensor, res: torch.Tensor | None, nw: torch.Tensor, eps: float, w: Q4A8Weights,
                       sum_out: torch.Tensor | None, out: torch.Tensor | None = None) -> NativeOp | None:
    """q4a8_norm_linear's native kernel (the norm as its prologue, x + res written to sum_out, which
    must be given with res) bound to these tensors, or None where it cannot run."""
    rows = (x,) if res is None else (x, res, sum_out)
    if w.native is None or x.dtype not in NATIVE_Q4A8 or nw.dtype != x.dtype or x.dim() != 2 \
            or any(t is None or t.stride(1) != 1 or t.shape != x.shape or t.dtype != x.dtype for t in rows):
        return None
    return native_op(w.native, "q4a8_gemm_norm", x, res, nw.contiguous(), eps, sum_out, w.blocks, w.n, out)


def q4a8_norm_linear(x: torch.Tensor, res: torch.Tensor | None, nw: torch.Tensor, eps: float, w: Q4A8Weights,
                     sum_out: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(s, linear_q4a8(rms_norm(s, nw), w)) with s = x[T,K] + res (into sum_out when given), or
    (None, linear_q4a8(rms_norm(x, nw), w)) without res; natively the norm is the kernel's prologue."""
    if res is not None and sum_out is None:
        sum_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    call = native_norm_linear(x, res, nw, eps, w, sum_out, out)
    if call is not None:
        return sum_out, call()
    if res is None:
        return None, q4a8_linear(rms_rows(x, nw, eps), w, out)
    s, normed = add_rms_rows(x, res, nw, eps, sum_out)
    return s, q4a8_linear(normed, w, out)
