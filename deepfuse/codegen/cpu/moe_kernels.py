"""CPU kernels of the MoE ops: tokens sorted by expert, two grouped GEMMs (torch._grouped_mm)
and one weighted scatter-add: the one-process fused_moe (router inside), an expert-parallel rank's
moe_experts (its experts on every token that chose them) and moe_local_experts (on the rows other
ranks sent it, routed there by moe_dispatch)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...ir.opdefs_moe import route, routing_attrs


class ExpertWeights:
    """Expert weights packed at load, transposed for torch._grouped_mm: w13t [E,D,2I], w2t [E,I,D]."""

    def __init__(self, dtype: torch.dtype, w13: torch.Tensor, w2: torch.Tensor):
        self.w13t = w13.transpose(1, 2).contiguous()
        self.w2t = w2.transpose(1, 2).contiguous()


class MoeWeights(ExpertWeights):
    """fused_moe's weights: the router [E,D] and the experts."""

    def __init__(self, dtype: torch.dtype, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__(dtype, w13, w2)
        self.router = router


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """x[T,D], weights/ids [T,k] (ids < 0: no expert) -> [T,D]: per token, the sum over its
    choices of weight * down(silu(gate(x)) * up(x)), each expert's tokens in one GEMM."""
    e = w.w13t.shape[0]
    flat = ids.flatten()
    flat = torch.where(flat >= 0, flat, e)  # no expert: sorted past the last one and dropped
    counts = torch.bincount(flat, minlength=e + 1)
    order = torch.argsort(flat, stable=True)[: int(counts[:e].sum())]
    rows = order // ids.shape[1]  # the token of each sorted (token, choice) pair
    offs = counts[:e].cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x.index_select(0, rows), w.w13t, offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate).mul_(up), w.w2t, offs=offs)
    y = y * weights.flatten()[order].to(x.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, rows, y)


def make_fused_moe(attrs: dict) -> Callable:
    top_k, renorm, routing = attrs["top_k"], attrs["renormalize"], routing_attrs(attrs)

    def fused_moe(x: torch.Tensor, w: MoeWeights, score_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Router, top-k, grouped experts: x[T,D] -> [T,D] (shared experts among the ids)."""
        weights, ids = route(F.linear(x, w.router), top_k, renorm, score_bias, **routing)
        return grouped_experts(x, weights, ids, w)

    return fused_moe


def moe_local_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """Rows received from every rank x[W,Tr,D], their choices among this rank's experts
    weights/ids [W,Tr,k] (-1: elsewhere) -> [W,Tr,D]."""
    n, tr, d = x.shape
    k = ids.shape[-1]
    return grouped_experts(x.reshape(n * tr, d), weights.reshape(n * tr, k), ids.reshape(n * tr, k), w).view(n, tr, d)


def make_moe_experts(attrs: dict) -> Callable:
    top_k, renorm, first, routing = attrs["top_k"], attrs["renormalize"], attrs["first_expert"], routing_attrs(attrs)

    def moe_experts(x: torch.Tensor, router_logits: torch.Tensor, w: ExpertWeights,
                    score_bias: torch.Tensor | None = None) -> torch.Tensor:
        """An expert-parallel rank's share: routing over all experts, then its own El experts
        first .. first+El-1 on the tokens that chose them: x[T,D] -> [T,D]."""
        weights, ids = route(router_logits, top_k, renorm, score_bias, **routing)
        local = ids - first
        local = torch.where((local >= 0) & (local < w.w13t.shape[0]), local, -1)
        return grouped_experts(x, weights, local, w)

    return moe_experts
