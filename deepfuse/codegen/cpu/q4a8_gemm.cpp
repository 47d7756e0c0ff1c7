// int4 weights x int8 activations (linear_q4a8, ir/opdefs_quant.py) with AVX512-VNNI: the Q4_1
// weight's nibbles dotted as unsigned bytes against each row's activations quantized to int8 per
// group of 32 (vpdpbusd), for decode-sized steps and at every other row count.
//
//   q4a8_gemm_available()           whether this build has AVX512-VNNI
//   q4a8_gemm(x [M, K] f32/bf16, blocks, N, out) -> y [M, N] in x's dtype (or into an f32 out)
//       blocks u8 [ceil(N/16), K/32, 320] from q4a8_kernels.pack_q4a8
//   q4a8_gemm_swiglu(x [M, 2K], ...)   the same over swiglu(x) (swiglu_linear, int4-a8 projection)
//   q4a8_gemm_norm(x [M, K], res, w [K], eps, sum_out, ...)   the same over rms_norm(x (+ res), w),
//       x + res written to sum_out when res is given (rms_norm_linear, add_rms_norm_linear)
//
// A block holds one panel's (16 columns) group of 32 k: 256 bytes of nibbles, vector v (0-3) of
// 64 bytes with byte 4c + e holding column c's k = 4v + e in its low nibble and k = 16 + 4v + e
// in its high one; then the 16 columns' scales, then their minima, as f16.
//
// Each row of x is quantized here, per group of 32: d = max|x| / 127, q = round(x * (127 / max|x|))
// in -127..127 (ties to even), as ir.opdefs_quant.quantize_rows_i8 does, and s = d * sum(q). For
// column n and group g, with the weight w = scale * nib + min:
//     sum_k w x_q = scale * d * (integer dot of nib and q) + min * s
// vpdpbusd makes the integer dot exactly (unsigned nibbles x signed q); the two f32 terms are
// added per group in order, so a row's result is the same whatever M is and whatever rows share
// the call. Every thread quantizes the rows itself (no second parallel region, no pass over
// memory between); the threads split the panels. The fused forms make each row's activation
// (row_ops.h, bit for bit what the unfused kernels write) in a buffer of the thread's just before
// quantizing it, so the norm or SwiGLU adds no parallel region and no [M, K] trip through memory;
// of add_rms_norm's sum, the thread holding the first panels writes sum_out.
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DEEPFUSE_Q4A8 1
#include "vec.h"
#endif

#include "prologue_rows.h"

namespace {

constexpr int64_t kCols = 16, kGroup = 32, kBlock = 320;  // columns per panel, k per group, bytes per block
constexpr int kRows = 4;                                   // rows per micro-tile
constexpr int64_t kChunkBytes = 256 << 10;                 // weight bytes swept per row block

#if DEEPFUSE_Q4A8
// How many groups ahead decode tiles (1-2 rows) prefetch each panel's block: 2 on Intel CPUs, where
// it made 120 SmolLM2 projections + the int8 head as one program 2-4% faster (2-core Sapphire
// Rapids VM); 0 elsewhere: on AMD Zen 4, whose hardware prefetchers already stream the panels, the
// prefetches made the q4a8 ops ~14% slower and batch-1 decode ~6% (docs/performance.md).
int64_t decode_prefetch_groups() { return intel_cpu() ? 2 : 0; }

// x[K] -> q [K] s8, d [K/32] and s [K/32] f32 (see the file's comment)
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, float* s) {
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    for (int64_t g = 0; g < k / kGroup; ++g) {
        const __m512 a = load16(x + g * kGroup), b = load16(x + g * kGroup + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        qa = _mm512_max_epi32(_mm512_min_epi32(qa, top), bottom);
        qb = _mm512_max_epi32(_mm512_min_epi32(qb, top), bottom);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16), _mm512_cvtepi32_epi8(qb));
        d[g] = amax / 127.f;
        s[g] = d[g] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    }
}

static inline __m512i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// R rows of q (ldq apart; d and s `groups` apart) times P panels (`stride` bytes apart) into y's
// R rows, `cols` valid columns from the first panel's first.
template <typename T, int R, int P>
void micro(const int8_t* q, int64_t ldq, const float* d, const float* s, int64_t groups, const uint8_t* w,
           int64_t stride, T* y, int64_t ldy, int64_t cols, int64_t ahead) {
    __m512 f[R][P];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) f[r][p] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
    for (int64_t g = 0; g < groups; ++g) {
        if constexpr (R <= 2)  // decode rows: each panel's block `ahead` groups on; past a panel's end, the
            for (int p = 0; p < P && ahead > 0; ++p)  // next panel's first blocks (for the tile's last panel,
                for (int line = 0; line < kBlock; line += 64) {  // the next tile's), or past the weights
                    // the address as an integer: it may lie past the weights (a prefetch never faults)
                    const uintptr_t at = reinterpret_cast<uintptr_t>(w) + p * stride + (g + ahead) * kBlock + line;
                    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
                }
        // a: the nibbles' dots. A lone row (decode) dots its high nibbles from the bytes masked to
        // 0xF0 (16 x the nibble, at most 240: still an unsigned byte) into sums of their own, b, 16 x
        // their dot exactly, divided once per group: no shift per load. Wider tiles share each
        // unpacked vector across their rows, so the shift is paid once for all of them, and the
        // extra sums would not fit the registers.
        __m512i a[R][P], b[P];
        for (int p = 0; p < P; ++p) {
            b[p] = _mm512_setzero_si512();
            for (int r = 0; r < R; ++r) a[r][p] = _mm512_setzero_si512();
        }
        for (int v = 0; v < 4; ++v) {
            if constexpr (R == 1) {
                const int8_t* qr = q + g * kGroup + 4 * v;
                const __m512i xl = broadcast4(qr), xh = broadcast4(qr + 16);
                for (int p = 0; p < P; ++p) {
                    const __m512i nib = _mm512_loadu_si512(w + p * stride + g * kBlock + 64 * v);
                    a[0][p] = _mm512_dpbusd_epi32(a[0][p], _mm512_and_si512(nib, low), xl);
                    b[p] = _mm512_dpbusd_epi32(b[p], _mm512_and_si512(nib, high), xh);
                }
            } else {
                __m512i lo[P], hi[P];
                for (int p = 0; p < P; ++p) {
                    const __m512i nib = _mm512_loadu_si512(w + p * stride + g * kBlock + 64 * v);
                    lo[p] = _mm512_and_si512(nib, low);
                    hi[p] = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low);
                }
                for (int r = 0; r < R; ++r) {
                    const int8_t* qr = q + r * ldq + g * kGroup + 4 * v;
                    const __m512i xl = broadcast4(qr), xh = broadcast4(qr + 16);
                    for (int p = 0; p < P; ++p) {
                        a[r][p] = _mm512_dpbusd_epi32(a[r][p], lo[p], xl);
                        a[r][p] = _mm512_dpbusd_epi32(a[r][p], hi[p], xh);
                    }
                }
            }
        }
        for (int p = 0; p < P; ++p) {
            const uint8_t* block = w + p * stride + g * kBlock;
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256)));
            const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 288)));
            for (int r = 0; r < R; ++r) {
                const __m512 sd = _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups + g]));
                __m512i dot = a[r][p];
                if constexpr (R == 1) dot = _mm512_add_epi32(dot, _mm512_srai_epi32(b[p], 4));  // b / 16: exact
                f[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, f[r][p]);
                f[r][p] = _mm512_fmadd_ps(min, _mm512_set1_ps(s[r * groups + g]), f[r][p]);
            }
        }
    }
    for (int p = 0; p < P; ++p) {
        const int64_t c = std::min<int64_t>(kCols, cols - p * kCols);
        for (int r = 0; r < R; ++r) {
            if (c == kCols) {
                store16(y + r * ldy + p * kCols, f[r][p]);
            } else {
                alignas(64) T tmp[kCols];
                store16(tmp, f[r][p]);
                std::memcpy(y + r * ldy + p * kCols, tmp, c * sizeof(T));
            }
        }
    }
}

template <typename T>
using MicroFn = void (*)(const int8_t*, int64_t, const float*, const float*, int64_t, const uint8_t*, int64_t, T*,
                         int64_t, int64_t, int64_t);

// The widest micro-tile for `rows` rows (1..kRows) that `left` (>= 1) panels fill: its function,
// and its width in panels. One row reads 8 panels at once: each panel is its own run of memory,
// and 8 runs in flight kept a batch-1 decode's small GEMVs near the read bandwidth where 2
// reached about two thirds of it (a standalone sweep of SmolLM2's 120 projections, 2-core Zen 4
// VM). More rows share each panel's loads, so fewer panels fit the registers. A lone row's last
// 9-15 panels go as two tiles of 5-8 and its last 4-7 as one, so a thread's share does not end on
// a tile of 2 runs (SmolLM2's q/k/v: 30 panels a thread, 8 + 8 + 7 + 7 instead of 8 + 8 + 8 + 4 + 2).
template <typename T>
std::pair<MicroFn<T>, int64_t> widest(int64_t rows, int64_t left) {
    using Tile = std::pair<MicroFn<T>, int64_t>;
    if (rows == 1 && left >= 4) {
        switch (left >= 16 || left == 8 ? 8 : left > 8 ? (left + 1) / 2 : left) {
            case 4: return Tile{micro<T, 1, 4>, 4};
            case 5: return Tile{micro<T, 1, 5>, 5};
            case 6: return Tile{micro<T, 1, 6>, 6};
            case 7: return Tile{micro<T, 1, 7>, 7};
            default: return Tile{micro<T, 1, 8>, 8};
        }
    }
    if (rows == 2 && left >= 4) return Tile{micro<T, 2, 4>, 4};
    if (left >= 2) {
        constexpr MicroFn<T> two[kRows] = {micro<T, 1, 2>, micro<T, 2, 2>, micro<T, 3, 2>, micro<T, 4, 2>};
        return Tile{two[rows - 1], 2};
    }
    constexpr MicroFn<T> one[kRows] = {micro<T, 1, 1>, micro<T, 2, 1>, micro<T, 3, 1>, micro<T, 4, 1>};
    return Tile{one[rows - 1], 1};
}

// The calling thread's quantized rows, grown and never shrunk: q [M, K], d and s [M, K/32]
struct Quantized {
    std::vector<int8_t> q;
    std::vector<float> d, s;
};

Quantized& quantized(int64_t m, int64_t k) {
    static thread_local Quantized buffers;
    auto grow = [](auto& v, int64_t n) {
        if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    };
    grow(buffers.q, m * k);
    grow(buffers.d, m * k / kGroup);
    grow(buffers.s, m * k / kGroup);
    return buffers;
}

// row: prologue_rows.h's (buf 2K of X, the thread's; first: this thread holds the first panels, and
// writes the norm's sum).
template <typename X, typename T, typename Row>
void gemm(Row row, int64_t m, int64_t k, const uint8_t* blocks, int64_t nb, int64_t n, T* y, int64_t ldy) {
    const int64_t groups = k / kGroup, stride = groups * kBlock, ahead = decode_prefetch_groups();
    const int64_t pairs = (nb + 1) / 2;
    // panels per sweep: a chunk stays in L2 across the row blocks (one block: the thread's panels)
    const int64_t chunk = m <= kRows ? nb : std::max<int64_t>(1, kChunkBytes / (2 * stride)) * 2;
    team::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
        Quantized& qa = quantized(m, k);
        static thread_local std::vector<X> buf;  // a prologue's row and, after it, add_rms_norm's sum
        if (static_cast<int64_t>(buf.size()) < 2 * k) buf.resize(2 * k);
        for (int64_t r = 0; r < m; ++r)
            quantize_row(row(r, buf.data(), p0 == 0), k, qa.q.data() + r * k, qa.d.data() + r * groups,
                         qa.s.data() + r * groups);
        const int64_t b0 = 2 * p0, b1 = std::min(nb, 2 * p1);
        for (int64_t c0 = b0; c0 < b1; c0 += chunk) {  // a chunk of panels stays in L2 across the row blocks
            const int64_t c1 = std::min(b1, c0 + chunk);
            for (int64_t m0 = 0; m0 < m; m0 += kRows) {
                const int64_t rows = std::min<int64_t>(kRows, m - m0);
                for (int64_t b = c0, width; b < c1; b += width) {
                    const auto [fn, w] = widest<T>(rows, c1 - b);
                    width = w;
                    fn(qa.q.data() + m0 * k, k, qa.d.data() + m0 * groups, qa.s.data() + m0 * groups, groups,
                       blocks + b * stride, stride, y + m0 * ldy + b * kCols, ldy, n - b * kCols, ahead);
                }
            }
        }
    });
}
#endif

}  // namespace

bool q4a8_gemm_available() {
#if DEEPFUSE_Q4A8
    return true;
#else
    return false;
#endif
}

namespace {

// Checks blocks and out against x's K (k) and M rows; returns out or a new y.
torch::Tensor checked_out(const torch::Tensor& x, int64_t k, const torch::Tensor& blocks, int64_t n,
                          const std::optional<torch::Tensor>& out) {
    TORCH_CHECK(q4a8_gemm_available(), "q4a8_gemm: this build has no AVX512-VNNI");
    TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
                "q4a8_gemm: x must be [M, K] float32 or bfloat16");
    const int64_t m = x.size(0), nb = (n + kCols - 1) / kCols;
    TORCH_CHECK(k % kGroup == 0, "q4a8_gemm: K must be a multiple of 32");
    TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                    blocks.size(0) == nb && blocks.size(1) * kGroup == k && blocks.size(2) == kBlock,
                "q4a8_gemm: blocks must come from pack_q4a8 of a [N, K] weight with x's K");
    auto y = out.has_value() ? *out : torch::empty({m, n}, x.options());
    TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n &&
                    (y.scalar_type() == x.scalar_type() || y.scalar_type() == torch::kFloat32) && y.stride(1) == 1,
                "q4a8_gemm: out must be [M, N] of x's dtype or f32 with unit column stride");
    return y;
}

// The GEMM over x's dtype X and y's (X, or f32), rows from row_of(X{}) (see gemm)
template <typename RowOf>
void dispatch(const torch::Tensor& x, int64_t k, const torch::Tensor& blocks, int64_t n, torch::Tensor& y,
              RowOf row_of) {
#if DEEPFUSE_Q4A8
    const int64_t m = x.size(0), nb = (n + kCols - 1) / kCols;
    if (m == 0 || n == 0) return;
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    using bf16 = c10::BFloat16;
    if (x.scalar_type() == torch::kFloat32)
        gemm<float>(row_of(float{}), m, k, w, nb, n, y.data_ptr<float>(), y.stride(0));
    else if (y.scalar_type() == torch::kFloat32)
        gemm<bf16>(row_of(bf16{}), m, k, w, nb, n, y.data_ptr<float>(), y.stride(0));
    else
        gemm<bf16>(row_of(bf16{}), m, k, w, nb, n, y.data_ptr<bf16>(), y.stride(0));
#endif
}

}  // namespace

torch::Tensor q4a8_gemm(torch::Tensor x, const torch::Tensor& blocks, int64_t n, std::optional<torch::Tensor> out) {
    TORCH_CHECK(x.dim() == 2, "q4a8_gemm: x must be [M, K] float32 or bfloat16");
    auto y = checked_out(x, x.size(1), blocks, n, out);
    if (x.stride(1) != 1) x = x.contiguous();
    dispatch(x, x.size(1), blocks, n, y, [&](auto zero) { return prologue_rows::plain<decltype(zero)>(x); });
    return y;
}

torch::Tensor q4a8_gemm_swiglu(torch::Tensor x, const torch::Tensor& blocks, int64_t n,
                               std::optional<torch::Tensor> out) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "q4a8_gemm_swiglu: x must be [M, 2K]");
    auto y = checked_out(x, x.size(1) / 2, blocks, n, out);
    if (x.stride(1) != 1) x = x.contiguous();
    dispatch(x, x.size(1) / 2, blocks, n, y, [&](auto zero) { return prologue_rows::swiglu<decltype(zero)>(x); });
    return y;
}

torch::Tensor q4a8_gemm_norm(const torch::Tensor& x, std::optional<torch::Tensor> res, const torch::Tensor& w,
                             double eps, std::optional<torch::Tensor> sum_out, const torch::Tensor& blocks, int64_t n,
                             std::optional<torch::Tensor> out) {
    prologue_rows::check_norm("q4a8_gemm_norm", x, res, w, sum_out);
    auto y = checked_out(x, x.size(1), blocks, n, out);
    dispatch(x, x.size(1), blocks, n, y,
             [&](auto zero) { return prologue_rows::norm<decltype(zero)>(x, res, w, sum_out, eps); });
    return y;
}
