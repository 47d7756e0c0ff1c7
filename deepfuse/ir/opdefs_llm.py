"""LLM semantic ops: rms_norm, add_rms_norm, rope, paged attention, take_rows, logits, sample.

Shapes: T tokens in the step, S sequences, H/Hkv query/kv heads, hd head dim,
N cache blocks, BS block size, B max blocks per sequence, V vocab.
The step's tokens are grouped by sequence: sequence s owns rows
query_lens[s] consecutive rows after those of earlier sequences, and those rows are its *last* tokens, so
their positions are seq_lens[s]-n .. seq_lens[s]-1.
"""
from __future__ import annotations

import torch

from .ops import decomposition, expect, register
from .sampling import draw
from .types import TensorType


def _rms_norm_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, w = types
    expect(w.rank == 1 and x.shape[-1] == w.shape[0], f"rms_norm weight {w} does not fit {x}")
    return [x]


@register("rms_norm", _rms_norm_type)
def rms_norm(x: torch.Tensor, w: torch.Tensor, *, eps: float) -> torch.Tensor:
    """x[T,D] / rms(x) * w[D], computed in fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _add_rms_norm_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, res, w = types
    expect(x == res, f"add_rms_norm operands differ: {x} vs {res}")
    expect(w.rank == 1 and x.shape[-1] == w.shape[0], f"add_rms_norm weight {w} does not fit {x}")
    return [x, x]


@register("add_rms_norm", _add_rms_norm_type)
def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, *, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual step of a pre-norm block: s = x + res; returns (s, rms_norm(s, w))."""
    s = x + res
    return s, rms_norm(s, w, eps=eps)


@decomposition("add_rms_norm")
def _add_rms_norm_decomp(x, res, w, *, eps):
    from ..frontend import ops

    s = ops.add(x, res)
    return s, ops.rms_norm(s, w, eps=eps)


def _rope_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, pos = types
    expect(x.rank == 2 and x.shape[1] % attrs["head_dim"] == 0, f"rope wants x[T,H*hd]; got {x}")
    expect(pos.rank == 1 and pos.dtype in ("i32", "i64"), f"rope positions must be integer [T]: {pos}")
    return [x]


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, hd] fp32 for the rotate-half convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@register("rope", _rope_type)
def rope(x: torch.Tensor, pos: torch.Tensor, *, head_dim: int, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) on every head of x[T,H*hd]."""
    t = x.shape[0]
    cos, sin = rope_cos_sin(pos, head_dim, theta)
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    h = x.view(t, -1, head_dim)
    x1, x2 = h[..., : head_dim // 2], h[..., head_dim // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (h * cos + rotated * sin).reshape(t, -1)


def _attention_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    q, k, v, cache, slots, tables, lens, qlens, *sinks = types
    h, hkv, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    if attrs.get("sinks"):
        expect(len(sinks) == 1 and sinks[0].shape == (h,) and sinks[0].dtype in ("f32", "bf16", "f16"),
               f"attention sinks must be one float [{h}] input, got {sinks}")
    else:
        expect(not sinks, f"attention takes 8 inputs without sinks=True, got {len(types)}")
    expect(q.shape[1:] == (h * hd,), f"attention q {q} does not match {h} heads of {hd}")
    expect(k.shape[1:] == (hkv * hd,) and v.shape[1:] == (hkv * hd,), f"attention k/v {k}, {v} do not match {hkv} kv heads")
    expect(h % hkv == 0, f"num_heads {h} not a multiple of num_kv_heads {hkv}")
    check_kv_cache(cache, k.dtype, hkv, hd)
    expect(tables.rank == 2 and lens.rank == 1 and qlens.rank == 1, "block_tables[S,B], seq_lens[S], query_lens[S] expected")
    return [q]


KV_SCALE_BYTES = 4  # an int8 cache row ends in the f32 scale of its head_dim values


def kv_row_size(head_dim: int, cache_dtype: str) -> int:
    """Elements of one (position, kv head) row of a cache: head_dim, plus the scale's 4 bytes in int8."""
    return head_dim + KV_SCALE_BYTES if cache_dtype == "i8" else head_dim


def check_kv_cache(cache: TensorType, dtype: str, hkv: int, hd: int) -> None:
    """A layer's cache is [2,N,BS,Hkv,hd] of the model's float dtype, or int8 rows
    [2,N,BS,Hkv,hd+4] (quantize_kv_rows)."""
    row = kv_row_size(hd, cache.dtype)
    expect(cache.rank == 5 and cache.shape[0] == 2 and cache.shape[3:] == (hkv, row),
           f"kv cache must be [2,N,BS,{hkv},{row}], got {cache}")
    expect(cache.dtype in (dtype, "i8"), f"kv cache dtype {cache.dtype} is neither k's {dtype} nor i8")


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows x[..., hd] (float) -> int8 [..., hd+4]: q = round(x * (127/amax)) (ties to even) and, in the
    last 4 bytes, the f32 scale amax/127, amax = max |x| of the row (a zero row: all zeros)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, (amax / 127).view(torch.int8)], -1)


def dequantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., hd+4] -> f32 [..., hd]: q * scale."""
    hd = rows.shape[-1] - KV_SCALE_BYTES
    return rows[..., :hd].float() * rows[..., hd:].contiguous().view(torch.float32)


def write_kv_rows(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes k/v rows [T, Hkv*hd] into cache[2,N,BS,Hkv,hd] at flat slots[T] (each in [0, N*BS));
    into an int8 cache as quantize_kv_rows of each head's row."""
    hkv, row = cache.shape[3], cache.shape[4]
    flat = cache.view(2, -1, hkv, row)
    for half, x in ((0, k), (1, v)):
        x = x.reshape(x.shape[0], hkv, -1)
        flat[half].index_copy_(0, slots, quantize_kv_rows(x) if cache.dtype == torch.int8 else x)


write_kv = write_kv_rows


def gather_kv(cache: torch.Tensor, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` cached k and v of one sequence: each [length, Hkv, hd] (f32 from an int8 cache)."""
    bs = cache.shape[2]
    blocks = table[: (length + bs - 1) // bs].long()
    kv = cache[:, blocks].reshape(2, -1, cache.shape[3], cache.shape[4])
    if cache.dtype == torch.int8:
        kv = dequantize_kv_rows(kv)
    return kv[0, :length], kv[1, :length]


def causal_mask(n_query: int, length: int, window: int) -> torch.Tensor:
    """[n_query, length] bool: query i (position length-n_query+i) may see key j."""
    qpos = torch.arange(length - n_query, length)[:, None]
    kpos = torch.arange(length)[None, :]
    mask = kpos <= qpos
    if window > 0:
        mask &= kpos > qpos - window
    return mask


@register("attention", _attention_type, side_effect=True)
def attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, sink_logits=None, *,
              num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0,
              write_kv: bool = True, sinks: bool = False):
    """Writes k/v into the paged cache, then causal (optionally sliding-window) GQA
    attention of each sequence's new queries over its cached keys. q[T,H*hd] -> [T,H*hd].
    write_kv=False: an earlier op of the step (qkv_rope_cache) has written them.
    sinks=True: sink_logits[H] f32 (gpt-oss's learned attention sinks) join each head's softmax
    as one more logit whose value is zero: p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i))."""
    if write_kv:
        write_kv_rows(kv_cache, k, v, slot_mapping)
    out = torch.zeros_like(q)
    group = num_heads // num_kv_heads
    ends = query_lens.cumsum(0).tolist()
    for s, length in enumerate(seq_lens.tolist()):
        a, b = ends[s] - int(query_lens[s]), ends[s]
        if b == a:
            continue
        keys, vals = gather_kv(kv_cache, block_tables[s], length)
        keys = keys.float().repeat_interleave(group, dim=1)
        vals = vals.float().repeat_interleave(group, dim=1)
        qs = q[a:b].float().view(b - a, num_heads, head_dim)
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        scores.masked_fill_(~causal_mask(b - a, length, window), float("-inf"))
        if sinks:
            column = sink_logits.float().view(num_heads, 1, 1).expand(num_heads, b - a, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        o = torch.einsum("hqk,khd->qhd", probs, vals)
        out[a:b] = o.reshape(b - a, -1).to(q.dtype)
    return out


def _take_rows_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, rows = types
    expect(rows.rank == 1 and rows.dtype in ("i32", "i64"), f"take_rows wants integer rows[R], got {rows}")
    return [x.with_shape(rows.shape[0], x.shape[1])]


@register("take_rows", _take_rows_type)
def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[T,D], rows[R] (strictly increasing) -> x[rows] [R,D]: the rows whose next token is sampled."""
    return x.index_select(0, rows)


def _logits_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, w, rows = types
    expect(x.shape[1] == w.shape[1], f"logits: hidden {x} does not fit head {w}")
    return [TensorType("f32", (rows.shape[0], w.shape[0]))]


@register("logits", _logits_type)
def logits(x: torch.Tensor, w: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
    """fp32 logits [R,V] of the sampled rows (each sequence's last token; the last k+1 of a
    sequence whose k draft tokens are verified): take_rows(x, sample_rows) @ w[V,D]^T."""
    return torch.nn.functional.linear(take_rows(x, sample_rows), w).float()


@decomposition("logits")
def _logits_decomp(x, w, sample_rows):
    from ..frontend import ops

    return ops.cast(ops.linear(ops.take_rows(x, sample_rows), w), dtype="f32")


def _sample_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    lg = types[0]
    expect(lg.rank == 2 and lg.dtype == "f32", f"sample wants f32 logits[S,V], got {lg}")
    return [TensorType("i64", (lg.shape[0],))]


@register("sample", _sample_type)
def sample(logits, temperature, top_k, top_p, seeds):
    """Next token per row of logits[S,V]: the first maximum where temperature == 0, else the
    counter-based draw of ir/sampling.py (temperature, exact top-k and top-p thresholds, Gumbel-max
    keyed by seeds[S] alone), which every target's kernel computes. A NaN logit counts as -inf."""
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    out = logits.argmax(-1)
    rows = torch.nonzero(temperature > 0).flatten()
    if rows.numel():
        out[rows] = draw(logits[rows], temperature[rows], top_k[rows], top_p[rows], seeds[rows])
    return out


def _spec_verify_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    tokens, drafts = types
    expect(tokens.rank == 1 and tokens.dtype == "i64" and drafts == tokens,
           f"spec_verify wants i64 tokens[R] and draft_tokens[R], got {tokens}, {drafts}")
    return [tokens]


@register("spec_verify", _spec_verify_type)
def spec_verify(tokens: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """Speculative verification in the step. tokens[R]: the target's token at each sample row;
    draft_tokens[R]: the draft the sequence's next sample row was fed (-1: the row is its
    sequence's last). -> tokens[R] with -1 at every row after its sequence's first rejected
    draft: each sequence keeps the tokens of its accepted drafts and the target's token after them.
    Greedy rows accept a draft equal to the argmax; sampled rows one equal to the draw keyed by
    (seed, position), which keeps the target's distribution for a drafter's single proposal."""
    r = tokens.shape[0]
    if r == 0:
        return tokens.clone()
    ends = draft_tokens < 0
    breaks = ends | (tokens != draft_tokens)  # no later row of this sequence is kept after row i
    before = torch.cumsum(breaks.long(), 0) - breaks.long()  # breaks in rows < i
    starts = torch.ones(r, dtype=torch.bool, device=tokens.device)
    starts[1:] = ends[:-1]
    first = torch.cummax(torch.where(starts, before, torch.zeros_like(before)), 0).values
    return torch.where(before == first, tokens, torch.full_like(tokens, -1))
