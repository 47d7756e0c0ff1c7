"""CPU kernels: one factory per IR op, returning a callable bound to the node's attrs.

Each kernel computes the same function as the op's reference (deepfuse/ir/opdefs_*),
in fewer, larger torch calls: fused rms_norm, a precomputed rotary table, SDPA for
paged attention. Factories run once at load; the callables run every step.
"""
from __future__ import annotations

from typing import Any, Callable

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

    def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    return rms_norm


@factory("rope")
def _rope(attrs: dict) -> Kernel:
    hd, theta = attrs["head_dim"], attrs["theta"]
    table: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cached = table.get(x.dtype)
        if cached is None or cached[0].shape[0] <= int(pos.max()):
            n = max(4096, 2 * int(pos.max()) + 1)
            cos, sin = rope_cos_sin(torch.arange(n), hd, theta)
            # sign-folded sin: rotate_half(x) * sin == x_swapped * [-sin | sin]
            sin = torch.cat((-sin[:, : hd // 2], sin[:, hd // 2:]), dim=-1)
            cached = table[x.dtype] = (cos.to(x.dtype), sin.to(x.dtype))
        t = x.shape[0]
        cos, sin = cached[0][pos][:, None, :], cached[1][pos][:, None, :]
        h = x.reshape(t, -1, hd)
        swapped = torch.cat((h[..., hd // 2:], h[..., : hd // 2]), dim=-1)
        return torch.addcmul(h * cos, swapped, sin).reshape(t, -1)

    return rope


@factory("attention")
def _attention(attrs: dict) -> Kernel:
    h, hkv, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    scale, window = attrs["scale"], attrs.get("window", 0)

    def attention(q, k, v, cache, slots, tables, seq_lens, query_lens):
        write_kv(cache, k, v, slots)
        lens, qlens = seq_lens.tolist(), query_lens.tolist()
        out = torch.empty(q.shape, dtype=q.dtype)
        a = 0
        for s, (length, n) in enumerate(zip(lens, qlens)):
            if n == 0:
                continue
            keys, vals = gather_kv(cache, tables[s], length)
            qs = q[a:a + n].reshape(n, h, hd).transpose(0, 1)
            mask = None if (n == 1 and (window == 0 or length <= window)) else causal_mask(n, length, window)
            o = F.scaled_dot_product_attention(qs, keys.transpose(0, 1), vals.transpose(0, 1),
                                               attn_mask=mask, scale=scale, enable_gqa=h != hkv)
            out[a:a + n] = o.transpose(0, 1).reshape(n, h * hd)
            a += n
        return out

    return attention


@factory("logits")
def _logits(attrs: dict) -> Kernel:
    def logits(x: torch.Tensor, w: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
        last = x if x.shape[0] == query_lens.shape[0] else x.index_select(0, query_lens.cumsum(0) - 1)
        return F.linear(last, w).float()

    return logits


@factory("sample")
def _sample(attrs: dict) -> Kernel:
    ref = OPS["sample"].reference

    def sample(logits, temperature, top_k, top_p, seeds):
        if not bool((temperature > 0).any()):
            return logits.argmax(-1)
        return ref(logits, temperature, top_k, top_p, seeds)

    return sample
