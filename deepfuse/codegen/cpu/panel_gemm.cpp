// f32 projections over weights packed once at load into 16-column panels.
//
//   pack_panels(w [N, K])              -> panels [ceil(N/16), K, 16] (columns past N are zero)
//   panel_gemm(x [M, K], panels, N, out) -> y [M, N] = x @ w^T (into out [M, N] when given)
//
// A panel row (one k, 16 output columns) is one AVX-512 register, so a tile of up to 8 rows of
// x times 3 panels keeps 24 accumulators in registers while the panels stream through once
// per 8 rows: decode and verification steps (M of 1..16) read each weight about once, where a
// GEMM library's small-M path reads it at a fraction of the memory bandwidth. Work is split
// over panel triples between torch's intra-op threads. Machines without AVX-512 get the same
// loop in plain C++ for the compiler to vectorize.
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <optional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // columns per panel
constexpr int kRows = 8;        // rows of x per tile
constexpr int kPanels = 3;      // panels per tile

#if defined(__AVX512F__)
template <int MT, int NP>
void tile(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t cols) {
    __m512 acc[MT][NP];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
        __m512 wv[NP];
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(w + (p * k + kk) * kLanes);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
            const __m512 xb = _mm512_set1_ps(x[m * ldx + kk]);
#pragma GCC unroll 4
            for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xb, wv[p], acc[m][p]);
        }
    }
    for (int p = 0; p < NP; ++p) {
        const int64_t c = std::min<int64_t>(kLanes, cols - p * kLanes);
        const __mmask16 mask = c >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << c) - 1);
        for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * ldy + p * kLanes, mask, acc[m][p]);
    }
}
#else
template <int MT, int NP>
void tile(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t cols) {
    float acc[MT][NP][kLanes] = {};
    for (int64_t kk = 0; kk < k; ++kk)
        for (int m = 0; m < MT; ++m) {
            const float xv = x[m * ldx + kk];
            for (int p = 0; p < NP; ++p)
                for (int64_t l = 0; l < kLanes; ++l) acc[m][p][l] += xv * w[(p * k + kk) * kLanes + l];
        }
    for (int p = 0; p < NP; ++p) {
        const int64_t c = std::min<int64_t>(kLanes, cols - p * kLanes);
        for (int m = 0; m < MT; ++m) std::copy(acc[m][p], acc[m][p] + c, y + m * ldy + p * kLanes);
    }
}
#endif

template <int NP>
void tile_rows(int rows, const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy,
               int64_t cols) {
    switch (rows) {
        case 1: return tile<1, NP>(x, ldx, w, k, y, ldy, cols);
        case 2: return tile<2, NP>(x, ldx, w, k, y, ldy, cols);
        case 3: return tile<3, NP>(x, ldx, w, k, y, ldy, cols);
        case 4: return tile<4, NP>(x, ldx, w, k, y, ldy, cols);
        case 5: return tile<5, NP>(x, ldx, w, k, y, ldy, cols);
        case 6: return tile<6, NP>(x, ldx, w, k, y, ldy, cols);
        case 7: return tile<7, NP>(x, ldx, w, k, y, ldy, cols);
        default: return tile<8, NP>(x, ldx, w, k, y, ldy, cols);
    }
}

}  // namespace

torch::Tensor pack_panels(const torch::Tensor& w) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack_panels: w must be [N, K] float32");
    const int64_t n = w.size(0), k = w.size(1), nb = (n + kLanes - 1) / kLanes;
    auto padded = torch::zeros({nb * kLanes, k}, w.options());
    padded.narrow(0, 0, n).copy_(w);
    return padded.view({nb, kLanes, k}).transpose(1, 2).contiguous();
}

torch::Tensor panel_gemm(torch::Tensor x, const torch::Tensor& panels, int64_t n, std::optional<torch::Tensor> out) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "panel_gemm: x must be [M, K] float32");
    TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kFloat32 && panels.is_contiguous() &&
                    panels.size(2) == kLanes && panels.size(1) == x.size(1) && (n + kLanes - 1) / kLanes == panels.size(0),
                "panel_gemm: panels must come from pack_panels of a [N, K] weight with x's K");
    if (x.stride(1) != 1) x = x.contiguous();
    const int64_t m = x.size(0), k = x.size(1), nb = panels.size(0), ldx = x.stride(0);
    auto y = out.has_value() ? *out : torch::empty({m, n}, x.options());
    TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n && y.scalar_type() == torch::kFloat32 &&
                    y.stride(1) == 1, "panel_gemm: out must be [M, N] float32 with unit column stride");
    if (m == 0 || n == 0) return y;
    const float* xp = x.data_ptr<float>();
    const float* wp = panels.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t ldy = y.stride(0);
    const int64_t groups = (nb + kPanels - 1) / kPanels;
    team::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g) {
            const int64_t b = g * kPanels, col = b * kLanes, np = std::min<int64_t>(kPanels, nb - b);
            const float* w = wp + b * k * kLanes;
            for (int64_t m0 = 0; m0 < m; m0 += kRows) {
                const int rows = static_cast<int>(std::min<int64_t>(kRows, m - m0));
                const float* xr = xp + m0 * ldx;
                float* yr = yp + m0 * ldy + col;
                if (np == 3) tile_rows<3>(rows, xr, ldx, w, k, yr, ldy, n - col);
                else if (np == 2) tile_rows<2>(rows, xr, ldx, w, k, yr, ldy, n - col);
                else tile_rows<1>(rows, xr, ldx, w, k, yr, ldy, n - col);
            }
        }
    });
    return y;
}
