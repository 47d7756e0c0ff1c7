"""Quantized projections.

linear_q4: weight-only, 4-bit weights in groups along K with a scale and a minimum (the same
format as GGUF's Q4_1, so Q4_1 weights round-trip exactly in f32):
    w[n, k] = scales[n, k // G] * q[n, k] + mins[n, k // G],   q in 0..15
    packed u8[N, K/2]: byte j of a row holds q[2j] in its low nibble, q[2j+1] in its high one
    scales, mins f32[N, K/G]

linear_w8a8: 8-bit weights and 8-bit activations (integer dot products: AVX512-VNNI,
AMX-INT8, the NPU's int8 cube). The weight has one scale per output row, stored offset binary:
    w[n, k] = (wq[n, k] - 128) * scale[n],   wq u8[N, K] in 1..255, scale f32[N]
Activations are quantized as the op runs, per row and per group of G (act_group) along K:
    d[t, g] = max|x[t, group g]| / 127,   q[t, k] = round(x[t, k] * 127 / max|x|) in -127..127
and the result is  scale[n] * sum over groups g (in order, f32) of d[t, g] * (exact integer dot
of q's and wq - 128's group g). Each row is quantized alone, so its result never depends on the
batch.

linear_q4a8: linear_q4's weights (groups of G along K, the scales and mins rounded to f16, as a
Q4_1 file stores them) times activations quantized per row and group of G, as linear_w8a8
quantizes them (llama.cpp's Q4_1 x Q8_1 dot product):
    y[t, n] = sum over groups g of  scale[n, g] * d[t, g] * (integer dot of q[n, group g] and the
              activation's group g) + min[n, g] * d[t, g] * sum(activation's group g)
which is exactly x_q[t] . w[n] with x_q = d * q, the activation as quantized. Each row is
quantized alone, so its result never depends on the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import expect, register
from .types import TensorType

Q4_LEVELS = 15


def quantize_q4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w[N,K] (K a multiple of group_size) -> (packed u8[N,K/2], scales f32[N,K/G], mins f32[N,K/G]).
    Per group: min and max of the group, 15 even steps between them, round to nearest."""
    n, k = w.shape
    groups = w.detach().to(torch.float64).reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = (hi - lo) / Q4_LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = ((groups - lo[..., None]) / safe[..., None]).round().clamp_(0, Q4_LEVELS).to(torch.uint8).reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), scales.float(), lo.float()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """packed u8[N,K/2] -> q u8[N,K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize_q4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """-> w f32[N,K]."""
    q = unpack_q4(packed).float()
    n, k = q.shape
    g = k // scales.shape[1]
    return (q.view(n, -1, g) * scales[..., None] + mins[..., None]).view(n, k)


def _linear_q4_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, packed, scales, mins = types
    g = attrs["group_size"]
    expect(x.rank == 2 and packed.rank == 2, f"linear_q4 wants x[T,K], packed[N,K/2]; got {x}, {packed}")
    expect(packed.dtype == "u8", f"linear_q4 packed weights must be u8, got {packed.dtype}")
    k, n = x.shape[1], packed.shape[0]
    expect(isinstance(k, int) and k % g == 0 and packed.shape[1] * 2 == k,
           f"linear_q4 K mismatch: x {x}, packed {packed}, group {g}")
    for t in (scales, mins):
        expect(t.dtype == "f32" and t.shape == (n, k // g), f"linear_q4 scales/mins must be f32[{n},{k // g}], got {t}")
    return [x.with_shape(x.shape[0], n)]


@register("linear_q4", _linear_q4_type)
def linear_q4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, *,
              group_size: int) -> torch.Tensor:
    """x[T,K] @ dequantize(packed, scales, mins)^T -> [T,N]; the weight is rounded to x's dtype first,
    as a dense weight of that dtype would be. A kernel may instead round each group's scale s and
    zero point m + 8s to x's dtype before dequantizing (the CPU target's torch int4 GEMM, used for
    bf16 steps of 1-3 rows, does): its weight error is then up to 2^-8 (|q - 8| |s| + |m + 8s|) in
    bf16 rather than 2^-8 |w| (tests/codegen/test_cpu_projections_float64.py bounds both)."""
    return F.linear(x, dequantize_q4(packed, scales, mins).to(x.dtype))


W8_ZERO = 128  # linear_w8a8's weight offset


def quantize_w8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w[N,K] -> (wq u8[N,K], scale f32[N]): per output row, symmetric, scale = max|w| / 127."""
    wf = w.detach().to(torch.float64)
    amax = wf.abs().amax(1)
    scale = amax / 127
    q = (wf / torch.where(amax > 0, scale, 1)[:, None]).round().clamp_(-127, 127)
    return (q + W8_ZERO).to(torch.uint8).contiguous(), scale.float()


def quantize_rows_i8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x[T,K] -> (q f32[T,K/G,G] integers in -127..127, d f32[T,K/G]), per row and group of K as
    linear_w8a8 quantizes its activations (in f32: q = round(x * (127 / max|x|)), ties to even)."""
    xf = x.float().reshape(x.shape[0], -1, group)
    amax = xf.abs().amax(-1)
    # a true f32 division (torch turns `127 / amax` into a reciprocal times 127, one unit off at times)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    return (xf * inv[..., None]).round().clamp_(-127, 127), amax.div(torch.full_like(amax, 127.0))


def _linear_w8a8_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, wq, scale = types
    g = attrs["act_group"]
    expect(x.rank == 2 and wq.rank == 2 and wq.dtype == "u8", f"linear_w8a8 wants x[T,K], wq u8[N,K]; got {x}, {wq}")
    k, n = x.shape[1], wq.shape[0]
    expect(isinstance(k, int) and wq.shape[1] == k and g % 16 == 0 and k % g == 0,
           f"linear_w8a8 K mismatch: x {x}, wq {wq}, act_group {g} (a multiple of 16 dividing K)")
    expect(scale.dtype == "f32" and scale.shape == (n,), f"linear_w8a8 scale must be f32[{n}], got {scale}")
    return [x.with_shape(x.shape[0], n)]


def w8a8_product(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, act_group: int) -> torch.Tensor:
    """x[T,K] (float) @ w^T with x quantized per row and group -> f32 [T,N]."""
    q, d = quantize_rows_i8(x, act_group)
    w = (wq.to(torch.float64) - W8_ZERO).view(wq.shape[0], -1, act_group)
    dots = torch.einsum("tgk,ngk->gtn", q.double(), w).float()  # exact integers (|dot| < 2^24 for G <= 1024)
    acc = torch.zeros(x.shape[0], wq.shape[0])
    for g in range(dots.shape[0]):
        acc = acc + dots[g] * d[:, g, None]
    return acc * scale


@register("linear_w8a8", _linear_w8a8_type)
def linear_w8a8(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, *, act_group: int) -> torch.Tensor:
    """x[T,K] (float) @ w^T with x quantized per row and group -> [T,N] in x's dtype."""
    return w8a8_product(x, wq, scale, act_group).to(x.dtype)


def _logits_w8a8_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    x, wq, scale, rows = types
    expect(rows.rank == 1 and rows.dtype in ("i32", "i64"), f"logits_w8a8 wants integer rows[R], got {rows}")
    _linear_w8a8_type([x, wq, scale], attrs)
    return [TensorType("f32", (rows.shape[0], wq.shape[0]))]


@register("logits_w8a8", _logits_w8a8_type)
def logits_w8a8(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, sample_rows: torch.Tensor, *,
                act_group: int) -> torch.Tensor:
    """The logits op over a W8A8 head: f32 [R,V] = x[sample_rows] @ w^T, the rows quantized as
    linear_w8a8 quantizes them (the sums stay f32: no rounding to x's dtype)."""
    return w8a8_product(x.index_select(0, sample_rows), wq, scale, act_group)


def _linear_q4a8_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    expect(attrs["group_size"] % 16 == 0, f"linear_q4a8 group_size must be a multiple of 16, got {attrs['group_size']}")
    return _linear_q4_type(types, attrs)


def q4a8_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """x[T,K] quantized per row and group, @ the int4 weight (scales, mins rounded to f16)^T -> f64 [T,N]."""
    q, d = quantize_rows_i8(x, group_size)
    xq = (q.double() * d.double()[..., None]).reshape(x.shape)
    w = unpack_q4(packed).double().view(packed.shape[0], -1, group_size)
    w = (w * scales.half().double()[..., None] + mins.half().double()[..., None]).view(packed.shape[0], -1)
    return xq @ w.T


@register("linear_q4a8", _linear_q4a8_type)
def linear_q4a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, *,
                group_size: int) -> torch.Tensor:
    """x[T,K] (float) quantized per row and group @ the int4 weight^T -> [T,N] in x's dtype."""
    return q4a8_product(x, packed, scales, mins, group_size).to(x.dtype)
