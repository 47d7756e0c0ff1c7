"""Expert parallelism by all_to_all: each rank routes its own share of the step's tokens, sends
every token to the ranks that hold its chosen experts, runs its experts on what it received and
sends the results back (the dispatch/combine of DeepEP, GShard), instead of every rank running
its experts on every token and all-reducing the sum (opdefs_shard.moe_experts).

Rank r of W owns the contiguous token rows r*Tr .. r*Tr+Tr-1 of the step, Tr = ceil(T/W); its
graph input `ep_rows` i64[Tr] lists them (-1 past the step's T: padding). Buffers have a fixed
capacity of Tr rows per destination rank (the worst case: all of a rank's tokens to one rank), so
every shape is static in Tr, as DeepEP's low-latency buffers are; unused rows are zero, their ids -1.

    gather_rows        x[T,...], rows[Tr] -> x[rows] [Tr,...], zeros for rows < 0
    moe_dispatch       route own tokens; per destination j: the tokens with an expert on j,
                       their weights and local expert ids there, their own row (slot)
    moe_local_experts  received x[W,Tr,D] -> this rank's experts' weighted sum per row [W,Tr,D]
    moe_combine        results back from each rank [W,Tr,D], slots[W,Tr] -> [1,Tr,D] per own token
    rows_to_tokens     [W,Tr,D] (every rank's rows, all-gathered) -> the step's [T,D]

Shapes: T tokens, Tr a rank's token rows, D hidden, E experts, El = E/W a rank's experts, k top_k.
"""
from __future__ import annotations

import torch

from ..errors import DeepfuseError
from .opdefs_moe import _check_routing, experts_reference, route
from .ops import expect, register
from .types import TensorType


def ep_rows(tokens: int, world: int, rank: int) -> torch.Tensor:
    """The `ep_rows` input of rank `rank` for a step of `tokens` rows: i64[ceil(T/W)]."""
    per = -(-tokens // world)
    rows = torch.arange(rank * per, rank * per + per, dtype=torch.int64)
    return torch.where(rows < tokens, rows, -1)


def with_ep_rows(inputs: dict[str, torch.Tensor], world: int, rank: int,
                 made: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A step's inputs plus rank `rank`'s `ep_rows` (for its T = len(inputs["tokens"])). made:
    the tensors made so far, by T, reused (the CPU step binds its inputs by address: codegen/cpu/bound.py)."""
    if "tokens" not in inputs:
        raise DeepfuseError("a rank whose MoE dispatches by all_to_all sizes its token rows by the step's "
                            "'tokens' input, which is missing")
    tokens = inputs["tokens"]
    t = tokens.shape[0]
    rows = made.get(t) if made is not None else None
    if rows is None or rows.device != tokens.device:
        rows = ep_rows(t, world, rank).to(tokens.device)
        if made is not None:
            made[t] = rows
    return {**inputs, "ep_rows": rows}


def _gather_rows_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, rows = types
    expect(x.rank >= 1 and rows.rank == 1 and rows.dtype == "i64", f"gather_rows wants x[T,...], i64 rows[Tr]; "
           f"got {x}, {rows}")
    return [x.with_shape(rows.shape[0], *x.shape[1:])]


@register("gather_rows", _gather_rows_type)
def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[T,...], rows[Tr] -> [Tr,...]: x[rows[i]], zeros where rows[i] < 0."""
    inside = rows >= 0
    out = x.index_select(0, torch.where(inside, rows, 0))
    return torch.where(inside.view(-1, *[1] * (x.dim() - 1)), out, 0)


def _dispatch_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, logits, rows, *bias = types
    w, e, k = attrs["world"], logits.shape[-1], attrs["top_k"]
    expect(x.rank == 2 and logits.rank == 2 and rows.rank == 1 and rows.dtype == "i64"
           and x.shape[0] == logits.shape[0] == rows.shape[0],
           f"moe_dispatch wants x[Tr,D], router_logits[Tr,E], i64 rows[Tr]; got {x}, {logits}, {rows}")
    expect(isinstance(e, int) and e % w == 0, f"moe_dispatch: {e} experts do not split over {w} ranks")
    expect(0 < k <= e and attrs.get("num_shared", 0) == 0, f"moe_dispatch: top_k {k} in [1, {e}], no shared experts")
    _check_routing(attrs, e, bias[0] if bias else None)
    tr = x.shape[0]
    return [x.with_shape(w, tr, x.shape[1]), TensorType("f32", (w, tr, k)), TensorType("i64", (w, tr, k)),
            TensorType("i64", (w, tr))]


@register("moe_dispatch", _dispatch_type)
def moe_dispatch(x, router_logits, rows, score_bias=None, *, world: int, top_k: int, renormalize: bool, **routing):
    """Routes the rank's tokens x[Tr,D] (rows[i] < 0: padding, sent nowhere) over all E experts;
    rank j holds experts j*El .. j*El+El-1. Block j of each output lists, in row order, the
    tokens with at least one expert on j: send[j] their x, weights[j] / ids[j] their k choices
    (ids local to j, -1 and weight 0 for experts elsewhere), slots[j] their row i; then padding
    (x 0, ids -1, slot -1). -> (send[W,Tr,D], weights f32[W,Tr,k], ids i64[W,Tr,k], slots i64[W,Tr])."""
    tr, d = x.shape
    weights, ids = route(router_logits, top_k, renormalize, score_bias, **routing)
    per = router_logits.shape[-1] // world
    send = x.new_zeros(world, tr, d)
    w_out = torch.zeros(world, tr, top_k, dtype=torch.float32, device=x.device)
    id_out = torch.full((world, tr, top_k), -1, dtype=torch.int64, device=x.device)
    slots = torch.full((world, tr), -1, dtype=torch.int64, device=x.device)
    for j in range(world):
        here = ids // per == j
        tok = torch.nonzero(here.any(1) & (rows >= 0)).flatten()
        n = tok.numel()
        send[j, :n] = x[tok]
        w_out[j, :n] = torch.where(here[tok], weights[tok], 0.0)
        id_out[j, :n] = torch.where(here[tok], ids[tok] - j * per, -1)
        slots[j, :n] = tok
    return send, w_out, id_out, slots


def _local_experts_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, w, ids, w13, w2 = types
    expect(x.rank == 3 and w.shape == ids.shape == (*x.shape[:2], w.shape[-1]) and ids.dtype == "i64",
           f"moe_local_experts wants x[W,Tr,D], weights[W,Tr,k], i64 ids[W,Tr,k]; got {x}, {w}, {ids}")
    expect(w13.rank == 3 and w2.rank == 3 and w13.shape[2] == x.shape[2] and
           w2.shape == (w13.shape[0], x.shape[2], w13.shape[1] // 2),
           f"moe_local_experts weights {w13}, {w2} do not fit {x}")
    return [x]


@register("moe_local_experts", _local_experts_type)
def moe_local_experts(x, weights, ids, w13, w2):
    """Received rows x[W,Tr,D] with their choices among this rank's El experts (ids in 0..El-1,
    -1: another rank's) -> sum of weight * SwiGLU expert per row [W,Tr,D] (0 for padding)."""
    w, tr, d = x.shape
    k = ids.shape[-1]
    return experts_reference(x.reshape(w * tr, d), weights.reshape(w * tr, k), ids.reshape(w * tr, k),
                             w13, w2).reshape(w, tr, d)


def _combine_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    parts, slots = types
    expect(parts.rank == 3 and slots.shape == parts.shape[:2] and slots.dtype == "i64",
           f"moe_combine wants parts[W,Tr,D], i64 slots[W,Tr]; got {parts}, {slots}")
    return [parts.with_shape(1, parts.shape[1], parts.shape[2])]


@register("moe_combine", _combine_type)
def moe_combine(parts, slots):
    """parts[j]: rank j's results for the rows this rank sent it, slots[j] their own rows (-1:
    none) -> [1,Tr,D]: each own row's sum over the ranks, added in rank order. The leading 1 is
    this rank's block of the all_gather(dim=0) that follows ([W,Tr,D])."""
    out = parts.new_zeros(parts.shape[1:])
    for j in range(parts.shape[0]):
        keep = slots[j] >= 0
        out.index_add_(0, slots[j][keep], parts[j][keep])
    return out[None]


def _rows_to_tokens_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    y, like = types
    expect(y.rank == 3 and like.rank == 2 and y.shape[2] == like.shape[1],
           f"rows_to_tokens wants y[W,Tr,D] and a [T,D] to size it by; got {y}, {like}")
    return [y.with_shape(like.shape[0], y.shape[2])]


@register("rows_to_tokens", _rows_to_tokens_type)
def rows_to_tokens(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Every rank's rows y[W,Tr,D] (rank r's rows are tokens r*Tr..) -> the step's tokens [T,D],
    T = like.shape[0] (only its shape is read)."""
    return y.reshape(-1, y.shape[2])[: like.shape[0]].contiguous()
