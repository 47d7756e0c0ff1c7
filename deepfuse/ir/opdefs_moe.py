"""Mixture-of-experts ops, and the per-head norm of Qwen3-style attention.

Shapes: T tokens, D hidden, E experts, I expert intermediate size, k experts per token.
Expert weights are stacked: w13[E,2I,D] holds each expert's [gate | up] projection,
w2[E,D,I] its down projection (transformers' fused-experts layout).

    moe        router logits given: the semantic op a model emits
    fused_moe  router matmul included: what fuse_moe makes of linear(x, Wr) + moe
    moe_routing, expert_weight, scale_by_column: the pieces of moe's dense decomposition
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import decomposition, expect, register
from .types import TensorType


def _head_rms_norm_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, w = types
    hd = attrs["head_dim"]
    expect(x.rank == 2 and isinstance(x.shape[1], int) and x.shape[1] % hd == 0, f"head_rms_norm wants x[T,H*{hd}], got {x}")
    expect(w.shape == (hd,), f"head_rms_norm weight must be [{hd}], got {w}")
    return [x]


@register("head_rms_norm", _head_rms_norm_type)
def head_rms_norm(x: torch.Tensor, w: torch.Tensor, *, eps: float, head_dim: int) -> torch.Tensor:
    """RMSNorm of every head of x[T,H*hd] over its hd features, in fp32, times w[hd]."""
    t = x.shape[0]
    h = x.view(t, -1, head_dim).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w * h.to(x.dtype)).reshape(t, -1)


ROUTING_DEFAULTS = {"scoring": "softmax", "routed_scaling": 1.0, "n_group": 1, "topk_group": 1, "num_shared": 0}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, score_bias: torch.Tensor | None = None, *,
          scoring: str = "softmax", routed_scaling: float = 1.0, n_group: int = 1,
          topk_group: int = 1, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice per token -> (weights f32[T,k], ids[T,k]), in fp32.

    softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3) scores; experts are chosen by
    score + score_bias (the correction bias, which does not enter the weights), only
    within the topk_group best of n_group groups (a group ranks by its two best scores);
    weights are the chosen scores, optionally renormalised, times routed_scaling. num_shared
    always-on experts (numbered after the E routed ones) join every token with weight 1."""
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias.float()
    if n_group > 1:
        t, e = choice.shape
        group_best = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_best).scatter_(1, group_best.topk(topk_group, dim=-1)[1], 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling
    if num_shared:
        t, e = scores.shape
        ids = torch.cat((ids, torch.arange(e, e + num_shared, device=ids.device).expand(t, num_shared)), dim=1)
        weights = torch.cat((weights, torch.ones(t, num_shared, device=weights.device)), dim=1)
    return weights, ids


def routing_attrs(attrs: dict) -> dict:
    """The routing attributes of a moe / fused_moe / moe_routing node, defaults filled in."""
    return {k: attrs.get(k, v) for k, v in ROUTING_DEFAULTS.items()}


def _check_routing(attrs: dict, e: int, bias: TensorType | None) -> None:
    r = routing_attrs(attrs)
    expect(r["scoring"] in ("softmax", "sigmoid"), f"moe scoring must be softmax or sigmoid, got {r['scoring']!r}")
    expect(e % r["n_group"] == 0 and 0 < r["topk_group"] <= r["n_group"], f"moe groups {r['n_group']}/{r['topk_group']} "
           f"do not fit {e} experts")
    expect(bias is None or bias.shape == (e,), f"moe score bias must be [{e}], got {bias}")


def _moe_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, router, w13, w2, *bias = types
    expect(x.rank == 2 and w13.rank == 3 and w2.rank == 3, f"moe wants x[T,D], w13[E,2I,D], w2[E,D,I]; got {x}, {w13}, {w2}")
    n, two_i, d = w13.shape
    e = n - attrs.get("num_shared", 0)
    expect(x.shape[1] == d and w2.shape == (n, d, two_i // 2), f"moe expert weights {w13}, {w2} do not fit {x}")
    expect(router.shape[-1] == e, f"moe router {router} does not have {e} routed experts")
    expect(0 < attrs["top_k"] <= e, f"moe top_k {attrs['top_k']} not in [1, {e}]")
    _check_routing(attrs, e, bias[0] if bias else None)
    return [x]


def experts_reference(x, weights, ids, w13, w2):
    """sum over the k chosen experts of weight * down(silu(gate(x)) * up(x)), one expert at a time."""
    out = torch.zeros_like(x)
    w = weights.to(x.dtype)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * w[tok, slot, None]
        out.index_add_(0, tok, y)
    return out


@register("moe", _moe_type)
def moe(x, router_logits, w13, w2, score_bias=None, *, top_k: int, renormalize: bool, **routing) -> torch.Tensor:
    """Top-k routed SwiGLU experts: x[T,D], router_logits[T,E] (, score_bias[E]) -> [T,D].
    Routing attrs: scoring, routed_scaling, n_group, topk_group (see route())."""
    weights, ids = route(router_logits, top_k, renormalize, score_bias, **routing)
    return experts_reference(x, weights, ids, w13, w2)


def _fused_moe_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, router_w, w13, w2, *bias = types
    expect(router_w.rank == 2 and router_w.shape[1] == x.shape[1], f"fused_moe router {router_w} does not fit {x}")
    return _moe_type([x, x.with_shape(x.shape[0], router_w.shape[0]), w13, w2, *bias], attrs)


@register("fused_moe", _fused_moe_type)
def fused_moe(x, router_w, w13, w2, score_bias=None, *, top_k: int, renormalize: bool, **routing) -> torch.Tensor:
    """moe(x, x @ router_w[E,D]^T, ...): router, top-k, experts and combine in one op."""
    return moe(x, F.linear(x, router_w), w13, w2, score_bias, top_k=top_k, renormalize=renormalize, **routing)


def _routing_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    logits, *bias = types
    _check_routing(attrs, logits.shape[-1], bias[0] if bias else None)
    return [TensorType(attrs["dtype"], logits.shape)]


@register("moe_routing", _routing_type)
def moe_routing(router_logits, score_bias=None, *, top_k: int, renormalize: bool, dtype: str, **routing) -> torch.Tensor:
    """Dense routing weights [T,E] of the routed experts: the chosen ones' weights, 0 elsewhere."""
    from .types import DTYPES

    weights, ids = route(router_logits, top_k, renormalize, score_bias, **{**routing, "num_shared": 0})
    dense = torch.zeros(router_logits.shape, dtype=torch.float32, device=ids.device).scatter_(1, ids, weights)
    return dense.to(DTYPES[dtype])


def _append_experts_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    w13, w2, s13, s2 = types
    n, two_i, d = w13.shape
    shared_i = s2.shape[1]
    expect(s13.shape == (2 * shared_i, d) and s2.shape[0] == d and shared_i % (two_i // 2) == 0,
           f"shared expert {s13}, {s2} is not a multiple of experts {w13}")
    extra = shared_i // (two_i // 2)
    return [w13.with_shape(n + extra, two_i, d), w2.with_shape(n + extra, d, two_i // 2)]


@register("append_experts", _append_experts_type)
def append_experts(w13, w2, s13, s2) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared SwiGLU MLP (s13[2*Is,D] = [gate | up], s2[D,Is]) as Is/I more experts after
    w13[E,2I,D], w2[E,D,I]: SwiGLU acts per intermediate unit and the down projection sums
    over them, so slicing the intermediate dimension into experts of size I is exact."""
    i = w13.shape[1] // 2
    shared_i = s2.shape[1]
    gate, up = s13[:shared_i], s13[shared_i:]
    chunks = range(0, shared_i, i)
    extra13 = torch.stack([torch.cat((gate[j:j + i], up[j:j + i])) for j in chunks])
    extra2 = torch.stack([s2[:, j:j + i] for j in chunks])
    return torch.cat((w13, extra13)).contiguous(), torch.cat((w2, extra2)).contiguous()


def _expert_weight_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (w,) = types
    expect(0 <= attrs["index"] < w.shape[0], f"expert index {attrs['index']} out of range for {w}")
    return [w.with_shape(*w.shape[1:])]


@register("expert_weight", _expert_weight_type)
def expert_weight(w, *, index: int) -> torch.Tensor:
    """w[E,...] -> w[index] (a constant when w is a weight: fold_constants evaluates it)."""
    return w[index].contiguous()


def _scale_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    y, weights = types
    expect(y.dtype == weights.dtype and y.shape[0] == weights.shape[0], f"scale_by_column: {y} vs {weights}")
    return [y]


@register("scale_by_column", _scale_type)
def scale_by_column(y, weights, *, index: int) -> torch.Tensor:
    """y[T,D] * weights[T,index] (one routing column)."""
    return y * weights[:, index:index + 1]


@decomposition("moe")
def _moe_decomp(x, router_logits, w13, w2, score_bias=None, *, top_k, renormalize, **routing):
    """Dense: every expert on every token, scaled by its (mostly zero) routing weight."""
    from ..frontend import ops

    extra = [score_bias] if score_bias is not None else []
    weights = ops.moe_routing(router_logits, *extra, top_k=top_k, renormalize=renormalize, dtype=x.dtype, **routing)
    out, routed = None, router_logits.shape[-1]
    for e in range(w13.shape[0]):
        h = ops.swiglu(ops.linear(x, ops.expert_weight(w13, index=e)))
        y = ops.linear(h, ops.expert_weight(w2, index=e))
        y = ops.scale_by_column(y, weights, index=e) if e < routed else y  # shared experts: weight 1
        out = y if out is None else ops.add(out, y)
    return out


@decomposition("fused_moe")
def _fused_moe_decomp(x, router_w, w13, w2, score_bias=None, *, top_k, renormalize, **routing):
    from ..frontend import ops

    extra = [score_bias] if score_bias is not None else []
    return ops.moe(x, ops.linear(x, router_w), w13, w2, *extra, top_k=top_k, renormalize=renormalize, **routing)
