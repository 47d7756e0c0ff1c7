"""Projection weights packed at load for the CPU GEMMs, and the calls that multiply by them:
dense weights as native panels (f32, bf16 for AMX or AVX512-BF16) or in oneDNN's blocked layout;
int4 weights in torch's int4 layout for steps of a few rows and, for the rest, native int4 panels
or a dense copy."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ir.opdefs_quant import dequantize_q4, unpack_q4
from .native import kernels as native_kernels
from .q4a8_kernels import Q4A8Weights
from .w8a8_kernels import W8A8Weights


def can_prepack() -> bool:
    """Whether this torch has oneDNN (its blocked layout is the fallback for bf16 and f16 weights)."""
    return torch.backends.mkldnn.is_available()


class PanelWeight:
    """A projection w[N,K] packed at load for a native GEMM: f32 as 16-column panels
    [ceil(N/16),K,16] (panel_gemm.cpp: decode and verification steps read each weight about
    once), bf16 as VNNI panels for AMX tiles or AVX512-BF16 (bf16_gemm.cpp)."""

    def __init__(self, w: torch.Tensor, native):
        self.n = w.shape[0]
        if w.dtype == torch.float32:
            self.gemm, self.panels = native.panel_gemm, native.pack_panels(w.contiguous())
        else:
            self.gemm, self.panels = native.bf16_gemm, native.pack_vnni(w.contiguous())

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.gemm(x, self.panels, self.n, out)


def writes_in_place(packed) -> bool:
    """Whether a prepacked projection can write into a planned buffer (out_kernels): native
    panels, the f32 weight itself, or W8A8 weights of the native int8 GEMM; not oneDNN's layout."""
    if isinstance(packed, (W8A8Weights, Q4A8Weights)):
        return packed.native is not None
    if isinstance(packed, Q4Weights):  # the native int4 GEMM writes in place (others are copied)
        return isinstance(packed.dense, Q4Panels) or writes_in_place(packed.dense)
    return isinstance(packed, PanelWeight) or (isinstance(packed, torch.Tensor) and packed.dtype == torch.float32)


def prepack_linear_weight(w: torch.Tensor) -> torch.Tensor | PanelWeight:
    """w[N,K] packed for packed_linear: f32 as panels for the native kernel (unpacked where it
    cannot be built: MKL's GEMM then), bf16 as VNNI panels for the native kernel where this CPU
    has AMX or AVX512-BF16, else (and f16) in oneDNN's blocked layout."""
    native = native_kernels()
    if w.dtype == torch.float32:
        return PanelWeight(w, native) if native is not None else w
    if w.dtype == torch.bfloat16 and native is not None and native.bf16_gemm_available():
        return PanelWeight(w, native)
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor | PanelWeight) -> torch.Tensor:
    """x[T,K] @ w^T with w prepacked by prepack_linear_weight -> [T,N]."""
    if isinstance(packed, PanelWeight):
        return packed(x)
    if packed.dtype == torch.float32:
        return F.linear(x, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


# rows up to which torch's int4 GEMM beats the dense copy, measured over SmolLM2's 120 projections:
# against oneDNN it wins below 8 rows and ties at 8; against the native int4 GEMM it wins at 1-2
# rows and ties at 4 (AMX; on Zen 4's AVX512-BF16 path: 0.12 vs 0.19 ms at 1 row, 0.20 vs 0.21 at
# 4, 0.37 vs 0.29 at 8, over SmolLM2's four projection shapes)
INT4_MAX_ROWS, INT4_MAX_ROWS_NATIVE = 7, 3


def pack_q4_vnni(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    """An int4 weight (packed u8[N,K/2], groups of 32 along K: scales, mins [N,K/32]) as the
    native q4_gemm's tiles: nibbles u8[N/16,K/32,256] (a tile's 16 x 32 values in VNNI
    order: row r, column n, k = 2r + e at nibble 32r + 2n + e), scales and mins f32[N/16,K/32,16]."""
    q = unpack_q4(packed)
    n, k = q.shape
    nb, g, pad = -(-n // 16), k // 32, -n % 16
    t = F.pad(q, (0, 0, 0, pad)).view(nb, 16, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 512)
    nibbles = (t[..., 0::2] | (t[..., 1::2] << 4)).contiguous()
    per_tile = [F.pad(a.float(), (0, 0, 0, pad)).view(nb, 16, g).transpose(1, 2).contiguous() for a in (scales, mins)]
    return nibbles, *per_tile


class Q4Panels:
    """An int4 projection for the native bf16 GEMM (AMX or AVX512-BF16): dequantized a chunk at a
    time inside the GEMM, so no dense copy is kept."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, native):
        self.n, self.gemm = packed.shape[0], native.q4_gemm
        self.tiles = pack_q4_vnni(packed, scales, mins)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.gemm(x, *self.tiles, self.n, out)


class Q4Weights:
    """A linear_q4 weight, packed at load: torch's int4 layout (bf16 only) for decode-sized
    steps, and for the rest the native int4 GEMM (bf16 with AMX or AVX512-BF16, groups of 32) or
    a dense copy packed by prepack_linear_weight."""

    def __init__(self, dtype: torch.dtype, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 one_kernel: bool = False):
        """one_kernel: every row count through the dense-side kernel (native int4 or the dense copy),
        so a row's result never depends on how many rows share the call (batch invariance), at
        the cost of torch's faster int4 GEMM for steps of a few rows (not packed then)."""
        self.group = packed.shape[1] * 2 // scales.shape[1]
        native = native_kernels()
        if dtype == torch.bfloat16 and self.group == 32 and native is not None and native.bf16_gemm_available():
            self.dense = Q4Panels(packed, scales, mins, native)
            self.int4_rows = INT4_MAX_ROWS_NATIVE
        else:
            self.dense = prepack_linear_weight(dequantize_q4(packed, scales, mins).to(dtype))
            self.int4_rows = INT4_MAX_ROWS_NATIVE if isinstance(self.dense, PanelWeight) else INT4_MAX_ROWS
        self.int4 = None
        if one_kernel:
            self.int4_rows = 0
        elif dtype == torch.bfloat16 and packed.shape[0] % 16 == 0:  # torch's int4 layout tiles N by 16
            q = unpack_q4(packed).to(torch.int32)
            self.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # torch dequantizes (q - 8) * scale + zero; ours is q * scale + min
            self.scale_zero = torch.stack((scales, mins + 8 * scales), -1).transpose(0, 1).contiguous().to(dtype)


def q4_linear(x: torch.Tensor, w: Q4Weights, out: torch.Tensor | None = None) -> torch.Tensor:
    """x[T,K] @ w^T -> [T,N] (into out if given: the native GEMMs write there, torch's int4 GEMM
    and oneDNN's are copied)."""
    if w.int4 is not None and x.shape[0] <= w.int4_rows:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.int4, w.group, w.scale_zero)
    elif isinstance(w.dense, (Q4Panels, PanelWeight)):
        return w.dense(x, out)
    else:
        y = packed_linear(x, w.dense)
    return y if out is None else out.copy_(y)
