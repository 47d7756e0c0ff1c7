"""The native kernels check themselves on the machine they run on (native.kernels() calls check()).

Every entry point runs once on small random data (fixed seed, ~0.1 s in all) against a reference
that shares no code with it: float64 matmuls of the (dequantized) weights, a softmax over the
cache rows each query may read (the window rule), the RMS norm, silu(gate) * up and RoPE
formulas, torch's argmax (of nan_to_num(x, nan=-inf)), the sample and spec_verify ops' references.
Packing helpers (pack_q4_vnni, RopeTables' tables, quantize_kv_rows)
only lay data out. Errors and tolerances are relative to the output's scale (max |reference|):
1e-4 for f32 outputs, 1e-2 for bf16 ones (int8 cache rows: one step of the row's scale; argmax:
exact; sample and spec_verify: every token equal). W8A8 references quantize the activations as the op
documents (ir.opdefs_quant.quantize_rows_i8); where the kernel makes the activation itself (norm,
SwiGLU prologues, f32 arithmetic) an element next to a quantization boundary may land a step
away, and its step is allowed on top. An entry point that disagrees or raises is refused, with
one warning naming it:
- always-used ones (paged_decode, panel_gemm, norms, swiglu, rope_cache, argmax): the whole
  library (check() returns None: every call site takes its torch path);
- a gated group: its flag reads False (bf16_gemm_available, i8_gemm_available,
  q4a8_gemm_available, paged_prefill_available, sample_available);
- the AMX paths: amx_available reads False and bf16_gemm, q4_gemm, paged_prefill and
  paged_decode run their vector paths whatever the caller asks (amx=False, amx_rows=0).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 1e-4, BF16: 1e-2}  # relative to the output's scale
CONSEQUENCE = {
    "core": "the native kernels are off: every op takes its torch path",
    "amx": "AMX tiles are off (amx_available() reads False): the vector paths run instead",
    "bf16_gemm": "bf16_gemm_available() reads False: bf16 and int4 projections take oneDNN or torch",
    "i8_gemm": "i8_gemm_available() reads False: W8A8 projections run the op's reference",
    "q4a8_gemm": "q4a8_gemm_available() reads False: int4 x int8 projections run the op's reference",
    "paged_prefill": "paged_prefill_available() reads False: prefill chunks run SDPA",
    "sample": "sample_available() reads False: sampled rows and draft verification run the ops' references",
}


@dataclass(frozen=True)
class Result:
    """One check: its group ("core", "amx", or the gated group of native.FLAGS), the error and
    tolerance, why it failed."""

    group: str
    error: float
    tol: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error <= self.tol  # a NaN error is never ok


_LAST: dict[str, Result] = {}


def last_report() -> dict[str, tuple[float, float, bool]]:
    """The latest check's results: entry point -> (max error, tolerance, ok)."""
    return {name: (r.error, r.tol, r.ok) for name, r in _LAST.items()}


def rel(got: torch.Tensor, want: torch.Tensor, scale: float | None = None, slack: tuple | None = None) -> float:
    """max |got - want| / scale (default max |want|); inf on a NaN or a shape mismatch. slack:
    (tol, per-element allowance): each element's error is measured against tol * scale + its
    allowance, scaled back to tol (so the result passes at tol exactly where every element does)."""
    if got.shape != want.shape:
        return math.inf
    scale = max(float(want.double().abs().max()) if scale is None else scale, 1e-30)
    err = (got.double() - want.double()).abs().nan_to_num(nan=math.inf) / scale
    if slack is not None:
        err = err / (slack[0] + slack[1] / scale) * slack[0]
    return float(err.max()) if err.numel() else 0.0


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float64) as dtype's values would hold it, back in float64."""
    return x.to(dtype).double()


# ---- references (float64) ----

def attend_ref(q, kv, table, ends: list[int], window: int, scale: float) -> torch.Tensor:
    """Query rows q[n, H*D] of one sequence over kv[2,NB,BS,Hkv,D] through its block ids `table`:
    row i over keys 0..ends[i]-1, the last `window` of them when window > 0 -> [n, H*D] float64."""
    hkv, d, end = kv.shape[3], kv.shape[4], max(ends)
    n, h = q.shape[0], q.shape[1] // d
    rows = kv[:, table[: -(-end // kv.shape[2])]].reshape(2, -1, hkv, d)[:, :end]
    heads = torch.arange(h) // (h // hkv)
    k, v = rows[0][:, heads], rows[1][:, heads]  # [L, H, D]
    pos, last = torch.arange(end)[None], torch.tensor(ends)[:, None]
    sees = (pos < last) & (pos >= last - window if window else True)  # [n, L]
    scores = torch.einsum("nhd,lhd->nhl", q.view(n, h, d).double(), k) * scale
    p = scores.masked_fill(~sees[:, None], -math.inf).softmax(-1)
    return torch.einsum("nhl,lhd->nhd", p, v).reshape(n, -1)


def plain_kv(cache: torch.Tensor) -> torch.Tensor:
    from ...ir.opdefs_llm import dequantize_kv_rows

    return (dequantize_kv_rows(cache) if cache.dtype == torch.int8 else cache).double()


def rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x[T,D] / rms(x), rounded to x's dtype as the rms_norm op rounds it, * w[D] -> float64."""
    h = x.double() * (x.double().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return rounded(h, x.dtype) * w.double()


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def rope_ref(x: torch.Tensor, pos: torch.Tensor, hd: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of every head of x[T, H*hd], angles in float64."""
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.cat([pos.double()[:, None] * inv] * 2, -1)[:, None]  # [T, 1, hd]
    h = x.double().view(x.shape[0], -1, hd)
    rot = torch.cat((-h[..., hd // 2:], h[..., : hd // 2]), -1)
    return (h * ang.cos() + rot * ang.sin()).reshape(x.shape[0], -1)


# ---- checks: each returns (error, tolerance), or a list of them for several outputs ----

def _decode(m, g, dtype, cache_kind, amx_rows: int, window: int, lone: bool = False):
    from ...ir.opdefs_llm import quantize_kv_rows

    h, hkv, d, bs, nb = (8, 1, 64, 16, 40) if lone else (4, 2, 64, 16, 40)
    kv = torch.randn(2, nb, bs, hkv, d, generator=g)
    kv[0, 3] *= 4  # peaked softmaxes: the running max moves between blocks
    cache = quantize_kv_rows(kv) if cache_kind == "int8" else kv.to(dtype)
    # a lone row, a 3-row verify chunk (one table, consecutive lengths: an AMX span), a row over
    # two 512-position segments, a row ending mid-block
    lens = torch.tensor([1, 29, 30, 31, 530, 17])
    tables = torch.stack([torch.randperm(nb, generator=g)[:34] for _ in range(4)])[[0, 1, 1, 1, 2, 3]].contiguous()
    q = torch.randn(len(lens), h * d, generator=g).to(dtype)
    if lone:  # the 530-position row alone, 8 heads on one kv head: one work item, its positions split over the threads
        q, tables, lens = q[4:5], tables[4:5], lens[4:5]
    out = torch.full_like(q, float("nan"))
    m.paged_decode(q, cache, tables, lens, h, window, d ** -0.5, out, amx_rows)
    kv = plain_kv(cache)
    want = torch.cat([attend_ref(q[s:s + 1], kv, tables[s], [int(lens[s])], window, d ** -0.5) for s in range(len(lens))])
    return rel(out, want), TOL[dtype]


def _prefill(m, g, cache_kind, amx: bool, window: int):
    from ...ir.opdefs_llm import quantize_kv_rows

    h, hkv, d, bs, nb = 4, 2, 64, 16, 16
    kv = torch.randn(2, nb, bs, hkv, d, generator=g)
    kv[0, 5] *= 4  # peaked softmaxes
    cache = quantize_kv_rows(kv) if cache_kind == "int8" else kv.to(BF16)
    lens, qlens, rows = torch.tensor([1, 70, 90]), torch.tensor([1, 70, 6]), torch.tensor([1, 2, 72])
    tables = torch.stack([torch.randperm(nb, generator=g)[:6] for _ in lens])
    q = torch.randn(79, h * d, generator=g).to(BF16)  # rows 0 and 78 belong to no chunk: left alone
    out = torch.full_like(q, 7.0)
    m.paged_prefill(q, cache, tables, rows, qlens, lens, h, window, d ** -0.5, out, amx)
    kv, want = plain_kv(cache), torch.full(q.shape, 7.0, dtype=torch.float64)
    for c in range(len(lens)):
        length, n, r = int(lens[c]), int(qlens[c]), int(rows[c])
        want[r:r + n] = attend_ref(q[r:r + n], kv, tables[c], list(range(length - n + 1, length + 1)), window,
                                   d ** -0.5)
    return rel(out, want, float(want[1:78].abs().max())), TOL[BF16]


def _panel_gemm(m, g):
    x, w = torch.randn(5, 37, generator=g), torch.randn(40, 37, generator=g)
    arena = torch.full((5, 48), float("nan"))
    out = arena[:, 4:44]  # a planned step buffer's strided view
    m.panel_gemm(x, m.pack_panels(w), 40, out)
    return rel(out, x.double() @ w.double().T), TOL[F32]


def _bf16_gemm(m, g, amx: bool):
    # 37 rows: a whole 32-row block of AMX tiles and a ragged one; 40 columns: a part panel
    x, w = torch.randn(37, 96, generator=g).to(BF16), torch.randn(40, 96, generator=g).to(BF16)
    out = torch.full((37, 48), float("nan"), dtype=BF16)[:, 4:44]
    m.bf16_gemm(x, m.pack_vnni(w), 40, out, amx)
    return rel(out, x.double() @ w.double().T), TOL[BF16]


def _q4_gemm(m, g, amx: bool):
    from ...ir.opdefs_quant import dequantize_q4
    from .packed_weights import pack_q4_vnni

    n, k = 40, 96
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales, mins = torch.rand(n, k // 32, generator=g) * 0.02, -torch.rand(n, k // 32, generator=g) * 0.1
    x = torch.randn(37, k, generator=g).to(BF16)
    out = m.q4_gemm(x, *pack_q4_vnni(packed, scales, mins), n, None, amx)
    w = rounded(dequantize_q4(packed, scales, mins).double(), BF16)  # as a dense bf16 weight holds it
    return rel(out, x.double() @ w.T), TOL[BF16]


def _rms_norm(m, g, dtype):
    x = (torch.randn(3, 72, generator=g) * 0.05).to(dtype)  # eps (1e-5) is 0.4% of the mean square
    w = (0.5 + torch.rand(72, generator=g)).to(dtype)
    return rel(m.rms_norm(x, w, 1e-5), rms_ref(x, w, 1e-5)), TOL[dtype]


def _add_rms_norm(m, g, dtype):
    x, res = (torch.randn(3, 72, generator=g).to(dtype) for _ in range(2))
    w = (0.5 + torch.rand(72, generator=g)).to(dtype)
    s, normed = m.add_rms_norm(x, res, w, 1e-6)
    want_s = rounded(x.double() + res.double(), dtype)
    return [(rel(s, want_s), TOL[dtype]), (rel(normed, rms_ref(want_s.to(dtype), w, 1e-6)), TOL[dtype])]


def _swiglu(m, g, dtype):
    x = (torch.randn(3, 2 * 40, generator=g) * 4).to(dtype)
    return rel(m.swiglu(x), swiglu_ref(x)), TOL[dtype]


def _argmax(m, g):
    x = torch.randn(4, 100, generator=g)
    x[1, [7, 60]] = 9.0  # a tie: the first wins
    x[2, 99] = 9.0  # the last column
    x[3, [5, 40]] = float("nan")  # counts as -inf, as the sample op has it
    got = m.argmax(x)
    want = torch.nan_to_num(x, nan=-math.inf, posinf=math.inf, neginf=-math.inf).argmax(-1)
    return float((got != want).sum()) if got.shape == (4,) else math.inf, 0.0


def _sample(m, g):
    """Greedy and sampled rows (top-k 1, small, over V; top-p 0 .. 1; NaN and infinite logits) against
    the op's reference: the count of tokens that differ (rows whose choice rests on float rounding
    are avoided by the data: scores spread by 3 over 300 tokens)."""
    from ...ir import OPS

    r, v = 16, 300
    x = torch.randn(r, v, generator=g) * 3
    x[3, 7] = x[5, 11] = float("nan")
    x[9, 100] = math.inf
    x[10] = -math.inf
    t = torch.tensor([0.0, 0.7, 1.0, 1.5] * 4)
    k = torch.tensor([0, 5, 50, 0, 1, v + 100, 0, 2] * 2)
    p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.95, 1.0, 0.0, 0.999] * 2)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (r,), generator=g)
    got = m.sample(x, t, k, p, seeds)
    want = OPS["sample"].reference(x, t, k, p, seeds)
    return float((got != want).sum()) if got.shape == (r,) else math.inf, 0.0


def _spec_verify(m, g):
    from ...ir import OPS

    drafts = torch.randint(-1, 4, (40,), generator=g)
    drafts[-1] = -1
    tokens = torch.where(torch.rand(40, generator=g) < 0.7, drafts.clamp(min=0), torch.randint(0, 4, (40,), generator=g))
    got, want = m.spec_verify(tokens, drafts), OPS["spec_verify"].reference(tokens, drafts)
    return float((got != want).sum()) if got.shape == want.shape else math.inf, 0.0


def _rope_cache(m, g, dtype, cache_kind: str):
    from ...ir.opdefs_llm import dequantize_kv_rows
    from .kernels import RopeTables

    h, hkv, hd, t, theta = 4, 2, 64, 5, 10000.0
    qkv = torch.randn(t, (h + 2 * hkv) * hd, generator=g).to(dtype)
    pos, slots = torch.randint(0, 60, (t,), generator=g), torch.randperm(4 * 8, generator=g)[:t]
    cache = torch.zeros(2, 4, 8, hkv, hd + 4 if cache_kind == "int8" else hd, dtype=torch.int8 if cache_kind == "int8"
                        else dtype)
    cos, sin = RopeTables(hd, theta).tables(int(pos.max()), F32, torch.device("cpu"))
    q, k = torch.empty(t, h * hd, dtype=dtype), torch.empty(t, hkv * hd, dtype=dtype)
    m.rope_cache(qkv, pos, cos, sin, cache, slots, h, q, k)
    want_q, want_k = rope_ref(qkv[:, : h * hd], pos, hd, theta), rope_ref(qkv[:, h * hd:(h + hkv) * hd], pos, hd, theta)
    parts = [(rel(q, want_q), TOL[dtype]), (rel(k, want_k), TOL[dtype])]
    want = torch.zeros(2, 32, hkv, hd, dtype=torch.float64)  # every slot but `slots` stays zero
    want[0, slots], want[1, slots] = want_k.view(t, hkv, hd), qkv[:, (h + hkv) * hd:].double().view(t, hkv, hd)
    if cache_kind != "int8":
        return parts + [(rel(cache.view(2, 32, hkv, hd), want), TOL[dtype])]
    # each head's row within one step of its int8 scale (half a step, and k's rounding to dtype)
    got = dequantize_kv_rows(cache.view(2, 32, hkv, hd + 4)).double()
    amax = want.abs().amax(-1, keepdim=True)
    rows = ((got - want).abs() / amax.clamp(min=1e-30)).nan_to_num(nan=math.inf).amax(-1)
    return parts + [(float(rows.max()), 1 / 127)]


ACT_REL = 1e-5  # how close (relative) the kernel's own f32 activation (norm, SwiGLU prologue) is to float64's


def _w8a8_ref(act: torch.Tensor, dtype, w: torch.Tensor, group: int, made: bool):
    """act [T,K] (float64) rounded to dtype, quantized per row and group as the op does, @ w[N,K]^T
    -> (want, slack), each [T,N]. made: the kernel makes the activation itself, within ACT_REL of
    act before its rounding to dtype; an element whose interval holds a rounding or quantization
    boundary (or whose group's largest does) may then land a step away: slack sums each element's
    widest departure from the reference's dequantized value times |w|."""
    from ...ir.opdefs_quant import quantize_rows_i8

    q, d = quantize_rows_i8(rounded(act, dtype).float(), group)
    deq = (q.double() * d.double()[..., None]).reshape(act.shape)
    if not made:
        return deq @ w.T, torch.zeros(act.shape[0], w.shape[0], dtype=torch.float64)
    ends = [rounded(act * (1 + s * ACT_REL), dtype).view(act.shape[0], -1, group) for s in (-1, 1)]
    lo, hi = torch.minimum(*ends), torch.maximum(*ends)
    least = torch.where((lo <= 0) & (hi >= 0), 0.0, torch.minimum(lo.abs(), hi.abs()))
    amax = [torch.maximum(lo.abs(), hi.abs()).amax(-1, keepdim=True), least.amax(-1, keepdim=True).clamp(min=1e-30)]
    scaled = torch.stack([v * 127 / m for v in (lo, hi) for m in amax])
    steps = [scaled.amin(0).round().clamp(-127, 127), scaled.amax(0).round().clamp(-127, 127)]
    corners = torch.stack([k * m / 127 for k in steps for m in amax]).view(4, *act.shape)
    slack = (corners - deq).abs().amax(0)
    return deq @ w.T, slack @ w.abs().T


def _i8_gemm(m, g, dtype, form: str):
    """i8_gemm, or its swiglu / norm (with res: "add_norm") prologue forms, K 128 in groups of 64."""
    from ...ir.opdefs_quant import W8_ZERO, quantize_w8

    n, k, group, rows = 40, 128, 64, 3
    wq, scale = quantize_w8(torch.randn(n, k, generator=g))
    w, panels, padded = (wq.double() - W8_ZERO) * scale.double()[:, None], m.pack_w8(wq), F.pad(scale, (0, -n % 16))
    if form == "plain":
        x = torch.randn(rows, k, generator=g).to(dtype)
        x[0, :group] = 0  # a zero group: scale 0
        got, act = m.i8_gemm(x, panels, padded, n, group), x.double()
    elif form == "swiglu":
        x = (torch.randn(rows, 2 * k, generator=g) * 3).to(dtype)
        got, act = m.i8_gemm_swiglu(x, panels, padded, n, group), swiglu_ref(x)
    else:
        x, res = (torch.randn(rows, k, generator=g).to(dtype) for _ in range(2))
        nw = (0.5 + torch.rand(k, generator=g)).to(dtype)
        if form == "norm":
            got, act = m.i8_gemm_norm(x, None, nw, 1e-5, None, panels, padded, n, group), rms_ref(x, nw, 1e-5)
        else:
            s = torch.full_like(x, float("nan"))
            got = m.i8_gemm_norm(x, res, nw, 1e-5, s, panels, padded, n, group)
            want_s = rounded(x.double() + res.double(), dtype)
            act, parts = rms_ref(want_s.to(dtype), nw, 1e-5), [(rel(s, want_s), TOL[dtype])]
    want, slack = _w8a8_ref(act, dtype, w, group, made=form != "plain")
    return [(rel(got, want, slack=(TOL[dtype], slack)), TOL[dtype])] + (parts if form == "add_norm" else [])


def _q4a8_gemm(m, g, dtype):
    """q4a8_gemm, K 96 (three groups of 32), 40 columns (a partial panel), 5 rows (a full and a
    partial micro-tile); reference: the activation quantized as the op documents, the weight
    dequantized with f16 scales and mins, a float64 matmul."""
    from ...ir.opdefs_quant import quantize_rows_i8, unpack_q4
    from .q4a8_kernels import pack_q4a8

    n, k, rows = 40, 96, 5
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales, mins = torch.rand(n, k // 32, generator=g) * 0.02, -torch.rand(n, k // 32, generator=g) * 0.1
    x = torch.randn(rows, k, generator=g).to(dtype)
    x[0, :32] = 0  # a zero group: scale 0
    got = m.q4a8_gemm(x, pack_q4a8(packed, scales, mins), n)
    q, d = quantize_rows_i8(x.float(), 32)
    act = (q.double() * d.double()[..., None]).reshape(rows, k)
    w = unpack_q4(packed).double().view(n, -1, 32) * scales.half().double()[..., None] + mins.half().double()[..., None]
    return rel(got, act @ w.view(n, k).T), TOL[dtype]


def checks(m) -> dict[str, tuple[str, Callable]]:
    """The checks that apply to module m: name -> (group, fn(m, generator) -> (error, tolerance) or a list)."""
    amx = bool(m.amx_available())
    out: dict[str, tuple[str, Callable]] = {"panel_gemm": ("core", _panel_gemm), "argmax": ("core", _argmax)}
    for dt, t in ((F32, "f32"), (BF16, "bf16")):
        for name, fn in (("rms_norm", _rms_norm), ("add_rms_norm", _add_rms_norm), ("swiglu", _swiglu)):
            out[f"{name}[{t}]"] = ("core", partial(fn, dtype=dt))
    for dt, kind, t in ((F32, "float", "f32"), (BF16, "float", "bf16"), (BF16, "int8", "bf16,int8 cache")):
        out[f"rope_cache[{t}]"] = ("core", partial(_rope_cache, dtype=dt, cache_kind=kind))
    for dt, kind, rows, window, t in ((F32, "float", 0, 0, "f32"), (BF16, "float", 0, 0, "bf16,amx_rows=0"),
                                     (BF16, "float", 1, 13, "bf16,amx_rows=1,window"),
                                     (BF16, "float", 2, 0, "bf16,amx_rows=2"),
                                     (F32, "int8", 2, 13, "f32,int8 cache,window"), (BF16, "int8", 2, 0, "bf16,int8 cache")):
        group = "amx" if amx and rows and dt == BF16 and kind == "float" else "core"  # AMX spans where built
        out[f"paged_decode[{t}]"] = (group, partial(_decode, dtype=dt, cache_kind=kind, amx_rows=rows, window=window))
    for dt, kind, t in ((BF16, "float", "bf16,lone row"), (BF16, "int8", "bf16,int8 cache,lone row")):
        out[f"paged_decode[{t}]"] = ("core", partial(_decode, dtype=dt, cache_kind=kind, amx_rows=0, window=0, lone=True))
    for on in (False, True) if amx else (False,):  # amx=True is the vector path where AMX is not built
        if m.bf16_gemm_available():
            for name, fn in (("bf16_gemm", _bf16_gemm), ("q4_gemm", _q4_gemm)):
                out[name + ("[amx]" if on else "")] = ("amx" if on else "bf16_gemm", partial(fn, amx=on))
        if m.paged_prefill_available():
            for kind, window, t in (("float", 0, "bf16"), ("int8", 30, "int8 cache,window")):
                out[f"paged_prefill[{t}{',amx' if on else ''}]"] = (
                    "amx" if on else "paged_prefill", partial(_prefill, cache_kind=kind, amx=on, window=window))
    if m.i8_gemm_available():
        for form, name in (("plain", "i8_gemm"), ("swiglu", "i8_gemm_swiglu"), ("norm", "i8_gemm_norm"),
                           ("add_norm", "i8_gemm_norm")):
            for dt, t in ((F32, "f32"), (BF16, "bf16")):
                key = f"{name}[{t}{',res' if form == 'add_norm' else ''}]"
                out[key] = ("i8_gemm", partial(_i8_gemm, dtype=dt, form=form))
    out["sample"], out["spec_verify"] = ("sample", _sample), ("sample", _spec_verify)
    if m.q4a8_gemm_available():
        for dt, t in ((F32, "f32"), (BF16, "bf16")):
            out[f"q4a8_gemm[{t}]"] = ("q4a8_gemm", partial(_q4a8_gemm, dtype=dt))
    return out


class _Threads:
    """m's entry points called with the process's intra-op threads; the references between them run on
    one (torch's tiny parallel regions took seconds on a loaded 2-core machine, waiting for a thread)."""

    def __init__(self, m, threads: int):
        self.m, self.threads = m, threads

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self._call(getattr(self.m, name), args, kwargs)

    def _call(self, fn, args, kwargs):
        torch.set_num_threads(self.threads)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(1)


def run(m) -> dict[str, Result]:
    """Runs every check that applies to m (each on its own fixed-seed generator: the global RNG is
    left alone); records and returns the results."""
    report, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, (name, (group, fn)) in enumerate(checks(m).items()):
            report[name] = _one(_Threads(m, threads), group, fn, torch.Generator().manual_seed(1000 + i))
    finally:
        torch.set_num_threads(threads)
    _LAST.clear()
    _LAST.update(report)
    return report


def _one(m, group: str, fn: Callable, g: torch.Generator) -> Result:
    """One check's Result; an exception (a refused operand, a missing entry point) is a failure."""
    try:
        with torch.no_grad():
            parts = fn(m, g)
        error, tol = max(parts if isinstance(parts, list) else [parts], key=_badness)
        return Result(group, float(error), float(tol))
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return Result(group, math.inf, 0.0, f"{type(e).__name__}: {first}")


def _badness(part: tuple[float, float]) -> float:
    """error / tolerance (NaN: inf): the worst part of a check is what it reports."""
    error, tol = part
    if math.isnan(error):
        return math.inf
    if tol == 0:
        return math.inf if error > 0 else 0.0
    return error / tol


def check(m):
    """Runs the self-check on module m and warns once per refused entry point: None when an
    always-used one failed, else native.CheckedKernels(m) with the failed groups refused."""
    from .native import CheckedKernels

    report = run(m)
    for name, r in report.items():
        if not r.ok:
            found = r.note or f"error {r.error:.3g} > tolerance {r.tol:.3g}"
            warnings.warn(f"deepfuse: native kernel {name} failed its self-check on this CPU ({found}); "
                          f"{CONSEQUENCE[r.group]}", stacklevel=3)
    if any(not r.ok and r.group == "core" for r in report.values()):
        return None
    return CheckedKernels(m, {name: (r.group, r.error, r.tol, r.ok) for name, r in report.items()})
