// W8A8 projections (linear_w8a8, ir/opdefs_quant.py) with AVX512-VNNI integer dot products
// (vpdpbusd: 64 byte products a cycle, twice vdpbf16ps's 32).
//
//   i8_gemm_available()                whether this build has AVX512-VNNI
//   pack_w8(wq [N, K] u8)              -> panels u8 [ceil(N/16), K/4, 16, 4] (padding columns: 128, weight 0)
//   i8_gemm(x [M, K] f32/bf16, panels, scale [N] f32, N, group, out) -> y [M, N] in x's dtype (or
//       into an f32 out: a W8A8 LM head's logits)
//   i8_gemm_swiglu(x [M, 2K], ...)   the same over swiglu(x) (swiglu_linear with a W8A8 projection)
//   i8_gemm_norm(x [M, K], res, w [K], eps, sum_out, ...)   the same over rms_norm(x (+ res), w),
//       x + res written to sum_out when res is given (rms_norm_linear, add_rms_norm_linear)
//
// The fused forms make each row's activation (row_ops.h, bit for bit what the unfused kernels
// write) in a buffer of the thread's and quantize it from there: the [M, K] activation is never
// written out and read back, and there is one pass over the rows instead of two.
//
// The weight is offset binary: w = (wq - 128) * scale[n]. Each row of x is quantized here, per
// group of `group` k: d = max|x| / 127, q = round(x * (127 / max|x|)) in -127..127 (ties to even),
// exactly as the op's reference does. vpdpbusd multiplies the weight's unsigned bytes by q's
// signed ones, so a group's integer sum is exact and carries 128 * sum(q); the sums are scaled by
// their group's d and added up in f32 (groups in order), and the row's sum of d * 128 * sum(q)
// (one number a row) is taken off at the end, then the column scale applied.
// A panel's k quad (16 columns x 4 k) is one 64-byte vector and a row's k quad one 32-bit
// broadcast. A micro-tile of up to 6 rows x 2 panels keeps 12 integer and 12 f32 accumulators in
// registers (a lone row takes 8 panels at once, two rows 4: more runs of memory in flight for a
// decode step's GEMVs and LM head; the int8 SmolLM2 head of one row ~1.0 -> ~0.8 ms, 2-core
// Zen 4); each vpdpbusd reads its row's quad as an embedded broadcast (written as asm: from
// the intrinsics GCC 12 copied the accumulators between registers every step; +10-13%). Each
// row's sums run in one order whatever M is, so a row's result never depends on the batch. Work
// items are (chunk of panels, slab of rows); within one, each micro-tile's rows stay in L1 while
// it sweeps the chunk's panels from L2 (single-thread, SmolLM2's four shapes at 1,024 rows:
// ~335 -> ~370 GOPS against 4 x 3 tiles panel by panel; the same at 64 rows).
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DEEPFUSE_I8_DOT 1
#include "vec.h"
#endif

#include "balanced.h"
#include "prologue_rows.h"

namespace {

constexpr int64_t kCols = 16;  // columns per panel
constexpr int kRows = 6;       // rows per micro-tile
constexpr int kPanels = 2;     // panels per micro-tile
constexpr int kWide = 8;       // panels per micro-tile of a lone row (two rows: 4), as in q4a8_gemm.cpp
constexpr int64_t kChunkBytes = 128 << 10;

#if DEEPFUSE_I8_DOT
// How many lines ahead decode tiles (1-2 rows) prefetch each panel: 16 on Intel CPUs (SmolLM2's
// int8 LM head at one row on two threads, each call after 66 MB of other reads, 2-core Xeon,
// medians of 40: 0.58-0.63 ms against 0.64-0.69 with the hardware's prefetching alone; a
// standalone sweep, no result file); 0 elsewhere: on AMD Zen 4 the head took 0.95 ms a step with
// them and 0.88 without (docs/performance.md).
int64_t decode_prefetch_lines() { return intel_cpu() ? 16 : 0; }

// One row x[K] (f32 or bf16) quantized per group: q [K] s8, d [K/group] f32, and *offset the
// row's sum over groups of d * 128 * sum(q) (what vpdpbusd's unsigned weight bytes add).
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t group, int8_t* q, float* d, float* offset) {
    float corr = 0.f;
    for (int64_t g0 = 0, g = 0; g0 < k; g0 += group, ++g) {
        __m512 top = _mm512_setzero_ps();
        for (int64_t i = g0; i < g0 + group; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + i)));
        const float amax = _mm512_reduce_max_ps(top);
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        d[g] = amax / 127.f;
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = g0; i < g0 + group; i += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + i), inv));  // ties to even (MXCSR default)
            v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
            sum = _mm512_add_epi32(sum, v);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
        }
        corr += d[g] * static_cast<float>(128 * _mm512_reduce_add_epi32(sum));
    }
    *offset = corr;
}

// R rows of q (ldq apart; their d rows `groups` apart, their offsets consecutive) times P panels (k/4 * 64 bytes
// apart) into y's R rows, `cols` valid columns from the first panel's first.
template <typename T, int R, int P>
void micro(const int8_t* q, int64_t ldq, const float* d, const float* offset, int64_t groups, int64_t group,
           const uint8_t* w, int64_t k, const float* scale, T* y, int64_t ldy, int64_t cols, int64_t ahead) {
    __m512 f[R][P];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) f[r][p] = _mm512_setzero_ps();
    const int64_t panel = k * kCols;  // bytes
    for (int64_t g = 0; g < groups; ++g) {
        __m512i a[R][P];
        for (int r = 0; r < R; ++r)
            for (int p = 0; p < P; ++p) a[r][p] = _mm512_setzero_si512();
        for (int64_t j = g * group / 4; j < (g + 1) * group / 4; ++j) {
            if constexpr (R <= 2)  // decode rows: each panel's line `ahead` on (past a panel's end, the next
                for (int p = 0; p < P && ahead > 0; ++p) {  // panel's first lines, or past the weights: a
                    // prefetch never faults)
                    const uintptr_t at = reinterpret_cast<uintptr_t>(w) + p * panel + (j + ahead) * 64;
                    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
                }
            __m512i wv[P];
            for (int p = 0; p < P; ++p) wv[p] = _mm512_load_si512(w + p * panel + j * 64);
            for (int r = 0; r < R; ++r)
                for (int p = 0; p < P; ++p)  // the row's quad broadcast by the instruction itself
                    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a[r][p]) : "v"(wv[p]), "m"(*(const int32_t*)(q + r * ldq + 4 * j)));
        }
        for (int r = 0; r < R; ++r) {
            const __m512 dg = _mm512_set1_ps(d[r * groups + g]);
            for (int p = 0; p < P; ++p) f[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][p]), dg, f[r][p]);
        }
    }
    for (int p = 0; p < P; ++p) {
        const int64_t c = std::min<int64_t>(kCols, cols - p * kCols);
        const __m512 s = _mm512_loadu_ps(scale + p * kCols);  // scale is padded to whole panels
        for (int r = 0; r < R; ++r) {
            const __m512 v = _mm512_mul_ps(_mm512_sub_ps(f[r][p], _mm512_set1_ps(offset[r])), s);
            if (c == kCols) {
                store16(y + r * ldy + p * kCols, v);
            } else {
                alignas(64) T tmp[kCols];
                store16(tmp, v);
                std::memcpy(y + r * ldy + p * kCols, tmp, c * sizeof(T));
            }
        }
    }
}

template <typename T>
using MicroFn = void (*)(const int8_t*, int64_t, const float*, const float*, int64_t, int64_t, const uint8_t*,
                         int64_t, const float*, T*, int64_t, int64_t, int64_t);

// micro<T, rows, P> for rows 1..kRows. A switch, not a table: GCC 12 at -O3 -march=sapphirerapids
// read a two-level constexpr table of variable templates (kMicro<T>[P - 1][R - 1]) wrongly in
// one of the instantiations using it, calling a 2-panel tile for a lone last panel.
template <typename T, int P>
MicroFn<T> micro_rows(int64_t rows) {
    static_assert(kRows == 6 && kPanels == 2, "micro_rows and its caller spell out every tile");
    switch (rows) {
        case 1: return micro<T, 1, P>;
        case 2: return micro<T, 2, P>;
        case 3: return micro<T, 3, P>;
        case 4: return micro<T, 4, P>;
        case 5: return micro<T, 5, P>;
        default: return micro<T, 6, P>;
    }
}

// The quantized activation of one call: q [M, K] s8, d [M, K/group] f32, offset [M] f32. One per
// calling thread, grown and never shrunk: allocating and zeroing them per call ran on the calling
// thread alone, before the parallel part (perf: ~6% of that thread's time in the throughput run's
// prefill steps, the other thread idle meanwhile).
struct Quantized {
    std::vector<int8_t> q;
    std::vector<float> d, offset;
};

Quantized& quantized(int64_t m, int64_t k, int64_t groups) {
    static thread_local Quantized buffers;
    auto grow = [](auto& v, int64_t n) {
        if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    };
    grow(buffers.q, m * k);
    grow(buffers.d, m * groups);
    grow(buffers.offset, m);
    return buffers;
}

// row: prologue_rows.h's (each row made by one thread, so that thread writes its sum: first).
template <typename X, typename T, typename Row>
void gemm(Row row, int64_t m, int64_t k, const uint8_t* panels, int64_t nb, int64_t n, const float* scale,
          int64_t group, T* y, int64_t ldy) {
    const int64_t groups = k / group, ahead = decode_prefetch_lines();
    Quantized& qa = quantized(m, k, groups);
    int8_t* q = qa.q.data();
    float* d = qa.d.data();
    float* offset = qa.offset.data();
    team::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
        std::vector<X> buf(k);
        for (int64_t r = r0; r < r1; ++r)
            quantize_row(row(r, buf.data(), true), k, group, q + r * k, d + r * groups, offset + r);
    });
    // items: (chunk of panels, slab of rows), chunks of equal size holding at most about
    // kChunkBytes, ~16 items a thread, split by work (balanced.h: an even split of the item list
    // left one thread idle up to a third of the time where the last chunk or slab is short)
    const int64_t most = std::max<int64_t>(1, kChunkBytes / (kPanels * k * kCols)) * kPanels;
    const int64_t chunks = (nb + most - 1) / most;
    const int64_t whole = m == 1 ? kWide : kPanels;  // a chunk holds whole micro-tiles
    const int64_t chunk = ((nb + chunks - 1) / chunks + whole - 1) / whole * whole;
    const int64_t blocks = (m + kRows - 1) / kRows, threads = team::threads();
    const int64_t cuts = std::clamp<int64_t>((16 * threads + chunks - 1) / chunks, 1, blocks);
    const int64_t slab = (blocks + cuts - 1) / cuts * kRows, slabs = (m + slab - 1) / slab;
    auto cost = [&](int64_t item) {
        const int64_t c = item / slabs, s = item % slabs;
        return (std::min(nb, (c + 1) * chunk) - c * chunk) * (std::min(m, (s + 1) * slab) - s * slab);
    };
    balanced::balanced_for(chunks * slabs, cost, [&](int64_t item, int64_t) {
        const int64_t c = item / slabs, s = item % slabs;
        const int64_t b1 = std::min(nb, (c + 1) * chunk), m1 = std::min(m, (s + 1) * slab);
        for (int64_t m0 = s * slab; m0 < m1; m0 += kRows) {  // a micro-tile's rows stay in L1 for the chunk
            const int64_t rows = std::min<int64_t>(kRows, m1 - m0);
            for (int64_t b = c * chunk, np; b < b1; b += np) {
                MicroFn<T> fn;
                if (rows == 1 && b1 - b >= kWide) {
                    fn = micro<T, 1, kWide>, np = kWide;
                } else if (rows == 2 && b1 - b >= 4) {
                    fn = micro<T, 2, 4>, np = 4;
                } else {
                    np = std::min<int64_t>(kPanels, b1 - b);
                    fn = np == 1 ? micro_rows<T, 1>(rows) : micro_rows<T, 2>(rows);
                }
                fn(q + m0 * k, k, d + m0 * groups, offset + m0, groups, group, panels + b * k * kCols, k,
                   scale + b * kCols, y + m0 * ldy + b * kCols, ldy, n - b * kCols, ahead);
            }
        }
    });
}
#endif

}  // namespace

bool i8_gemm_available() {
#if DEEPFUSE_I8_DOT
    return true;
#else
    return false;
#endif
}

torch::Tensor pack_w8(const torch::Tensor& wq) {
    TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == torch::kUInt8 && wq.size(1) % 4 == 0,
                "pack_w8: wq must be u8 [N, K] with K a multiple of 4");
    const int64_t n = wq.size(0), k = wq.size(1), nb = (n + kCols - 1) / kCols;
    auto padded = torch::constant_pad_nd(wq, {0, 0, 0, nb * kCols - n}, 128);
    return padded.view({nb, kCols, k / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

// Checks panels, scale, group and out against x's K (k) and M rows; returns out or a new y.
torch::Tensor checked_out(const torch::Tensor& x, int64_t k, const torch::Tensor& panels, const torch::Tensor& scale,
                          int64_t n, int64_t group, const std::optional<torch::Tensor>& out) {
    TORCH_CHECK(i8_gemm_available(), "i8_gemm: this build has no AVX512-VNNI");
    TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
                "i8_gemm: x must be [M, K] float32 or bfloat16");
    const int64_t m = x.size(0), nb = (n + kCols - 1) / kCols;
    TORCH_CHECK(group > 0 && group % 16 == 0 && k % group == 0, "i8_gemm: K must be a multiple of the group, itself of 16");
    TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == torch::kUInt8 && panels.is_contiguous() &&
                    panels.size(0) == nb && panels.size(1) * 4 == k && panels.size(2) == kCols && panels.size(3) == 4,
                "i8_gemm: panels must come from pack_w8 of a [N, K] weight with x's K");
    TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() &&
                    scale.size(0) == nb * kCols, "i8_gemm: scale must be f32 [N] padded to a multiple of 16");
    auto y = out.has_value() ? *out : torch::empty({m, n}, x.options());
    TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n &&
                    (y.scalar_type() == x.scalar_type() || y.scalar_type() == torch::kFloat32) && y.stride(1) == 1,
                "i8_gemm: out must be [M, N] of x's dtype or f32 with unit column stride");
    return y;
}

// The GEMM over x's dtype X and y's (X, or f32), rows from row_of<X>() (see gemm)
template <typename RowOf>
void dispatch(const torch::Tensor& x, int64_t k, const torch::Tensor& panels, const torch::Tensor& scale, int64_t n,
              int64_t group, torch::Tensor& y, RowOf row_of) {
#if DEEPFUSE_I8_DOT
    const int64_t m = x.size(0), nb = (n + kCols - 1) / kCols;
    if (m == 0 || n == 0) return;
    const uint8_t* w = panels.data_ptr<uint8_t>();
    const float* sc = scale.data_ptr<float>();
    using bf16 = c10::BFloat16;
    if (x.scalar_type() == torch::kFloat32)
        gemm<float>(row_of(float{}), m, k, w, nb, n, sc, group, y.data_ptr<float>(), y.stride(0));
    else if (y.scalar_type() == torch::kFloat32)
        gemm<bf16>(row_of(bf16{}), m, k, w, nb, n, sc, group, y.data_ptr<float>(), y.stride(0));
    else
        gemm<bf16>(row_of(bf16{}), m, k, w, nb, n, sc, group, y.data_ptr<bf16>(), y.stride(0));
#endif
}

}  // namespace

torch::Tensor i8_gemm(torch::Tensor x, const torch::Tensor& panels, const torch::Tensor& scale, int64_t n,
                      int64_t group, std::optional<torch::Tensor> out) {
    TORCH_CHECK(x.dim() == 2, "i8_gemm: x must be [M, K] float32 or bfloat16");
    auto y = checked_out(x, x.size(1), panels, scale, n, group, out);
    if (x.stride(1) != 1) x = x.contiguous();
    dispatch(x, x.size(1), panels, scale, n, group, y,
             [&](auto zero) { return prologue_rows::plain<decltype(zero)>(x); });
    return y;
}

torch::Tensor i8_gemm_swiglu(torch::Tensor x, const torch::Tensor& panels, const torch::Tensor& scale, int64_t n,
                             int64_t group, std::optional<torch::Tensor> out) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "i8_gemm_swiglu: x must be [M, 2K]");
    auto y = checked_out(x, x.size(1) / 2, panels, scale, n, group, out);
    if (x.stride(1) != 1) x = x.contiguous();
    dispatch(x, x.size(1) / 2, panels, scale, n, group, y,
             [&](auto zero) { return prologue_rows::swiglu<decltype(zero)>(x); });
    return y;
}

torch::Tensor i8_gemm_norm(const torch::Tensor& x, std::optional<torch::Tensor> res, const torch::Tensor& w, double eps,
                           std::optional<torch::Tensor> sum_out, const torch::Tensor& panels, const torch::Tensor& scale,
                           int64_t n, int64_t group, std::optional<torch::Tensor> out) {
    prologue_rows::check_norm("i8_gemm_norm", x, res, w, sum_out);
    auto y = checked_out(x, x.size(1), panels, scale, n, group, out);
    dispatch(x, x.size(1), panels, scale, n, group, y,
             [&](auto zero) { return prologue_rows::norm<decltype(zero)>(x, res, w, sum_out, eps); });
    return y;
}
