"""Row-wise CPU kernels shared by the op kernels (kernels.py), their planned-buffer forms
(out_kernels.py) and the W8A8 projections (w8a8_kernels.py): RMS norms (norms.cpp), SwiGLU
(rows.cpp), row selection and the sampler (sample.cpp), each native where it applies (CPU
tensors), else torch's or the op's reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .native import kernels as native_kernels


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[T,D] -> x[rows] [R,D]; rows are strictly increasing, so R == T means every row, no copy."""
    return x if x.shape[0] == rows.shape[0] else x.index_select(0, rows)


NORM_DTYPES = (torch.float32, torch.bfloat16)  # norms.cpp's


def _native_norm(x: torch.Tensor, w: torch.Tensor):
    """The native kernels where they take these rows (norms.cpp), else None."""
    if not x.is_cpu or x.dtype not in NORM_DTYPES or w.dtype != x.dtype or x.dim() != 2 or x.stride(1) != 1:
        return None
    return native_kernels()


def rms_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x[T,D] / rms(x) * w[D]: one native pass per row, else torch's (both accumulate in f32)."""
    native = _native_norm(x, w)
    if native is not None:
        return native.rms_norm(x, w, eps)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def add_rms_rows(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float,
                 sum_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_rows(s, w)) with s = x + res, written into sum_out when given."""
    native = _native_norm(x, w)
    if native is not None and res.dtype == x.dtype and res.dim() == 2 and res.stride(1) == 1:
        return native.add_rms_norm(x, res, w, eps, sum_out)
    s = torch.add(x, res) if sum_out is None else torch.add(x, res, out=sum_out)
    return s, rms_rows(s, w, eps)


def native_rows():
    """The native kernels for swiglu, rope + cache write and greedy argmax (rows.cpp), or None."""
    return native_kernels()


def swiglu_rows(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x[T, 2F] = [gate | up] -> [T, F]: one native pass (rows.cpp), else torch's."""
    if x.is_cpu and x.dtype in NORM_DTYPES and x.dim() == 2 and x.stride(1) == 1:
        native = native_rows()
        if native is not None:
            return native.swiglu(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def native_sampler():
    """The native kernels where their sample and spec_verify passed the self-check (sample.cpp), or None."""
    native = native_kernels()
    return native if native is not None and native.sample_available() else None


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor) -> torch.Tensor:
    """The sample op on logits[S,V] f32 (temperature[S] f32, top_k[S] i64, top_p[S] f32, seeds[S]
    i64) -> tokens[S] i64: the native kernel where it takes these tensors, else the op's reference
    (greedy rows alone: the native argmax where the self-check refused the sampler)."""
    native = native_kernels()
    if native is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.stride(1) == 1 and logits.shape[1] > 0 and _vectors(temperature, top_p, torch.float32) \
            and _vectors(top_k, seeds, torch.int64):
        if native_sampler() is not None:
            return native.sample(logits, temperature, top_k, top_p, seeds)
        if not (temperature.numpy() > 0).any():
            return native.argmax(logits)
    from ...ir import OPS

    return OPS["sample"].reference(logits, temperature, top_k, top_p, seeds)


def _vectors(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return all(t.is_cpu and t.dtype == dtype and t.dim() == 1 and t.is_contiguous() for t in (a, b))
