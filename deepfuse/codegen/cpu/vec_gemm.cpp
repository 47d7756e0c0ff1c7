// bf16 projections with AVX512-BF16 dot products (vdpbf16ps), for CPUs without AMX tiles (AMD
// Zen 4): the same VNNI panels and int4 tiles as the AMX kernel (bf16_gemm.cpp, which checks the
// operands and calls these).
//
//   vec_gemm_rows(x [M, K'], panels [NB, K'/2, 16, 2], N, y [M, N])   y = x @ w^T, f32 sums, bf16 out
//   vec_q4_rows(x, nibbles [NB, K'/32, 256], scales, mins [NB, K'/32, 16], N, y)   the same over int4
//
// A panel's k pair (16 columns x 2 k) is one 16-lane vector and a row's k pair one 32-bit
// broadcast, so one vdpbf16ps adds two k to 16 columns. A micro-tile of up to 6 rows x 4 panels
// keeps 24 f32 accumulators in registers over all of K: each loaded weight vector serves 6 rows,
// each broadcast 4 panels. Every row's sums run in one order (k pairs in turn, from zero) whatever
// M is and whichever rows share its tile, so a row's result never depends on the batch.
// Threads split the panels in groups of 4; each walks its panels in chunks of about 256 KB (L2)
// and takes every 6-row block through a chunk before the next (x's block stays in L1). int4
// chunks are dequantized once per call into a per-thread buffer first, to the dense copy's values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "amx.h"
#include "q4.h"

namespace {

constexpr int64_t kCols = 16;   // columns per panel
constexpr int kRows = 6;        // rows per micro-tile
constexpr int kPanels = 4;      // panels per micro-tile
constexpr int64_t kChunkBytes = 256 << 10;

#if DEEPFUSE_BF16_DOT
// R rows of x (ldx apart) times P panels (kp * 16 elements apart) into y's R rows, `cols` valid
// columns from the first panel's first.
template <int R, int P>
void micro(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kp, at::BFloat16* y, int64_t ldy,
           int64_t cols) {
    __m512 acc[R][P];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kp / 2; ++j) {
        __m512bh wv[P];
        for (int p = 0; p < P; ++p)
            wv[p] = reinterpret_cast<__m512bh>(_mm512_load_si512(w + p * kp * kCols + j * 2 * kCols));
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, x + r * ldx + 2 * j, 4);
            const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
            for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xb, wv[p]);
        }
    }
    for (int p = 0; p < P; ++p) {
        const int64_t c = std::min<int64_t>(kCols, cols - p * kCols);
        const __mmask16 mask = c >= kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << c) - 1);
        for (int r = 0; r < R; ++r)
            _mm256_mask_storeu_epi16(y + r * ldy + p * kCols, mask,
                                     reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][p])));
    }
}

template <int P>
void micro_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kp, at::BFloat16* y,
                int64_t ldy, int64_t cols) {
    switch (rows) {
        case 1: return micro<1, P>(x, ldx, w, kp, y, ldy, cols);
        case 2: return micro<2, P>(x, ldx, w, kp, y, ldy, cols);
        case 3: return micro<3, P>(x, ldx, w, kp, y, ldy, cols);
        case 4: return micro<4, P>(x, ldx, w, kp, y, ldy, cols);
        case 5: return micro<5, P>(x, ldx, w, kp, y, ldy, cols);
        default: return micro<6, P>(x, ldx, w, kp, y, ldy, cols);
    }
}

// Every row of x through panels b0 .. b1-1 (at w, kp * 16 elements apart) into y's columns from 16 * b0.
void through_panels(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* w, int64_t kp, int64_t b0, int64_t b1,
                    int64_t n, at::BFloat16* y, int64_t ldy) {
    for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - m0));
        for (int64_t b = b0; b < b1; b += kPanels) {
            const int np = static_cast<int>(std::min<int64_t>(kPanels, b1 - b));
            const uint16_t* wb = w + (b - b0) * kp * kCols;
            at::BFloat16* yb = y + m0 * ldy + b * kCols;
            const uint16_t* xb = x + m0 * ldx;
            const int64_t cols = n - b * kCols;
            switch (np) {
                case 1: micro_rows<1>(rows, xb, ldx, wb, kp, yb, ldy, cols); break;
                case 2: micro_rows<2>(rows, xb, ldx, wb, kp, yb, ldy, cols); break;
                case 3: micro_rows<3>(rows, xb, ldx, wb, kp, yb, ldy, cols); break;
                default: micro_rows<4>(rows, xb, ldx, wb, kp, yb, ldy, cols); break;
            }
        }
    }
}

// Panels per chunk: a multiple of kPanels holding about kChunkBytes of bf16.
int64_t chunk_panels(int64_t kp) {
    return std::max<int64_t>(1, kChunkBytes / (kPanels * kp * kCols * 2)) * kPanels;
}
#endif

}  // namespace

bool vec_gemm_available() {
#if DEEPFUSE_BF16_DOT
    return true;
#else
    return false;
#endif
}

void vec_gemm_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* panels, int64_t kp, int64_t nb, int64_t n,
                   at::BFloat16* y, int64_t ldy) {
#if DEEPFUSE_BF16_DOT
    const int64_t chunk = chunk_panels(kp), groups = (nb + kPanels - 1) / kPanels;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b0 = begin * kPanels; b0 < std::min(nb, end * kPanels); b0 += chunk) {
            const int64_t b1 = std::min({nb, end * kPanels, b0 + chunk});
            through_panels(x, ldx, m, panels + b0 * kp * kCols, kp, b0, b1, n, y, ldy);
        }
    });
#else
    TORCH_CHECK(false, "vec_gemm_rows: this build has no AVX512-BF16");
#endif
}

void vec_q4_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* nibbles, const float* scales,
                 const float* mins, int64_t groups, int64_t nb, int64_t n, at::BFloat16* y, int64_t ldy) {
#if DEEPFUSE_BF16_DOT
    const int64_t kp = groups * 32, chunk = chunk_panels(kp), quads = (nb + kPanels - 1) / kPanels;
    at::parallel_for(0, quads, 1, [&](int64_t begin, int64_t end) {
        const int64_t last = std::min(nb, end * kPanels);
        auto* w = static_cast<uint16_t*>(std::aligned_alloc(64, std::min(chunk, last - begin * kPanels) * kp * kCols * 2));
        for (int64_t b0 = begin * kPanels; b0 < last; b0 += chunk) {
            const int64_t b1 = std::min(last, b0 + chunk);
            for (int64_t b = b0; b < b1; ++b)
                for (int64_t g = 0; g < groups; ++g)
                    dequant_tile(nibbles + (b * groups + g) * 256, scales + (b * groups + g) * kCols,
                                 mins + (b * groups + g) * kCols, w + ((b - b0) * groups + g) * 512);
            through_panels(x, ldx, m, w, kp, b0, b1, n, y, ldy);
        }
        std::free(w);
    });
#else
    TORCH_CHECK(false, "vec_q4_rows: this build has no AVX512-BF16");
#endif
}
