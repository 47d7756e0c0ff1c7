"""The `sample` op's draw, defined so every target's kernel computes the same tokens.

A sampled row (temperature T > 0) of logits x[V] f32:
  z_v = x_v / T                              (f32, a true, correctly rounded division)
  top-k (0 < k < V): keep z_v >= z_(k), the k-th largest z, found exactly by bisection over
        key(z) = the order-preserving u32 image of z's bits (negative: all bits flipped, else
        the sign bit set; -0.0 ranks just below +0.0); 32 steps, each a count of key >= c.
        Ties with z_(k) are kept. k <= 0 or k >= V keeps every token.
  top-p (top_p < 1): over p_v = exp(z_v - max z) of the kept tokens (0 elsewhere),
        total = sum p; keep the tokens with bits(p_v) >= t, t the largest 31-bit value with
        mass(t) = sum of kept p_v with bits(p_v) >= t > 0 and mass(t) >= top_p * total
        (bits(p) orders p >= 0; equal p are kept or dropped together; at least the largest p is
        kept). Bisected over t's 31 bits, each step a masked sum.
  draw: Gumbel-max, the first v maximizing z_v + g_v over the kept tokens, g_v = -log(-log(u_v)),
        u_v = (2 * (h_v >> 9) + 1) * 2^-24 in (0, 1) (exact in f32),
        h_v = fmix32(key ^ (v * 0x9E3779B1)), key = fmix32(fmix32(lo) ^ hi),
        lo/hi: the low/high 32 bits of the row's seed, fmix32: murmur3's finalizer;
        all arithmetic mod 2^32 (u32 multiply, xor, logical shift).
A greedy row (T == 0) is the first maximum of x. A NaN logit counts as -inf everywhere (the
`sample` op replaces it before either rule), so it is never chosen unless its whole row is NaN.
Targets agree exactly up to float rounding of log/exp and of the top-p sums (a token's choice
can differ only where two scores, or the top-p mass and its target, are within a few ulps).
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer over int64 tensors holding u32 values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def row_key(seeds: torch.Tensor) -> torch.Tensor:
    """seeds i64[S] -> u32 keys (as i64) [S]: fmix32(fmix32(lo) ^ hi)."""
    lo, hi = seeds & M32, (seeds >> 32) & M32
    return fmix32(fmix32(lo) ^ hi)


def uniforms(seeds: torch.Tensor, v: int) -> torch.Tensor:
    """u f32[S, V] in (0, 1): u_v = (2 * (h_v >> 9) + 1) * 2^-24, h_v = fmix32(key ^ (v * GOLDEN))."""
    ids = (torch.arange(v, dtype=torch.int64) * GOLDEN) & M32
    h = fmix32(row_key(seeds)[:, None] ^ ids[None, :])
    return (((h >> 9) << 1) | 1).float() * 2.0 ** -24


def order_key(z: torch.Tensor) -> torch.Tensor:
    """The order-preserving u32 image of f32 z's bits, as i64 (same shape)."""
    b = z.contiguous().view(torch.int32).long() & M32
    return torch.where(b >= 2 ** 31, b ^ M32, b | 2 ** 31)


def top_k_mask(z: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """z f32[S,V], top_k i64[S] -> bool[S,V]: key(z) >= the key of the row's k-th largest z. The
    kernels bisect for that key (32 steps of a count); here topk over the keys finds the same
    one, for the rows that filter (0 < k < V) only."""
    v = z.shape[1]
    mask = torch.ones_like(z, dtype=torch.bool)
    rows = torch.nonzero((top_k > 0) & (top_k < v)).flatten()
    if rows.numel():
        key = order_key(z[rows])
        k = top_k[rows]
        kth = key.topk(int(k.max()), -1).values.gather(1, (k - 1)[:, None])
        mask[rows] = key >= kth
    return mask


def top_p_mask(z: torch.Tensor, kept: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """kept after top-p (see the module docstring); rows with top_p >= 1 unchanged (and not
    computed). The masses here are prefix sums of p in descending order (the kernels' are masked
    sums over tiles: the same sets but for float rounding at a boundary)."""
    rows = torch.nonzero(top_p < 1).flatten()
    if rows.numel() == 0:
        return kept
    zr, kr = z[rows], kept[rows]
    m = zr.masked_fill(~kr, float("-inf")).amax(-1, keepdim=True)
    p = torch.where(kr, torch.exp(zr - m), torch.zeros_like(zr))
    bits = p.view(torch.int32)
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    mass = sorted_p.cumsum(-1)
    # the total as the prefix sums reach it (p.sum's own order could put it out of their reach with
    # top_p just under 1, and depends on the batch's layout)
    target = top_p[rows, None] * mass[:, -1:]
    first = ((mass >= target) & (mass > 0)).int().argmax(-1, keepdim=True)  # the first token that reaches it
    t = bits.gather(1, order.gather(1, first))
    out = kept.clone()
    out[rows] = kr & (bits >= t)
    return out


G_MAX = 17.0  # above every g = -log(-log(u)) for u <= 1 - 2^-24 (16.64), with room for f32 rounding


def gumbel_at(keys: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """g f32 of token v under row key `keys` (both i64 [n]): -log(-log(u_v))."""
    h = fmix32(keys ^ ((v * GOLDEN) & M32))
    u = (((h >> 9) << 1) | 1).float() * 2.0 ** -24
    return -torch.log(-torch.log(u))


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         seeds: torch.Tensor) -> torch.Tensor:
    """Tokens i64[S] of sampled rows (all temperature > 0): the module docstring's draw."""
    z = logits.float() / temperature.float()[:, None]
    kept = top_p_mask(z, top_k_mask(z, top_k), top_p.float())
    zk = z.masked_fill(~kept, float("-inf"))
    # only tokens that could beat the best-z token's own score need their noise: z_v + G_MAX
    # must reach it (exact: every other score is below it)
    keys, best = row_key(seeds), zk.argmax(-1)
    floor = zk.gather(1, best[:, None]).squeeze(1) + gumbel_at(keys, best) - G_MAX - 1.0
    r, c = torch.nonzero(zk >= floor[:, None], as_tuple=True)
    score = torch.full_like(z, float("-inf"))
    score[r, c] = zk[r, c] + gumbel_at(keys[r], c)
    return score.argmax(-1)
