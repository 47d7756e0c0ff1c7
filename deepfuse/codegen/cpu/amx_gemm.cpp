// bf16 projections on the AMX tile unit, over weights packed once at load into VNNI panels.
//
//   amx_available()                   whether this build and this kernel allow AMX tiles
//   pack_vnni(w [N, K])               -> panels [ceil(N/16), K'/2, 16, 2] (K' = K rounded up to 32; zero padding)
//   amx_gemm(x [M, K], panels, N, out) -> y [M, N] = x @ w^T in bf16, f32 accumulation (into out when given)
//
// A panel's 32-k slice is one B tile (16 k-pairs x 16 columns). A tile step covers 32 rows x 32
// columns: two A tiles (16 rows x 32 k of x, read in place), two B tiles, four f32 C tiles, so
// each weight tile serves 32 rows and each x tile 32 columns. Work is split over column pairs
// of panels between torch's intra-op threads; each thread configures its own tiles and walks
// its panels in chunks of about 512 KB, every row block through one chunk before the next
// (a prefill's rows would otherwise stream the whole weight from memory once per 32 rows).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define DEEPFUSE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kCols = 16;  // columns per panel
constexpr int64_t kDepth = 32;  // k per tile step

#if DEEPFUSE_AMX
bool permitted() {  // Linux hands out the tile state only on request, once per process
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tiles 0-3: C for (row half, panel) = (0,0) (0,1) (1,0) (1,1); 4, 5: A for the row halves; 6, 7: B
void configure(int rows0, int rows1) {
    TileConfig c;
    const int r1 = rows1 > 0 ? rows1 : 1;
    const uint8_t rows[8] = {uint8_t(rows0), uint8_t(rows0), uint8_t(r1), uint8_t(r1),
                             uint8_t(rows0), uint8_t(r1), 16, 16};
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = rows[t];
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

void store_rows(const float* tile, int rows, at::BFloat16* y, int64_t ldy, int64_t cols) {
    const __mmask16 mask = cols >= kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
    for (int r = 0; r < rows; ++r) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_load_ps(tile + r * kCols));
        _mm256_mask_storeu_epi16(y + r * ldy, mask, reinterpret_cast<__m256i>(v));
    }
}
#endif

}  // namespace

bool amx_available() {
#if DEEPFUSE_AMX
    return permitted();
#else
    return false;
#endif
}

torch::Tensor pack_vnni(const torch::Tensor& w) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack_vnni: w must be [N, K] bfloat16");
    const int64_t n = w.size(0), k = w.size(1), nb = (n + kCols - 1) / kCols, kp = (k + kDepth - 1) / kDepth * kDepth;
    auto padded = torch::zeros({nb * kCols, kp}, w.options());
    padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
    return padded.view({nb, kCols, kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor amx_gemm(torch::Tensor x, const torch::Tensor& panels, int64_t n, std::optional<torch::Tensor> out) {
    TORCH_CHECK(amx_available(), "amx_gemm: no AMX on this machine or in this build");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "amx_gemm: x must be [M, K] bfloat16");
    TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == torch::kBFloat16 && panels.is_contiguous() &&
                    panels.size(2) == kCols && panels.size(3) == 2 && panels.size(1) * 2 % kDepth == 0 &&
                    panels.size(1) * 2 - x.size(1) >= 0 && panels.size(1) * 2 - x.size(1) < kDepth &&
                    (n + kCols - 1) / kCols == panels.size(0),
                "amx_gemm: panels must come from pack_vnni of a [N, K] weight with x's K");
    const int64_t m = x.size(0), kp = panels.size(1) * 2, nb = panels.size(0);
    auto y = out.has_value() ? *out : torch::empty({m, n}, x.options());
    TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n && y.scalar_type() == torch::kBFloat16 &&
                    y.stride(1) == 1, "amx_gemm: out must be [M, N] bfloat16 with unit column stride");
    if (m == 0 || n == 0) return y;
    if (x.size(1) != kp || x.stride(1) != 1) x = torch::constant_pad_nd(x, {0, kp - x.size(1)}).contiguous();
#if DEEPFUSE_AMX
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
    auto* yp = y.data_ptr<at::BFloat16>();
    const int64_t ldx = x.stride(0), ldy = y.stride(0), pairs = (nb + 1) / 2;
    // weight panels in chunks of about 512 KB (they stay in L2 while every row block passes)
    const int64_t chunk = std::max<int64_t>(1, (512 << 10) / (2 * kp * kCols * 2));
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
        alignas(64) float acc[4][16 * kCols];
        int shape0 = -1, shape1 = -1;
        for (int64_t c0 = begin; c0 < end; c0 += chunk)
        for (int64_t m0 = 0; m0 < m; m0 += 32) {
            const int r0 = static_cast<int>(std::min<int64_t>(16, m - m0));
            const int r1 = static_cast<int>(std::clamp<int64_t>(m - m0 - 16, 0, 16));
            if (r0 != shape0 || r1 != shape1) {
                configure(r0, r1);
                shape0 = r0;
                shape1 = r1;
            }
            const uint16_t* x0 = xp + m0 * ldx;
            const uint16_t* x1 = x0 + 16 * ldx;
            for (int64_t p = c0; p < std::min(end, c0 + chunk); ++p) {
                const int64_t b0 = 2 * p, b1 = std::min(b0 + 1, nb - 1);  // an odd last panel pairs with itself
                const uint16_t* w0 = wp + b0 * kp * kCols;
                const uint16_t* w1 = wp + b1 * kp * kCols;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kk = 0; kk < kp; kk += kDepth) {
                    _tile_loadd(4, x0 + kk, ldx * 2);
                    _tile_loadd(6, w0 + kk * kCols, 64);
                    _tile_loadd(7, w1 + kk * kCols, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (r1) {
                        _tile_loadd(5, x1 + kk, ldx * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, acc[0], 64);
                _tile_stored(1, acc[1], 64);
                if (r1) {
                    _tile_stored(2, acc[2], 64);
                    _tile_stored(3, acc[3], 64);
                }
                for (int half = 0; half < (r1 ? 2 : 1); ++half)
                    for (int64_t b = b0; b <= b1; ++b)
                        store_rows(acc[half * 2 + (b - b0)], half ? r1 : r0, yp + (m0 + 16 * half) * ldy + b * kCols,
                                   ldy, n - b * kCols);
            }
        }
        _tile_release();
    });
#endif
    return y;
}
