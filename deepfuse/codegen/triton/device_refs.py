"""Device stand-ins for IR references whose own code reads values back to the host.

A launch without a kernel runs its op's torch reference on the device (a host step). The paged
attention reference walks the sequences in Python (seq_lens.tolist()): on a GPU that waits for
the step and cannot be captured in a CUDA graph. Here the same attention is computed from the
inputs' shapes alone: each query attends over its sequence's whole table (B blocks of BS slots),
masked to its causal (and window) keys, a chunk of queries at a time; the results equal the
reference's up to float rounding (tests/runtime/test_graphed_decode.py). The IR references stay
the CPU ground truth; only the Triton runner uses these (runner.TritonRunner).
"""
from __future__ import annotations

import torch

from ...ir import OPS
from ...ir.opdefs_fused import qkv_rope_cache, split_extra
from ...ir.opdefs_llm import dequantize_kv_rows, write_kv_rows

CHUNK_ELEMENTS = 1 << 24  # gathered k and v elements of one chunk of queries


def attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, sink_logits=None, *,
              num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0,
              write_kv: bool = True, sinks: bool = False) -> torch.Tensor:
    """OPS["attention"].reference without a host read. q[T,H*hd] -> [T,H*hd]; block_tables [S,B],
    seq_lens and query_lens [S] (tokens grouped by sequence, in order, as the step lays them out)."""
    if write_kv:
        write_kv_rows(kv_cache, k, v, slot_mapping)
    t, (s, b), bs = q.shape[0], block_tables.shape, kv_cache.shape[2]
    dev = q.device
    seq = torch.repeat_interleave(torch.arange(s, device=dev), query_lens, output_size=t)  # each token's sequence
    first = torch.cumsum(query_lens, 0) - query_lens
    pos = (seq_lens - query_lens)[seq] + torch.arange(t, device=dev) - first[seq]  # each query's position
    kpos = torch.arange(b * bs, device=dev)
    group, out = num_heads // num_kv_heads, torch.empty_like(q)
    chunk = max(1, CHUNK_ELEMENTS // (2 * b * bs * kv_cache.shape[3] * kv_cache.shape[4]))
    for a in range(0, t, chunk):  # a bound from shapes: no value decides the loop
        rows = seq[a:a + chunk]
        n = rows.shape[0]
        kv = kv_cache[:, block_tables[rows].long()]  # [2, n, B, BS, Hkv, row]
        kv = kv.reshape(2, n, b * bs, kv_cache.shape[3], kv_cache.shape[4])
        kv = dequantize_kv_rows(kv) if kv_cache.dtype == torch.int8 else kv.float()
        keys, vals = kv[0].repeat_interleave(group, dim=2), kv[1].repeat_interleave(group, dim=2)
        qs = q[a:a + n].float().view(n, num_heads, head_dim)
        scores = torch.einsum("qhd,qkhd->qhk", qs, keys) * scale
        p = pos[a:a + n, None]
        seen = (kpos[None, :] <= p) & (kpos[None, :] < seq_lens[rows][:, None])
        if window > 0:
            seen &= kpos[None, :] > p - window
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        if sinks:
            column = sink_logits.float().view(1, num_heads, 1).expand(n, num_heads, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[a:a + n] = torch.einsum("qhk,qkhd->qhd", probs, vals).reshape(n, -1).to(q.dtype)
    return out


def qkv_attention(qkv, positions, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, *extra, sizes: list[int],
                  head_dim: int, theta: float, num_heads: int, num_kv_heads: int, scale: float,
                  window: int = 0, qk_norm_eps: float | None = None, sinks: bool = False) -> torch.Tensor:
    """OPS["qkv_attention"].reference with `attention` above."""
    norms, sink = split_extra(extra, qk_norm_eps is not None, sinks)
    q, k, v = qkv_rope_cache(qkv, positions, kv_cache, slot_mapping, *norms, sizes=sizes, head_dim=head_dim, theta=theta,
                             qk_norm_eps=qk_norm_eps)
    return attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, *sink, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, window=window, write_kv=False,
                     sinks=sinks)


DEVICE_REFERENCES = {"attention": attention, "qkv_attention": qkv_attention}


def reference(op: str):
    """What a launch of `op` without a kernel runs on the device."""
    return DEVICE_REFERENCES.get(op, OPS[op].reference)
