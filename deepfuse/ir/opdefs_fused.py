"""Fused ops the fusion passes produce (a target implements them as one kernel each).

    rms_norm_linear(x, w, W)             = linear(rms_norm(x, w), W)           norm as the GEMM's prologue
    add_rms_norm_linear(x, r, w, W)      = (x + r, linear(rms_norm(x + r, w), W))
    swiglu_linear(x, W)                  = linear(swiglu(x), W)                activation as the GEMM's prologue
    qkv_rope_cache(qkv, pos, cache, slots) -> (q, k, v): split, RoPE on q and k, and the paged
                                            KV-cache write; the attention that follows reads the
                                            cache with write_kv=False
Each has a decomposition into the ops it replaced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .opdefs_basic import swiglu
from .opdefs_llm import rms_norm, rope, write_kv
from .ops import decomposition, expect, register
from .types import TensorType


def _proj(x: TensorType, w: TensorType) -> TensorType:
    expect(w.rank == 2 and x.shape[-1] == w.shape[1] and x.dtype == w.dtype, f"projection {w} does not fit {x}")
    return x.with_shape(x.shape[0], w.shape[0])


def _rms_norm_linear_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, w, proj = types
    expect(w.shape == (x.shape[-1],), f"rms_norm_linear norm weight {w} does not fit {x}")
    return [_proj(x, proj)]


@register("rms_norm_linear", _rms_norm_linear_type)
def rms_norm_linear(x, w, proj, *, eps: float) -> torch.Tensor:
    """linear(rms_norm(x[T,D], w[D]), proj[N,D]) -> [T,N]."""
    return F.linear(rms_norm(x, w, eps=eps), proj)


@decomposition("rms_norm_linear")
def _rms_norm_linear_decomp(x, w, proj, *, eps):
    from ..frontend import ops

    return ops.linear(ops.rms_norm(x, w, eps=eps), proj)


def _add_rms_norm_linear_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, res, w, proj = types
    expect(x == res and w.shape == (x.shape[-1],), f"add_rms_norm_linear operands {x}, {res}, {w} differ")
    return [x, _proj(x, proj)]


@register("add_rms_norm_linear", _add_rms_norm_linear_type)
def add_rms_norm_linear(x, res, w, proj, *, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, linear(rms_norm(s, w), proj)) with s = x + res."""
    s = x + res
    return s, F.linear(rms_norm(s, w, eps=eps), proj)


@decomposition("add_rms_norm_linear")
def _add_rms_norm_linear_decomp(x, res, w, proj, *, eps):
    from ..frontend import ops

    s, normed = ops.add_rms_norm(x, res, w, eps=eps)
    return s, ops.linear(normed, proj)


def _swiglu_linear_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, proj = types
    expect(isinstance(x.shape[-1], int) and x.shape[-1] == 2 * proj.shape[1], f"swiglu_linear: {proj} does not fit {x}")
    return [x.with_shape(x.shape[0], proj.shape[0])]


@register("swiglu_linear", _swiglu_linear_type)
def swiglu_linear(x, proj) -> torch.Tensor:
    """linear(swiglu(x[T,2I]), proj[N,I]) -> [T,N]."""
    return F.linear(swiglu(x), proj)


@decomposition("swiglu_linear")
def _swiglu_linear_decomp(x, proj):
    from ..frontend import ops

    return ops.linear(ops.swiglu(x), proj)


def _qkv_rope_cache_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    qkv, pos, cache, slots = types
    sizes = attrs["sizes"]
    expect(len(sizes) == 3 and qkv.shape[1] == sum(sizes), f"qkv_rope_cache sizes {sizes} do not split {qkv}")
    expect(cache.rank == 5 and cache.dtype == qkv.dtype, f"qkv_rope_cache cache {cache} does not fit {qkv}")
    return [qkv.with_shape(qkv.shape[0], s) for s in sizes]


@register("qkv_rope_cache", _qkv_rope_cache_type, side_effect=True)
def qkv_rope_cache(qkv, positions, kv_cache, slot_mapping, *, sizes: list[int], head_dim: int,
                   theta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv[T,Q+K+V] -> (rope(q), rope(k), v); writes rope(k) and v into kv_cache at slot_mapping."""
    q, k, v = (t.contiguous() for t in torch.split(qkv, sizes, dim=-1))
    q, k = rope(q, positions, head_dim=head_dim, theta=theta), rope(k, positions, head_dim=head_dim, theta=theta)
    write_kv(kv_cache, k, v, slot_mapping)
    return q, k, v
