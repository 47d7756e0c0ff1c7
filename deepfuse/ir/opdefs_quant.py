"""Weight-only quantized ops: 4-bit weights in groups along K with a scale and a minimum.

Format (the same as GGUF's Q4_1, so Q4_1 weights round-trip exactly in f32):
    w[n, k] = scales[n, k // G] * q[n, k] + mins[n, k // G],   q in 0..15
    packed u8[N, K/2]: byte j of a row holds q[2j] in its low nibble, q[2j+1] in its high one
    scales, mins f32[N, K/G]
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
    as a dense weight of that dtype would be."""
    return F.linear(x, dequantize_q4(packed, scales, mins).to(x.dtype))
