"""The CPU renderer of the kernel IR (deepfuse/kernel): one C++ translation unit per Kernel.

`render_cpp(k)` emits `extern "C" void <name>(const int64_t* args)`: args holds the buffers'
data pointers in buffer order (inputs, then outputs), then the row count (binding the row
symbol) and the thread count, so a call from Python is one ctypes call with one prebuilt array.
The (r, g) pairs run on an OpenMP team (contiguous blocks, one per thread) only when
rows * G * C >= PARALLEL_ELEMS; below that they run in the caller's thread without entering
OpenMP at all (a parallel region, even one its `if` turns off, costs ~0.4 us; a row of a few
hundred elements takes well under a microsecond).

Per (r, g) the body is split into phases at the reductions: a reduction's phase is the number
of reductions its operand depends on (chained through row values), so independent reductions
share a phase. Phase p is one loop over c that computes the elem values its reductions and
stores need and accumulates them (`omp simd reduction`; argmax in a plain loop); the row values
that follow from phase p are scalars between the loops. An elem value a later phase needs again
is recomputed there from its loads (the rule: recompute, never a scratch row; a row is a few KiB
and stays in L1, and the values are pure, so each phase sees bit for bit the same numbers).
A store goes into the first loop where its value is known; a row-indexed store after the loops.

Arithmetic is f32 as the IR says (-ffp-contract=off: no fused multiply-adds the reference does
not do); bf16 is held as its 16 bits (load: bits << 16; cast and round: nearest even, NaN kept
NaN), f16 as _Float16. exp (and sigmoid, which uses it) is a polynomial the compiler vectorises
(df_exp below, within 2 ulp of expf), and so is tanh (df_tanh: a Taylor polynomial near 0, else
from df_exp; within 3e-7 relative of std::tanh); log and erf are <cmath>'s.
"""
from __future__ import annotations

import math
import struct

from ...kernel.ir import Instr, Kernel

PARALLEL_ELEMS = 16384  # rows * G * C from which the (r, g) loop runs on OpenMP threads

CTYPE = {"f32": "float", "i32": "int32_t", "bool": "bool", "bf16": "uint16_t", "f16": "_Float16",
         "i64": "int64_t"}
UNARY = {"neg": "(-{0})", "abs": "std::fabs({0})", "exp": "df_exp({0})", "log": "std::log({0})",
         "sqrt": "std::sqrt({0})", "rsqrt": "(1.f / std::sqrt({0}))", "tanh": "df_tanh({0})",
         "erf": "std::erf({0})", "sigmoid": "(1.f / (1.f + df_exp(-{0})))", "recip": "(1.f / {0})"}
BINARY = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
          "max": "df_max({0}, {1})", "min": "df_min({0}, {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
          "gt": "({0} > {1})", "ge": "({0} >= {1})", "eq": "({0} == {1})", "ne": "({0} != {1})"}

PRELUDE = r"""#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

static inline uint32_t df_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline float df_float(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
static inline float df_bf16_f32(uint16_t b) { return df_float(static_cast<uint32_t>(b) << 16); }
// f32 -> bf16 bits, round to nearest even; a NaN becomes 0x7FC0 (as torch has it)
static inline uint16_t df_f32_bf16(float x) {
    const uint32_t u = df_bits(x);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return x != x ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(r);
}
static inline float df_round_bf16(float x) { return df_bf16_f32(df_f32_bf16(x)); }
static inline float df_round_f16(float x) { return static_cast<float>(static_cast<_Float16>(x)); }
static inline float df_max(float a, float b) { return a != a || b != b ? a + b : (a > b ? a : b); }
static inline float df_min(float a, float b) { return a != a || b != b ? a + b : (a < b ? a : b); }
static inline float df_fma(float a, float b, float c) {
#ifdef __FMA__
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}
// exp: x = n ln2 + r, |r| <= ln2 / 2 (n rounded by adding 1.5 * 2^23: floor does not vectorise;
// ln2 in two parts), exp(r) by its Taylor series to r^7 / 7! (the next term is < 6e-9 relative),
// times 2^n as two exponent-field scalings (so results down to the subnormals are right).
static inline float df_exp(float x) {
    const float xc = x < -104.f ? -104.f : (x > 89.f ? 89.f : x);
    const float k = xc * 1.44269504f + 12582912.f;  // + 1.5 * 2^23: rounds to an integer, n
    const float n = k - 12582912.f;
    const float r = df_fma(n, -1.42860677e-6f, df_fma(n, -6.93145752e-1f, xc));
    float p = 1.98412698e-4f;
    p = df_fma(p, r, 1.38888889e-3f);
    p = df_fma(p, r, 8.33333333e-3f);
    p = df_fma(p, r, 4.16666667e-2f);
    p = df_fma(p, r, 1.66666667e-1f);
    p = df_fma(p, r, 0.5f);
    p = df_fma(p, r, 1.f);
    p = df_fma(p, r, 1.f);
    const int32_t ni = static_cast<int32_t>(df_bits(k) - 0x4B400000u), half = ni / 2;
    const float s1 = df_float(static_cast<uint32_t>(half + 127) << 23);
    const float s2 = df_float(static_cast<uint32_t>(ni - half + 127) << 23);
    return x != x ? x : p * s1 * s2;
}
// tanh, odd: |x| < 0.4 its Taylor series to x^13 (the next term is < 5e-9 relative there), else
// 1 - 2 / (exp(2|x|) + 1) (|x| capped at 20, where tanh is 1 in f32); branch-free, so it vectorises
static inline float df_tanh(float x) {
    const float a = x < 0.f ? -x : x, a2 = a * a;
    float p = 3.59212803e-3f;                      // 21844 / 6081075
    p = df_fma(p, a2, -8.86323552e-3f);            // -1382 / 155925
    p = df_fma(p, a2, 2.18694885e-2f);             // 62 / 2835
    p = df_fma(p, a2, -5.39682540e-2f);            // -17 / 315
    p = df_fma(p, a2, 1.33333333e-1f);             // 2 / 15
    p = df_fma(p, a2, -3.33333333e-1f);
    const float small = df_fma(p * a2, a, a);
    const float big = 1.f - 2.f / (df_exp(2.f * (a < 20.f ? a : 20.f)) + 1.f);
    const float r = a < 0.4f ? small : big;
    return x != x ? x : std::copysign(r, x);
}
"""


def literal(value, dtype: str) -> str:
    """A C++ literal of exactly this value in dtype (f32: a hex float of the f32-rounded value)."""
    if dtype == "bool":
        return "true" if value else "false"
    if dtype in ("i32", "i64"):
        return f"static_cast<{CTYPE[dtype]}>({int(value)}LL)"
    v = struct.unpack("f", struct.pack("f", float(value)))[0]
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return f"{v.hex()}f"


def cast_expr(x: str, src: str, to: str) -> str:
    """x (of dtype src) converted to dtype `to` (narrowing floats: nearest even)."""
    if src == to:
        return x
    if src == "bf16":
        x, src = f"df_bf16_f32({x})", "f32"
        if to == "f32":
            return x
    if to == "bf16":
        return f"df_f32_bf16(static_cast<float>({x}))"
    return f"static_cast<{CTYPE[to]}>({x})"


def base_name(ins: Instr) -> str:
    """The per-(r, g) pointer a load or store indexes from: its buffer plus r * row + g * group."""
    ix = ins.attrs["index"]
    return f"{ins.attrs['buf']}_{ix.row}_{ix.group}"


def index_expr(ins: Instr) -> str:
    """The element a load or store touches: base[c * col + offset] (see base_name)."""
    ix = ins.attrs["index"]
    terms = ["c" if ix.col == 1 else f"c * {ix.col}"] if ix.col else []
    terms += [str(ix.offset)] if ix.offset or not terms else []
    return f"{base_name(ins)}[{' + '.join(terms)}]"


def expr(ins: Instr, v: dict[int, Instr]) -> str:
    """The right-hand side of one value instruction (arguments by name v<N>)."""
    a = [f"v{x}" for x in ins.args]
    op = ins.op
    if op == "load":
        return index_expr(ins)
    if op == "const":
        return literal(ins.attrs["value"], ins.dtype)
    if op == "col":
        return "static_cast<int32_t>(c)"
    if op in UNARY:
        return UNARY[op].format(*a)
    if op in BINARY:
        return BINARY[op].format(*a)
    if op == "where":
        return f"({a[0]} ? {a[1]} : {a[2]})"
    if op == "cast":
        src = v[ins.args[0]]
        if ins.attrs["to"] == "bf16" and src.op == "round" and src.attrs["to"] == "bf16":
            return f"static_cast<uint16_t>(df_bits({a[0]}) >> 16)"  # already a bf16 value (a NaN as 0x7FC0)
        return cast_expr(a[0], src.dtype, ins.attrs["to"])
    if op == "round":
        return f"df_round_{ins.attrs['to']}({a[0]})"
    raise ValueError(f"the CPU renderer has no {op!r}")


def render_cpp(k: Kernel) -> str:
    """One C++ translation unit for k with its extern "C" entry k.name (see the module's docstring)."""
    from .generated_phases import render_body

    return PRELUDE + "\n" + render_body(k)
