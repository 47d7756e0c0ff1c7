"""CPU kernels: one factory per IR op, returning a callable bound to the node's attrs.

Each kernel computes the same function as the op's reference (deepfuse/ir/opdefs_*),
in fewer, larger torch calls: fused rms_norm, a precomputed rotary table, prepacked
projections (packed_weights.py), grouped-GEMM MoE; paged attention lives in attention.py.
Factories run once at load; the callables run every step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...ir import OPS
from ...ir.opdefs_fused import is_q4a8, split_extra
from ...ir.opdefs_llm import rope_cos_sin, write_kv
from .bound import Bound
from .generated_build import make_generated
from .moe_kernels import ExpertWeights, MoeWeights, make_fused_moe, make_moe_experts, moe_local_experts
from .packed_weights import PanelWeight, Q4Weights, packed_linear, prepack_linear_weight, q4_linear, writes_in_place
from .program import NativeGuard, RunOutput, aten_op, native_op, program_op
from .q4a8_kernels import Q4A8Weights, q4a8_linear, q4a8_norm_linear, q4a8_swiglu_linear
from .row_kernels import NORM_DTYPES, add_rms_rows, native_rows, rms_rows, swiglu_rows, take_rows
from .w8a8_kernels import W8A8Weights, w8a8_linear, w8a8_logits_kernel, w8a8_norm_linear, w8a8_swiglu_linear

Kernel = Callable[..., Any]
FACTORIES: dict[str, Callable[[dict], Kernel]] = {}


def factory(op: str, registry: dict[str, Callable[[dict], Kernel]] = FACTORIES) -> Callable:
    """Decorator: registers a kernel factory for `op` (in FACTORIES unless told otherwise)."""

    def wrap(fn: Callable[[dict], Kernel]) -> Callable[[dict], Kernel]:
        registry[op] = fn
        return fn

    return wrap


def make_kernel(op: str, attrs: dict) -> Kernel:
    """The CPU kernel for `op`; ops without a specialised kernel run their reference (so do
    fused ops over an int4 or W8A8 projection that was not prepacked: PREPACKED_Q4, PREPACKED_W8A8)."""
    if op in FACTORIES and "group_size" not in attrs and "act_group" not in attrs:
        return FACTORIES[op](attrs)
    ref = OPS[op].reference
    return lambda *xs: ref(*xs, **attrs)


@factory("linear")
def _linear(attrs: dict) -> Kernel:
    return F.linear


def packed_logits(x: torch.Tensor, packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return packed_linear(take_rows(x, rows), packed).float()


HALF = (torch.bfloat16, torch.float16)
@dataclass(frozen=True)
class Prepack:
    """Ops whose weight inputs (positions `weights`, params) are packed once at load into one
    object that the kernel `make(attrs)` returns takes in their place."""

    weights: tuple[int, ...]
    pack: Callable[..., Any]  # (dtype, *weight tensors) -> packed
    make: Callable[[dict], Kernel]
    dtypes: tuple[torch.dtype, ...]  # compute dtypes it pays off for


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


@factory("kernel")
def _kernel(attrs: dict) -> Kernel:
    """A generated kernel (deepfuse/kernel), compiled by generated_build.py."""
    return make_generated(attrs)


@factory("head_rms_norm")
def _head_rms_norm(attrs: dict) -> Kernel:
    eps, hd = attrs["eps"], attrs["head_dim"]
    return lambda x, w: F.rms_norm(x.view(x.shape[0], -1, hd), (hd,), w, eps).view(x.shape)


@factory("rms_norm")
def _rms_norm(attrs: dict) -> Kernel:
    eps = attrs["eps"]
    return lambda x, w: rms_rows(x, w, eps)


@factory("add_rms_norm")
def _add_rms_norm(attrs: dict) -> Kernel:
    eps = attrs["eps"]

    def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor):
        return add_rms_rows(x, res, w, eps)

    return add_rms_norm


@factory("swiglu")
def _swiglu(attrs: dict) -> Kernel:
    return swiglu_rows


def _norm_linear_kernels(lin: Kernel) -> dict[str, Callable[[dict], Kernel]]:
    """rms_norm_linear / add_rms_norm_linear factories over a projection `lin` (dense or packed)."""

    def rms_norm_linear(attrs: dict) -> Kernel:
        eps = attrs["eps"]
        return lambda x, w, proj: lin(rms_rows(x, w, eps), proj)

    def add_rms_norm_linear(attrs: dict) -> Kernel:
        add_norm = _add_rms_norm(attrs)

        def run(x, res, w, proj):
            s, normed = add_norm(x, res, w)
            return s, lin(normed, proj)

        return run

    return {"rms_norm_linear": rms_norm_linear, "add_rms_norm_linear": add_rms_norm_linear}


FACTORIES.update(_norm_linear_kernels(F.linear))


@factory("swiglu_linear")
def _swiglu_linear(attrs: dict) -> Kernel:
    return lambda x, proj: F.linear(swiglu_rows(x), proj)


def packed_swiglu_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return packed_linear(swiglu_rows(x), packed)


class RopeTables:
    """cos and sign-folded sin rows for the step's positions, shared by every rope launch
    of one step (all layers see the same positions tensor)."""

    def __init__(self, head_dim: int, theta: float):
        self.hd, self.theta = head_dim, theta
        self.full: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.last: dict[object, tuple[torch.Tensor, int, Any]] = {}  # per use: (pos, its version, found)

    def tables(self, top: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole cos and sign-folded sin tables [P, hd] with P > top (the native kernel takes f32 ones)."""
        full = self.full.get((dtype, device))
        if full is None or full[0].shape[0] <= top:
            cos, sin = rope_cos_sin(torch.arange(max(4096, 2 * top + 1)), self.hd, self.theta)
            # rotate_half(x) * sin == swap_halves(x) * [-sin | sin]
            sin = torch.cat((-sin[:, : self.hd // 2], sin[:, self.hd // 2:]), dim=-1)
            full = self.full[(dtype, device)] = (cos.to(device, dtype), sin.to(device, dtype))
        return full

    def per_step(self, pos: torch.Tensor, use: object, make: Callable[[], Any]) -> Any:
        """make() once for a step's positions tensor: every layer passes the same object (a fresh
        view each step), so it is made again only for another object or after a write to this
        one (its version counter moved); a step's 30 layers had each spent ~10 us on pos.max()."""
        last = self.last.get(use)
        if last is None or last[0] is not pos or last[1] != pos._version:
            last = self.last[use] = (pos, pos._version, make())
        return last[2]

    def rows(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [T, 1, hd] of pos [T]."""
        def make():
            full = self.tables(int(pos.max()), dtype, pos.device)
            return full[0][pos][:, None, :], full[1][pos][:, None, :]

        return self.per_step(pos, dtype, make)

    def native(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, pos as int64) for the native kernel: the whole f32 tables, grown past pos's largest."""
        return self.per_step(pos, "native", lambda: (*self.tables(int(pos.max()), torch.float32, pos.device),
                                                     pos.long()))


def rope_tables(head_dim: int, theta: float) -> RopeTables:
    """The process-wide tables for one (head size, theta): every layer's launches share them."""
    return _ROPE_TABLES.setdefault((head_dim, theta), RopeTables(head_dim, theta))


_ROPE_TABLES: dict[tuple[int, float], RopeTables] = {}


@factory("rope")
def _rope(attrs: dict) -> Kernel:
    hd = attrs["head_dim"]
    tables = rope_tables(hd, attrs["theta"])

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = tables.rows(pos, x.dtype)
        t = x.shape[0]
        h = x.reshape(t, -1, hd)
        swapped = torch.cat((h[..., hd // 2:], h[..., : hd // 2]), dim=-1)
        return torch.addcmul(h * cos, swapped, sin).reshape(t, -1)

    return rope


@factory("qkv_rope_cache")
def _qkv_rope_cache(attrs: dict) -> Kernel:
    sizes, hd = attrs["sizes"], attrs["head_dim"]
    rope = _rope({"head_dim": hd, "theta": attrs["theta"]})
    norm = _head_rms_norm({"eps": attrs["qk_norm_eps"], "head_dim": hd}) if "qk_norm_eps" in attrs else None

    tables = rope_tables(hd, attrs["theta"])

    def native_rope_cache(qkv, pos, cache, slots, *norms):
        """The native passes (norms.cpp, rows.cpp) where they apply, bound to these tensors and to
        q and k made here: (calls, q, k, v, cos), else None. With q and k norms (Gemma 3, Qwen3),
        each head's columns of qkv are normed in place first (qkv is this op's own input, read by
        nothing after it), one native rms_norm per head over its [T, hd] column block."""
        if qkv.dtype not in NORM_DTYPES or qkv.dim() != 2 or qkv.stride(1) != 1 or pos.device.type != "cpu" \
                or not cache.is_contiguous() or len(pos) == 0:
            return None
        if norms and any(w.dtype != qkv.dtype or w.dim() != 1 or w.shape[0] != hd or not w.is_contiguous()
                         for w in norms):
            return None
        native = native_rows()
        if native is None:
            return None
        calls = []
        for w, start, end in ((norms[0], 0, sizes[0]), (norms[1], sizes[0], sizes[0] + sizes[1])) if norms else ():
            for c in range(start, end, hd):
                head = qkv[:, c:c + hd]
                calls.append(native_op(native, "rms_norm", head, w, float(attrs["qk_norm_eps"]), head))
        cos, sin, pos64 = tables.native(pos)
        q = torch.empty(qkv.shape[0], sizes[0], dtype=qkv.dtype)
        k = torch.empty(qkv.shape[0], sizes[1], dtype=qkv.dtype)
        calls.append(native_op(native, "rope_cache", qkv, pos64, cos, sin, cache, slots.long(), sizes[0] // hd, q, k))
        return calls, q, k, qkv[:, sizes[0] + sizes[1]:], cos

    def bind(qkv, pos, cache, slots, *norms):
        """(Bound, q, k, v) for the native passes, or None (no such passes here, or int32
        positions or slots, whose int64 copies would be this step's). The bound tables hold
        positions below their row count: the guard checks each step's."""
        planned = None if pos.dtype != torch.long or slots.dtype != torch.long else \
            native_rope_cache(qkv, pos, cache, slots, *norms)
        if planned is None:
            return None
        calls, q, k, v, cos = planned
        rows = cos.shape[0]
        guard = NativeGuard(pos, rows) if pos.is_contiguous() else lambda: int(pos.max()) < rows
        return Bound(calls, {("rope", id(cos), pos.data_ptr()): guard}), q, k, v

    def qkv_rope_cache(qkv, pos, cache, slots, *norms):
        planned = native_rope_cache(qkv, pos, cache, slots, *norms)
        if planned is not None:
            calls, q, k, v, _ = planned
            for call in calls:
                call()
            return q, k, v
        q, k, v = torch.split(qkv, sizes, dim=-1)
        if norms:
            q, k = norm(q.contiguous(), norms[0]), norm(k.contiguous(), norms[1])
        q, k = rope(q, pos), rope(k, pos)
        write_kv(cache, k, v, slots)
        return q, k, v

    qkv_rope_cache.bind = bind
    return qkv_rope_cache


@factory("qkv_attention")
def _qkv_attention(attrs: dict) -> Kernel:
    rope_cache = _qkv_rope_cache({k: attrs[k] for k in ("sizes", "head_dim", "theta", "qk_norm_eps") if k in attrs})
    attend = FACTORIES["attention"]({**attrs, "write_kv": False})

    def qkv_attention(qkv, pos, cache, slots, tables, seq_lens, query_lens, *extra, out=None):
        norms, sink = split_extra(extra, "qk_norm_eps" in attrs, attrs.get("sinks", False))
        q, k, v = rope_cache(qkv, pos, cache, slots, *norms)
        return attend(q, k, v, cache, slots, tables, seq_lens, query_lens, *sink, out=out)

    def bind(qkv, pos, cache, slots, tables, seq_lens, query_lens, *extra, out):
        """The native rope pass, then attention's bind (bound.py), or None."""
        norms, sink = split_extra(extra, "qk_norm_eps" in attrs, attrs.get("sinks", False))
        roped = rope_cache.bind(qkv, pos, cache, slots, *norms)
        if roped is None:
            return None
        bound, q, k, v = roped
        return bound.then(attend.bind(q, k, v, cache, slots, tables, seq_lens, query_lens, *sink, out=out))

    qkv_attention.bind = bind
    return qkv_attention


@factory("logits")
def _logits(attrs: dict) -> Kernel:
    def logits(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(take_rows(x, rows), w).float()

    return logits


def packed_logits_kernel(attrs: dict) -> Kernel:
    """The prepacked head's kernel (packed_logits), with bind_new: in a step program, the rows
    gathered into a buffer of the binding, the GEMM the Python call runs into another, then
    converted into the run's f32 logits."""
    def logits(x: torch.Tensor, packed, rows: torch.Tensor) -> torch.Tensor:
        return packed_logits(x, packed, rows)

    def bind_new(x, packed, rows) -> tuple[Bound, list[RunOutput]] | None:
        from .native_binds import project

        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not isinstance(rows, torch.Tensor) \
                or not writes_in_place(packed):  # native panels or a dense f32 weight, not oneDNN's layout
            return None
        n = packed.n if isinstance(packed, PanelWeight) else packed.shape[0]
        picked = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype)  # rewritten by each run
        y = torch.empty(rows.shape[0], n, dtype=x.dtype)
        ops = project(picked, packed, y)
        if ops is None:
            return None
        out = RunOutput((rows.shape[0], n), torch.float32)
        return Bound([aten_op("index_select", x, rows, picked), *ops, program_op("copy_to", y, out)]), [out]

    logits.bind_new = bind_new
    return logits


from . import attention, tail_kernels  # noqa: E402,F401  (register the attention and sampling-tail kernels)

_DENSE = lambda dtype, w: prepack_linear_weight(w)
_PACKED_NORM_LINEAR = _norm_linear_kernels(packed_linear)
_Q4_NORM_LINEAR = _norm_linear_kernels(q4_linear)
ALL = (torch.float32, *HALF)
PREPACKED = {
    # f32: the native panel GEMM; SmolLM2's 120 projections at 1 / 8 / 64 / 512 rows took
    # 15 / 17 / 68 / 532 ms against MKL's 18 / 37 / 95 / 530 (2 cores). bf16: the AMX GEMM,
    # 16 / 20 / 45 / 509 ms at 1 / 8 / 64 / 1024 rows against oneDNN's packed 43 / 39 / 74 / 631;
    # on AVX512-BF16 without AMX (Zen 4) the vector GEMM, SmolLM2's four projection shapes at
    # 8 / 64 / 1,000 rows in 0.20 / 1.18 / 19.0 ms against oneDNN's 0.39 / 1.36 / 18.4;
    # elsewhere, and f16: oneDNN's packed GEMM beats its unpacked one (15 vs 11 GB/s at one row)
    "linear": Prepack((1,), _DENSE, lambda attrs: packed_linear, ALL),
    "logits": Prepack((1,), _DENSE, packed_logits_kernel, ALL),
    "fused_moe": Prepack((1, 2, 3), MoeWeights, make_fused_moe, ALL),
    "moe_experts": Prepack((2, 3), ExpertWeights, make_moe_experts, ALL),
    "moe_local_experts": Prepack((3, 4), ExpertWeights, lambda attrs: moe_local_experts, ALL),
    "swiglu_linear": Prepack((1,), _DENSE, lambda attrs: packed_swiglu_linear, ALL),
    "rms_norm_linear": Prepack((2,), _DENSE, _PACKED_NORM_LINEAR["rms_norm_linear"], ALL),
    "add_rms_norm_linear": Prepack((3,), _DENSE, _PACKED_NORM_LINEAR["add_rms_norm_linear"], ALL),
    # f32 and bf16 activations: the native int8 GEMM (AVX512-VNNI); SmolLM2's projections ran
    # 1.6x faster than the bf16 vector GEMM on Zen 4 (docs/quantization.md)
    "linear_w8a8": Prepack((1, 2), W8A8Weights, lambda attrs: lambda x, w: w8a8_linear(x, w, attrs["act_group"]), ALL),
    # the LM head of a W8A8 build (f32 logits; SmolLM2's [64 rows, 576] x [49152, 576]: ~2x the bf16 GEMM)
    "logits_w8a8": Prepack((1, 2), W8A8Weights, lambda attrs: w8a8_logits_kernel(attrs["act_group"]), ALL),
}
PREPACKED_Q4 = {  # ops whose projection is int4 (attr group_size): packed for every dtype
    "linear_q4": Prepack((1, 2, 3), Q4Weights, lambda attrs: q4_linear, ALL),
    "swiglu_linear": Prepack((1, 2, 3), Q4Weights, lambda attrs: lambda x, w: q4_linear(swiglu_rows(x), w), ALL),
    "rms_norm_linear": Prepack((2, 3, 4), Q4Weights, _Q4_NORM_LINEAR["rms_norm_linear"], ALL),
    "add_rms_norm_linear": Prepack((3, 4, 5), Q4Weights, _Q4_NORM_LINEAR["add_rms_norm_linear"], ALL),
    # int4 weights x int8 activations: the native VNNI kernel (q4a8_gemm.cpp) at every row count
    "linear_q4a8": Prepack((1, 2, 3), Q4A8Weights, lambda attrs: q4a8_linear, ALL),
}


PREPACKED_W8A8 = {  # fused ops whose projection is W8A8 (attr act_group): the norm or SwiGLU as the
    # int8 GEMM's quantization prologue (on SmolLM2's W8A8 build the separate norm and SwiGLU
    # passes had taken ~6% of a step)
    "swiglu_linear": Prepack((1, 2), W8A8Weights,
                             lambda attrs: lambda x, w: w8a8_swiglu_linear(x, w, attrs["act_group"]), ALL),
    "rms_norm_linear": Prepack((2, 3), W8A8Weights, lambda attrs: lambda x, nw, w: w8a8_norm_linear(
        x, None, nw, attrs["eps"], w, attrs["act_group"])[1], ALL),
    "add_rms_norm_linear": Prepack((3, 4), W8A8Weights, lambda attrs: lambda x, res, nw, w: w8a8_norm_linear(
        x, res, nw, attrs["eps"], w, attrs["act_group"]), ALL),
}


PREPACKED_Q4A8 = {  # fused ops whose projection is int4-a8 (attrs group_size and act_group): the norm
    # or SwiGLU made row by row inside q4a8_gemm's quantization phase (no region or pass of its own)
    "swiglu_linear": Prepack((1, 2, 3), Q4A8Weights, lambda attrs: q4a8_swiglu_linear, ALL),
    "rms_norm_linear": Prepack((2, 3, 4), Q4A8Weights, lambda attrs: lambda x, nw, w: q4a8_norm_linear(
        x, None, nw, attrs["eps"], w)[1], ALL),
    "add_rms_norm_linear": Prepack((3, 4, 5), Q4A8Weights, lambda attrs: lambda x, res, nw, w: q4a8_norm_linear(
        x, res, nw, attrs["eps"], w), ALL),
}


def prepack_for(op: str, attrs: dict) -> Prepack | None:
    if is_q4a8(attrs):
        return PREPACKED_Q4A8.get(op)
    if "group_size" in attrs:
        return PREPACKED_Q4.get(op)
    if "act_group" in attrs and op in PREPACKED_W8A8:
        return PREPACKED_W8A8[op]
    return PREPACKED.get(op)
