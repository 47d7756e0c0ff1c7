"""A rank's part of an op whose weight is split over the ranks: each gives a partial sum (the
full op's result is the sum over the ranks, an all_reduce away).

    vocab_embedding  rows of a vocabulary slice of the table; zero for tokens outside it
    moe_experts      routing over all experts, then only this rank's experts (expert parallelism)

Shapes: T tokens, D hidden, V/W a rank's vocabulary slice, E experts, El = E/W a rank's experts.
"""
from __future__ import annotations

import torch

from .opdefs_moe import _check_routing, experts_reference, route
from .ops import decomposition, expect, register
from .types import TensorType


def _vocab_embedding_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    table, ids = types
    expect(table.rank == 2 and ids.rank == 1 and ids.dtype in ("i32", "i64"),
           f"vocab_embedding wants table[V,D] and integer ids[T], got {table}, {ids}")
    expect(attrs["start"] >= 0, f"vocab_embedding start must be >= 0, got {attrs['start']}")
    return [table.with_shape(ids.shape[0], table.shape[1])]


@register("vocab_embedding", _vocab_embedding_type)
def vocab_embedding(table: torch.Tensor, ids: torch.Tensor, *, start: int) -> torch.Tensor:
    """table[Vr,D] holds rows start..start+Vr-1 of the full table; ids[T] -> [T,D]: the row of each
    id in that range, zeros for the others (summed over the ranks: the full embedding)."""
    local = ids.long() - start
    inside = (local >= 0) & (local < table.shape[0])
    rows = table.index_select(0, torch.where(inside, local, torch.zeros_like(local)))
    return rows * inside[:, None].to(rows.dtype)


def _moe_experts_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, router, w13, w2, *bias = types
    expect(x.rank == 2 and w13.rank == 3 and w2.rank == 3, f"moe_experts wants x[T,D], w13[El,2I,D], w2[El,D,I]; "
           f"got {x}, {w13}, {w2}")
    n, two_i, d = w13.shape
    e = router.shape[-1]
    expect(x.shape[1] == d and w2.shape == (n, d, two_i // 2), f"moe_experts weights {w13}, {w2} do not fit {x}")
    expect(0 <= attrs["first_expert"] and attrs["first_expert"] + n <= e,
           f"moe_experts experts {attrs['first_expert']}..+{n} outside the router's {e}")
    expect(0 < attrs["top_k"] <= e and attrs.get("num_shared", 0) == 0, "moe_experts: top_k in [1, E], no shared experts")
    _check_routing(attrs, e, bias[0] if bias else None)
    return [x]


@register("moe_experts", _moe_experts_type)
def moe_experts(x, router_logits, w13, w2, score_bias=None, *, top_k: int, renormalize: bool, first_expert: int,
                **routing) -> torch.Tensor:
    """moe's routing over all E experts of router_logits[T,E]; then only experts first_expert ..
    first_expert+El-1, whose weights are w13[El,2I,D], w2[El,D,I]: x[T,D] -> their share [T,D]."""
    weights, ids = route(router_logits, top_k, renormalize, score_bias, **routing)
    local = ids - first_expert  # experts of other ranks fall outside 0..El-1 and are skipped
    return experts_reference(x, weights, local, w13, w2)


@decomposition("moe_experts")
def _moe_experts_decomp(x, router_logits, w13, w2, score_bias=None, *, top_k, renormalize, first_expert, **routing):
    """Dense, as moe's: each local expert on every token, scaled by its routing column."""
    from ..frontend import ops

    extra = [score_bias] if score_bias is not None else []
    weights = ops.moe_routing(router_logits, *extra, top_k=top_k, renormalize=renormalize, dtype=x.dtype, **routing)
    out = None
    for e in range(w13.shape[0]):
        h = ops.swiglu(ops.linear(x, ops.expert_weight(w13, index=e)))
        y = ops.scale_by_column(ops.linear(h, ops.expert_weight(w2, index=e)), weights, index=first_expert + e)
        out = y if out is None else ops.add(out, y)
    return out
