"""CPU kernels: one factory per IR op, returning a callable bound to the node's attrs.

Each kernel computes the same function as the op's reference (deepfuse/ir/opdefs_*),
in fewer, larger torch calls: fused rms_norm, a precomputed rotary table, SDPA for
paged attention. Factories run once at load; the callables run every step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...ir import OPS
from ...ir.opdefs_llm import causal_mask, gather_kv, rope_cos_sin, write_kv

Kernel = Callable[..., Any]
FACTORIES: dict[str, Callable[[dict], Kernel]] = {}


def factory(op: str) -> Callable:
    def wrap(fn: Callable[[dict], Kernel]) -> Callable[[dict], Kernel]:
        FACTORIES[op] = fn
        return fn

    return wrap


def make_kernel(op: str, attrs: dict) -> Kernel:
    """The CPU kernel for `op`; ops without a specialised kernel run their reference."""
    if op in FACTORIES:
        return FACTORIES[op](attrs)
    ref = OPS[op].reference
    return lambda *xs: ref(*xs, **attrs)


@factory("linear")
def _linear(attrs: dict) -> Kernel:
    return F.linear


def can_prepack() -> bool:
    return torch.backends.mkldnn.is_available()


def prepack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """w[N,K] in oneDNN's blocked layout, for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x[T,K] @ w^T with w prepacked by prepack_linear_weight -> [T,N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def last_rows(x: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
    """x[T,D] -> [S,D], each sequence's last row; no copy when every sequence has one row."""
    return x if x.shape[0] == query_lens.shape[0] else x.index_select(0, query_lens.cumsum(0) - 1)


def packed_logits(x: torch.Tensor, packed: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
    return packed_linear(last_rows(x, query_lens), packed).float()


PACKED_KERNELS = {"linear": packed_linear, "logits": packed_logits}


@factory("embedding")
def _embedding(attrs: dict) -> Kernel:
    return lambda table, ids: F.embedding(ids, table)


@factory("add")
def _add(attrs: dict) -> Kernel:
    return torch.add


@factory("split")
def _split(attrs: dict) -> Kernel:
    sizes, axis = attrs["sizes"], attrs.get("axis", -1)
    return lambda x: torch.split(x, sizes, dim=axis)  # views: consumers accept strided input


@factory("swiglu")
def _swiglu(attrs: dict) -> Kernel:
    def swiglu(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    return swiglu


@factory("rms_norm")
def _rms_norm(attrs: dict) -> Kernel:
    eps = attrs["eps"]
    return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)  # accumulates in fp32 for bf16/f16


class RopeTables:
    """cos and sign-folded sin rows for the step's positions, shared by every rope launch
    of one step (all layers see the same positions tensor)."""

    def __init__(self, head_dim: int, theta: float):
        self.hd, self.theta = head_dim, theta
        self.full: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last: tuple[torch.Tensor, torch.dtype, tuple[torch.Tensor, torch.Tensor]] | None = None

    def rows(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.last is not None and self.last[0] is pos and self.last[1] == dtype:
            return self.last[2]
        full = self.full.get(dtype)
        top = int(pos.max())
        if full is None or full[0].shape[0] <= top:
            cos, sin = rope_cos_sin(torch.arange(max(4096, 2 * top + 1)), self.hd, self.theta)
            # rotate_half(x) * sin == swap_halves(x) * [-sin | sin]
            sin = torch.cat((-sin[:, : self.hd // 2], sin[:, self.hd // 2:]), dim=-1)
            full = self.full[dtype] = (cos.to(dtype), sin.to(dtype))
        rows = (full[0][pos][:, None, :], full[1][pos][:, None, :])
        self.last = (pos, dtype, rows)
        return rows


_ROPE_TABLES: dict[tuple[int, float], RopeTables] = {}


@factory("rope")
def _rope(attrs: dict) -> Kernel:
    hd = attrs["head_dim"]
    tables = _ROPE_TABLES.setdefault((hd, attrs["theta"]), RopeTables(hd, attrs["theta"]))

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = tables.rows(pos, x.dtype)
        t = x.shape[0]
        h = x.reshape(t, -1, hd)
        swapped = torch.cat((h[..., hd // 2:], h[..., : hd // 2]), dim=-1)
        return torch.addcmul(h * cos, swapped, sin).reshape(t, -1)

    return rope


@factory("attention")
def _attention(attrs: dict) -> Kernel:
    h, hkv, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    scale, window, group = attrs["scale"], attrs.get("window", 0), attrs["num_heads"] // attrs["num_kv_heads"]

    def decode_one(q1: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """One query row [H*hd] over keys/vals [L,Hkv,hd]: grouped bmm in fp32 (CPU bf16
        bmm at these sizes is ~4x slower than converting and using fp32)."""
        qg = q1.view(hkv, group, hd).float()
        scores = torch.bmm(qg, keys.float().permute(1, 2, 0)).mul_(scale)
        return torch.bmm(scores.softmax(-1), vals.float().transpose(0, 1)).reshape(h * hd)

    def attention(q, k, v, cache, slots, tables, seq_lens, query_lens):
        write_kv(cache, k, v, slots)
        lens, qlens = seq_lens.tolist(), query_lens.tolist()
        out = torch.empty(q.shape, dtype=q.dtype)
        a = 0
        for s, (length, n) in enumerate(zip(lens, qlens)):
            if n == 0:
                continue
            first = max(0, length - window) if (n == 1 and window) else 0
            keys, vals = gather_kv(cache, tables[s], length)
            if n == 1:
                out[a] = decode_one(q[a], keys[first:], vals[first:])
            else:
                qs = q[a:a + n].reshape(n, h, hd).transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, keys.transpose(0, 1), vals.transpose(0, 1),
                                                   attn_mask=causal_mask(n, length, window), scale=scale,
                                                   enable_gqa=h != hkv)
                out[a:a + n] = o.transpose(0, 1).reshape(n, h * hd)
            a += n
        return out

    return attention


@factory("logits")
def _logits(attrs: dict) -> Kernel:
    def logits(x: torch.Tensor, w: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
        return F.linear(last_rows(x, query_lens), w).float()

    return logits


@factory("sample")
def _sample(attrs: dict) -> Kernel:
    ref = OPS["sample"].reference

    def sample(logits, temperature, top_k, top_p, seeds):
        if not bool((temperature > 0).any()):
            return logits.argmax(-1)
        return ref(logits, temperature, top_k, top_p, seeds)

    return sample
