"""Fused ops the fusion passes produce (a target implements them as one kernel each).

    rms_norm_linear(x, w, *W)            = linear(rms_norm(x, w), W)           norm as the GEMM's prologue
    add_rms_norm_linear(x, r, w, *W)     = (x + r, linear(rms_norm(x + r, w), W))
    swiglu_linear(x, *W)                 = linear(swiglu(x), W)                activation as the GEMM's prologue
    qkv_rope_cache(qkv, pos, cache, slots[, q_norm, k_norm]) -> (q, k, v): split, (Qwen3's
                                            per-head RMSNorm of q and k,) RoPE on q and k, and the
                                            paged KV-cache write; the attention that follows reads
                                            the cache with write_kv=False
    qkv_attention(qkv, pos, cache, slots, tables, lens, qlens) = attention(*qkv_rope_cache(...)):
                                            the split, RoPE and cache write as the attention's
                                            prologue (new keys come from qkv, older ones from the cache)
`*W` is the projection: one dense weight W[N,K], linear_q4's (packed, scales, mins) with the
attr group_size, linear_w8a8's (wq, scale) with the attr act_group, or linear_q4a8's (packed,
scales, mins) with both attrs (act_group == group_size: int4 weights, int8 activations; is_q4a8).
Each op has a decomposition into the ops it replaced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .opdefs_basic import swiglu
from .opdefs_llm import attention, check_kv_cache, rms_norm, rope, write_kv
from .opdefs_moe import head_rms_norm
from .opdefs_quant import _linear_q4_type, _linear_q4a8_type, _linear_w8a8_type, linear_q4, linear_q4a8, linear_w8a8
from .ops import OPS, decomposition, expect, register
from .types import TensorType


def is_q4a8(attrs: dict) -> bool:
    """Whether a fused op's projection is linear_q4a8's (attrs group_size and act_group)."""
    return "group_size" in attrs and "act_group" in attrs


def _proj(x: TensorType, proj: list[TensorType], attrs: dict) -> TensorType:
    """The type of linear(x, *proj): a dense weight, (packed, scales, mins) with group_size (and
    act_group == group_size: int4-a8), or (wq, scale) with act_group (W8A8)."""
    if len(proj) == 3 and is_q4a8(attrs):
        expect(attrs["act_group"] == attrs["group_size"], f"int4-a8 projection: act_group must equal group_size, "
                                                          f"got {attrs}")
        return _linear_q4a8_type([x, *proj], {"group_size": attrs["group_size"]})[0]
    if len(proj) == 3 and "group_size" in attrs:
        return _linear_q4_type([x, *proj], attrs)[0]
    if len(proj) == 2 and "act_group" in attrs:
        return _linear_w8a8_type([x, *proj], attrs)[0]
    expect(len(proj) == 1 and "group_size" not in attrs and "act_group" not in attrs,
           f"projection must be W, (packed, scales, mins) or (wq, scale), got {proj}")
    w = proj[0]
    expect(w.rank == 2 and x.shape[-1] == w.shape[1] and x.dtype == w.dtype, f"projection {w} does not fit {x}")
    return x.with_shape(x.shape[0], w.shape[0])


def project(x: torch.Tensor, proj: tuple, group_size: int | None, act_group: int | None = None) -> torch.Tensor:
    """linear(x, W), linear_q4(x, packed, scales, mins), linear_q4a8 (both groups) or linear_w8a8(x, wq, scale)."""
    if group_size is not None and act_group is not None:
        return linear_q4a8(x, *proj, group_size=group_size)
    if group_size is not None:
        return linear_q4(x, *proj, group_size=group_size)
    return F.linear(x, proj[0]) if act_group is None else linear_w8a8(x, *proj, act_group=act_group)


def _project_decomp(x, proj: tuple, group_size: int | None, act_group: int | None = None):
    from ..frontend import ops

    if group_size is not None and act_group is not None:
        return ops.linear_q4a8(x, *proj, group_size=group_size)
    if group_size is not None:
        return ops.linear_q4(x, *proj, group_size=group_size)
    return ops.linear(x, *proj) if act_group is None else ops.linear_w8a8(x, *proj, act_group=act_group)


def _rms_norm_linear_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, w, *proj = types
    expect(w.shape == (x.shape[-1],), f"rms_norm_linear norm weight {w} does not fit {x}")
    return [_proj(x, proj, attrs)]


@register("rms_norm_linear", _rms_norm_linear_type)
def rms_norm_linear(x, w, *proj, eps: float, group_size: int | None = None, act_group: int | None = None) -> torch.Tensor:
    """linear(rms_norm(x[T,D], w[D]), proj[N,D]) -> [T,N]."""
    return project(rms_norm(x, w, eps=eps), proj, group_size, act_group)


@decomposition("rms_norm_linear")
def _rms_norm_linear_decomp(x, w, *proj, eps, group_size=None, act_group=None):
    from ..frontend import ops

    return _project_decomp(ops.rms_norm(x, w, eps=eps), proj, group_size, act_group)


def _add_rms_norm_linear_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, res, w, *proj = types
    expect(x == res and w.shape == (x.shape[-1],), f"add_rms_norm_linear operands {x}, {res}, {w} differ")
    return [x, _proj(x, proj, attrs)]


@register("add_rms_norm_linear", _add_rms_norm_linear_type)
def add_rms_norm_linear(x, res, w, *proj, eps: float, group_size: int | None = None,
                        act_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, linear(rms_norm(s, w), proj)) with s = x + res."""
    s = x + res
    return s, project(rms_norm(s, w, eps=eps), proj, group_size, act_group)


@decomposition("add_rms_norm_linear")
def _add_rms_norm_linear_decomp(x, res, w, *proj, eps, group_size=None, act_group=None):
    from ..frontend import ops

    s, normed = ops.add_rms_norm(x, res, w, eps=eps)
    return s, _project_decomp(normed, proj, group_size, act_group)


def _swiglu_linear_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, *proj = types
    expect(isinstance(x.shape[-1], int) and x.shape[-1] % 2 == 0, f"swiglu_linear: {x} is not [T, 2I]")
    return [_proj(x.with_shape(x.shape[0], x.shape[-1] // 2), proj, attrs)]


@register("swiglu_linear", _swiglu_linear_type)
def swiglu_linear(x, *proj, group_size: int | None = None, act_group: int | None = None) -> torch.Tensor:
    """linear(swiglu(x[T,2I]), proj[N,I]) -> [T,N]."""
    return project(swiglu(x), proj, group_size, act_group)


@decomposition("swiglu_linear")
def _swiglu_linear_decomp(x, *proj, group_size=None, act_group=None):
    from ..frontend import ops

    return _project_decomp(ops.swiglu(x), proj, group_size, act_group)


def _qkv_rope_cache_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    qkv, pos, cache, slots, *norms = types
    sizes = attrs["sizes"]
    expect(not norms or (len(norms) == 2 and "qk_norm_eps" in attrs and all(w.shape == (attrs["head_dim"],)
                                                                             for w in norms)),
           f"qkv_rope_cache head norms must be two [{attrs['head_dim']}] weights with qk_norm_eps, got {norms}")
    expect(len(sizes) == 3 and qkv.shape[1] == sum(sizes), f"qkv_rope_cache sizes {sizes} do not split {qkv}")
    check_kv_cache(cache, qkv.dtype, sizes[1] // attrs["head_dim"], attrs["head_dim"])
    return [qkv.with_shape(qkv.shape[0], s) for s in sizes]


@register("qkv_rope_cache", _qkv_rope_cache_type, side_effect=True)
def qkv_rope_cache(qkv, positions, kv_cache, slot_mapping, *norms, sizes: list[int], head_dim: int,
                   theta: float, qk_norm_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv[T,Q+K+V] -> (rope(q), rope(k), v); writes rope(k) and v into kv_cache at slot_mapping.
    norms (q_norm[hd], k_norm[hd]): each head of q and k is RMS-normalised first."""
    q, k, v = (t.contiguous() for t in torch.split(qkv, sizes, dim=-1))
    if norms:
        q = head_rms_norm(q, norms[0], eps=qk_norm_eps, head_dim=head_dim)
        k = head_rms_norm(k, norms[1], eps=qk_norm_eps, head_dim=head_dim)
    q, k = rope(q, positions, head_dim=head_dim, theta=theta), rope(k, positions, head_dim=head_dim, theta=theta)
    write_kv(kv_cache, k, v, slot_mapping)
    return q, k, v


ATTENTION_ATTRS = ("num_heads", "num_kv_heads", "head_dim", "scale", "window")


def split_extra(extra: list, normed: bool, sinks: bool) -> tuple[list, list]:
    """qkv_attention's inputs after the seventh -> ([q_norm, k_norm] or [], [sink_logits] or [])."""
    n = 2 if normed else 0
    return list(extra[:n]), list(extra[n:n + 1]) if sinks else []


def _qkv_attention_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    qkv, pos, cache, slots, tables, lens, qlens, *extra = types
    norms, sinks = split_extra(extra, "qk_norm_eps" in attrs, attrs.get("sinks", False))
    expect(len(norms) + len(sinks) == len(extra), f"qkv_attention has {len(extra)} extra inputs, expected "
                                                    f"{len(norms) + len(sinks)}")
    q, k, v = _qkv_rope_cache_type([qkv, pos, cache, slots, *norms], attrs)
    return OPS["attention"].infer([q, k, v, cache, slots, tables, lens, qlens, *sinks], attrs)


@register("qkv_attention", _qkv_attention_type, side_effect=True)
def qkv_attention(qkv, positions, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, *extra, sizes: list[int],
                  head_dim: int, theta: float, num_heads: int, num_kv_heads: int, scale: float,
                  window: int = 0, qk_norm_eps: float | None = None, sinks: bool = False) -> torch.Tensor:
    """qkv[T,Q+K+V] -> [T,H*hd]: split, (head norms,) RoPE on q and k, the paged KV-cache write, then
    attention (with sinks). extra: q_norm, k_norm when qk_norm_eps is set, then sink_logits when sinks."""
    norms, sink = split_extra(extra, qk_norm_eps is not None, sinks)
    q, k, v = qkv_rope_cache(qkv, positions, kv_cache, slot_mapping, *norms, sizes=sizes, head_dim=head_dim, theta=theta,
                             qk_norm_eps=qk_norm_eps)
    return attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, *sink, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, window=window, write_kv=False,
                     sinks=sinks)


@decomposition("qkv_attention")
def _qkv_attention_decomp(qkv, positions, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, *extra, sizes,
                          head_dim, theta, num_heads, num_kv_heads, scale, window=0, qk_norm_eps=None, sinks=False):
    from ..frontend import ops

    norms, sink = split_extra(extra, qk_norm_eps is not None, sinks)
    q, k, v = ops.qkv_rope_cache(qkv, positions, kv_cache, slot_mapping, *norms, sizes=sizes, head_dim=head_dim,
                                 theta=theta, qk_norm_eps=qk_norm_eps)
    return ops.attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, window=window, write_kv=False,
                         sinks=sink[0] if sink else None)
