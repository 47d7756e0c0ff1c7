// bf16 projections over weights packed once at load into VNNI panels: on the AMX tile unit, or
// where the CPU has no AMX, with AVX512-BF16 dot products over the same panels (vec_gemm.cpp).
//
//   amx_available()                   whether this build and this kernel allow AMX tiles
//   bf16_gemm_available()             whether bf16_gemm and q4_gemm run here (AMX or AVX512-BF16)
//   pack_vnni(w [N, K])               -> panels [ceil(N/16), K'/2, 16, 2] (K' = K rounded up to 32; zero padding)
//   bf16_gemm(x [M, K], panels, N, out, amx) -> y [M, N] = x @ w^T in bf16, f32 accumulation (into out
//       when given); amx false: the vector path even where AMX is available (tests run both)
//   q4_gemm(x [M, K], nibbles, scales, mins, N, out, amx) -> the same over an int4 weight (groups of 32
//       along K, w = q * scale + min) packed by packed_weights.pack_q4_vnni: nibbles u8 [N/16, K/32, 256] (a
//       tile's 16 x 32 values in VNNI order, two a byte), scales and mins f32 [N/16, K/32, 16]. Panels
//       are dequantized to bf16 (the dense copy's values exactly) once per call, a ~512 KB chunk at
//       a time into a per-thread buffer that every 32-row block then reads: memory traffic is a
//       quarter of the dense copy's.
//
// A panel's 32-k slice is one B tile (16 k-pairs x 16 columns). A tile step covers 32 rows x 32
// columns: two A tiles (16 rows x 32 k of x, read in place), two B tiles, four f32 C tiles, so
// each weight tile serves 32 rows and each x tile 32 columns. Weight tiles are stream-loaded
// (they pass through L2 and would evict x's rows from L1), and each step's C tiles are written
// out as bf16 a few rows per k step of the next one, while the tile unit multiplies (together
// +15-30% at 1,024 rows). Work is split over column pairs of panels between torch's intra-op
// threads; each thread configures its own tiles and walks its panels in chunks of about 512 KB,
// every row block through one chunk before the next (a prefill's rows would otherwise stream
// the whole weight from memory once per 32 rows).
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>

#include "amx.h"
#include "q4.h"

#if DEEPFUSE_AMX
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

// tiles 0-3: C for (row half, panel) = (0,0) (0,1) (1,0) (1,1); 4, 5: A for the row halves; 6, 7: B
void configure(int rows0, int rows1) {
    const int r1 = rows1 > 0 ? rows1 : 1;
    configure_tiles({uint8_t(rows0), uint8_t(rows0), uint8_t(r1), uint8_t(r1), uint8_t(rows0), uint8_t(r1), 16, 16});
}

// A finished tile step's four f32 C tiles, written out to y as bf16 a few rows at a time while
// the next step's tile multiplies run (converting them all at once would leave the tile unit idle).
struct PendingRows {
    const float* acc = nullptr;  // [4][16 * 16]: the tiles (row half, panel) = (0,0) (0,1) (1,0) (1,1)
    at::BFloat16* y[4] = {};     // where each tile's first row goes
    int rows[4] = {};            // each tile's rows (0: absent)
    __mmask16 mask[4] = {};      // each tile's valid columns
    int64_t ldy = 0;
    int t = 4, r = 0;            // the next row to write: tile t, row r (t == 4: none left)

    void write(int count) {
        while (count > 0 && t < 4) {
            if (r >= rows[t]) {
                ++t;
                r = 0;
                continue;
            }
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_load_ps(acc + t * 256 + r * kCols));
            _mm256_mask_storeu_epi16(y[t] + r * ldy, mask[t], reinterpret_cast<__m256i>(v));
            ++r;
            --count;
        }
    }
};

constexpr int kRowsPerStep = 4;  // rows written per k step: 64 rows within 16 steps (K >= 512)

// Rows m0 .. m0+31 of x (r0 and r1 rows in its halves; tiles configured for them) times the
// panel pair w0, w1 (VNNI, depth kp, tile rows 64 bytes apart) into y's columns of panels b0, b1.
// The C tiles land in acc (the caller alternates two buffers) and become `pending`'s rows;
// the previous step's pending rows are written meanwhile.
void pair_step(const uint16_t* x0, int64_t ldx, int r0, int r1, const uint16_t* w0, const uint16_t* w1, int64_t kp,
               at::BFloat16* y, int64_t ldy, int64_t b0, int64_t b1, int64_t n, float* acc, PendingRows& pending) {
    const uint16_t* x1 = x0 + 16 * ldx;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < kp; kk += kDepth) {
        _tile_loadd(4, x0 + kk, ldx * 2);
        _tile_stream_loadd(6, w0 + kk * kCols, 64);  // weights stream from L2; x's rows stay in L1
        _tile_stream_loadd(7, w1 + kk * kCols, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (r1) {
            _tile_loadd(5, x1 + kk, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        pending.write(kRowsPerStep);
    }
    pending.write(64);
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    if (r1) {
        _tile_stored(2, acc + 512, 64);
        _tile_stored(3, acc + 768, 64);
    }
    pending.acc = acc;
    pending.ldy = ldy;
    for (int t = 0; t < 4; ++t) {
        const int64_t b = t % 2 ? b1 : b0, cols = std::min<int64_t>(kCols, n - b * kCols);
        pending.rows[t] = (t / 2 ? r1 : r0) * (t % 2 == 0 || b1 != b0);
        pending.y[t] = y + 16 * (t / 2) * ldy + b * kCols;
        pending.mask[t] = cols >= kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
    }
    pending.t = 0;
    pending.r = 0;
}

// Configures the tiles for the row block at m0 when its shape differs from the last one's.
void configure_rows(int64_t m, int64_t m0, int& r0, int& r1, int& shape) {
    r0 = static_cast<int>(std::min<int64_t>(16, m - m0));
    r1 = static_cast<int>(std::clamp<int64_t>(m - m0 - 16, 0, 16));
    if (r0 * 17 + r1 != shape) {
        configure(r0, r1);
        shape = r0 * 17 + r1;
    }
}

#endif

}  // namespace

// vec_gemm.cpp: the AVX512-BF16 path over the same panels and int4 tiles
void vec_gemm_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* panels, int64_t kp, int64_t nb, int64_t n,
                   at::BFloat16* y, int64_t ldy);
void vec_q4_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* nibbles, const float* scales,
                 const float* mins, int64_t groups, int64_t nb, int64_t n, at::BFloat16* y, int64_t ldy);

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

bool bf16_gemm_available() { return kBf16DotBuilt; }  // AMX builds have AVX512-BF16 too

torch::Tensor bf16_gemm(torch::Tensor x, const torch::Tensor& panels, int64_t n, std::optional<torch::Tensor> out,
                        bool amx) {
    TORCH_CHECK(bf16_gemm_available(), "bf16_gemm: this build has neither AMX nor AVX512-BF16");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "bf16_gemm: x must be [M, K] bfloat16");
    TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == torch::kBFloat16 && panels.is_contiguous() &&
                    panels.size(2) == kCols && panels.size(3) == 2 && panels.size(1) * 2 % kDepth == 0 &&
                    panels.size(1) * 2 - x.size(1) >= 0 && panels.size(1) * 2 - x.size(1) < kDepth &&
                    (n + kCols - 1) / kCols == panels.size(0),
                "bf16_gemm: panels must come from pack_vnni of a [N, K] weight with x's K");
    const int64_t m = x.size(0), kp = panels.size(1) * 2, nb = panels.size(0);
    auto y = out.has_value() ? *out : torch::empty({m, n}, x.options());
    TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n && y.scalar_type() == torch::kBFloat16 &&
                    y.stride(1) == 1, "bf16_gemm: out must be [M, N] bfloat16 with unit column stride");
    if (m == 0 || n == 0) return y;
    if (x.size(1) != kp || x.stride(1) != 1) x = torch::constant_pad_nd(x, {0, kp - x.size(1)}).contiguous();
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
    auto* yp = y.data_ptr<at::BFloat16>();
    if (!(amx && amx_available())) {
        vec_gemm_rows(xp, x.stride(0), m, wp, kp, nb, n, yp, y.stride(0));
        return y;
    }
#if DEEPFUSE_AMX
    const int64_t ldx = x.stride(0), ldy = y.stride(0), pairs = (nb + 1) / 2;
    // weight panels in chunks of about 512 KB (they stay in L2 while every row block passes)
    const int64_t chunk = std::max<int64_t>(1, (512 << 10) / (2 * kp * kCols * 2));
    team::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
        int shape = -1;
        alignas(64) float acc[2][4 * 256];
        PendingRows pending;
        int flip = 0;
        for (int64_t c0 = begin; c0 < end; c0 += chunk)
            for (int64_t m0 = 0; m0 < m; m0 += 32) {
                int r0, r1;
                configure_rows(m, m0, r0, r1, shape);
                for (int64_t p = c0; p < std::min(end, c0 + chunk); ++p) {
                    const int64_t b0 = 2 * p, b1 = std::min(b0 + 1, nb - 1);  // an odd last panel pairs with itself
                    pair_step(xp + m0 * ldx, ldx, r0, r1, wp + b0 * kp * kCols, wp + b1 * kp * kCols, kp,
                              yp + m0 * ldy, ldy, b0, b1, n, acc[flip ^= 1], pending);
                }
            }
        pending.write(64);
        _tile_release();
    });
#endif
    return y;
}

torch::Tensor q4_gemm(torch::Tensor x, const torch::Tensor& nibbles, const torch::Tensor& scales,
                      const torch::Tensor& mins, int64_t n, std::optional<torch::Tensor> out, bool amx) {
    TORCH_CHECK(bf16_gemm_available(), "q4_gemm: this build has neither AMX nor AVX512-BF16");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "q4_gemm: x must be [M, K] bfloat16");
    TORCH_CHECK(nibbles.dim() == 3 && nibbles.scalar_type() == torch::kUInt8 && nibbles.is_contiguous() &&
                    nibbles.size(2) == 256 && nibbles.size(1) * kDepth == x.size(1) &&
                    nibbles.size(0) == (n + kCols - 1) / kCols,
                "q4_gemm: nibbles must come from pack_q4_vnni of a [N, K] weight with x's K");
    for (const auto* t : {&scales, &mins})
        TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 &&
                        t->size(0) == nibbles.size(0) && t->size(1) == nibbles.size(1) && t->size(2) == kCols,
                    "q4_gemm: scales and mins must be f32 [N/16, K/32, 16]");
    const int64_t m = x.size(0), nb = nibbles.size(0), groups = nibbles.size(1), kp = groups * kDepth;
    auto y = out.has_value() ? *out : torch::empty({m, n}, x.options());
    TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n && y.scalar_type() == torch::kBFloat16 &&
                    y.stride(1) == 1, "q4_gemm: out must be [M, N] bfloat16 with unit column stride");
    if (m == 0 || n == 0) return y;
    if (x.stride(1) != 1) x = x.contiguous();
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const uint8_t* np = nibbles.data_ptr<uint8_t>();
    const float* sp = scales.data_ptr<float>();
    const float* mp = mins.data_ptr<float>();
    auto* yp = y.data_ptr<at::BFloat16>();
    if (!(amx && amx_available())) {
        vec_q4_rows(xp, x.stride(0), m, np, sp, mp, groups, nb, n, yp, y.stride(0));
        return y;
    }
#if DEEPFUSE_AMX
    const int64_t ldx = x.stride(0), ldy = y.stride(0), pairs = (nb + 1) / 2;
    // panel pairs in chunks of about 512 KB of bf16, each dequantized once per call into a
    // per-thread buffer that every 32-row block then passes through (as bf16_gemm walks its chunks)
    const int64_t chunk = std::max<int64_t>(1, (512 << 10) / (2 * kp * kCols * 2));
    team::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
        const int64_t span = std::min(chunk, end - begin);
        auto* w = static_cast<uint16_t*>(std::aligned_alloc(64, span * 2 * kp * kCols * sizeof(uint16_t)));
        int shape = -1;
        alignas(64) float acc[2][4 * 256];
        PendingRows pending;
        int flip = 0;
        for (int64_t c0 = begin; c0 < end; c0 += chunk) {
            const int64_t c1 = std::min(end, c0 + chunk);
            for (int64_t p = c0; p < c1; ++p)
                for (int64_t half = 0; half < 2; ++half) {
                    const int64_t b = std::min(2 * p + half, nb - 1);  // an odd last panel pairs with itself
                    for (int64_t g = 0; g < groups; ++g)
                        dequant_tile(np + (b * groups + g) * 256, sp + (b * groups + g) * kCols,
                                     mp + (b * groups + g) * kCols, w + ((2 * (p - c0) + half) * groups + g) * 512);
                }
            for (int64_t m0 = 0; m0 < m; m0 += 32) {
                int r0, r1;
                configure_rows(m, m0, r0, r1, shape);
                for (int64_t p = c0; p < c1; ++p) {
                    const uint16_t* w0 = w + 2 * (p - c0) * kp * kCols;
                    pair_step(xp + m0 * ldx, ldx, r0, r1, w0, w0 + kp * kCols, kp, yp + m0 * ldy, ldy, 2 * p,
                              std::min(2 * p + 1, nb - 1), n, acc[flip ^= 1], pending);
                }
            }
        }
        pending.write(64);
        _tile_release();
        std::free(w);
    });
#endif
    return y;
}
