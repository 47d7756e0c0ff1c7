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
// Work items are (chunk of panels, slab of rows): a chunk holds about 256 KB of weights (L2) and
// every 6-row block of the slab passes through it (x's block stays in L1). Rows are cut into
// slabs only where the chunks alone are too few for every thread to get several items (N = 576
// is 3 chunks: 2 threads would split them 2:1). Consecutive items share a chunk; an int4 chunk
// is dequantized into a per-thread buffer when a thread first takes it, to the dense copy's values.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "amx.h"
#include "balanced.h"
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

// micro<rows, panels> for rows 1..kRows, panels 1..kPanels. Switches, not a two-level constexpr
// table of variable templates, which GCC 12 at -O3 -march=sapphirerapids read wrongly in
// i8_gemm.cpp (a 2-panel tile called for one panel).
using MicroFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, at::BFloat16*, int64_t, int64_t);
template <int P>
MicroFn micro_rows(int64_t rows) {
    static_assert(kRows == 6 && kPanels == 4, "micro_rows and micro_for spell out every tile");
    switch (rows) {
        case 1: return micro<1, P>;
        case 2: return micro<2, P>;
        case 3: return micro<3, P>;
        case 4: return micro<4, P>;
        case 5: return micro<5, P>;
        default: return micro<6, P>;
    }
}

MicroFn micro_for(int64_t rows, int64_t panels) {
    switch (panels) {
        case 1: return micro_rows<1>(rows);
        case 2: return micro_rows<2>(rows);
        case 3: return micro_rows<3>(rows);
        default: return micro_rows<4>(rows);
    }
}

// Rows r0 .. r1-1 of x through panels b0 .. b1-1 (at w, kp * 16 elements apart) into y's columns from 16 * b0.
void through_panels(const uint16_t* x, int64_t ldx, int64_t r0, int64_t r1, const uint16_t* w, int64_t kp, int64_t b0,
                    int64_t b1, int64_t n, at::BFloat16* y, int64_t ldy) {
    for (int64_t m0 = r0; m0 < r1; m0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, r1 - m0);
        for (int64_t b = b0; b < b1; b += kPanels) {
            const int64_t np = std::min<int64_t>(kPanels, b1 - b);
            micro_for(rows, np)(x + m0 * ldx, ldx, w + (b - b0) * kp * kCols, kp, y + m0 * ldy + b * kCols, ldy,
                                n - b * kCols);
        }
    }
}

// The (chunk, slab) items of an [M, K'] x [K', 16 NB] product.
struct Split {
    int64_t chunk;  // panels per chunk (a multiple of kPanels holding about kChunkBytes of bf16)
    int64_t chunks, slab, slabs;  // slab: rows per slab (a multiple of kRows)

    Split(int64_t m, int64_t nb, int64_t kp) {
        chunk = std::max<int64_t>(1, kChunkBytes / (kPanels * kp * kCols * 2)) * kPanels;
        chunks = (nb + chunk - 1) / chunk;
        const int64_t want = 8 * team::threads(), blocks = (m + kRows - 1) / kRows;
        const int64_t cuts = std::clamp<int64_t>((want + chunks - 1) / chunks, 1, std::max<int64_t>(1, blocks));
        slab = std::max<int64_t>(1, (blocks + cuts - 1) / cuts) * kRows;
        slabs = (m + slab - 1) / slab;
    }
};

// Runs every item of `split`, split between threads by work (balanced.h; a last chunk of few
// panels is a small item). panels() makes a thread's source of chunks, called as (c, b0, b1) for
// chunk c's panels b0 .. b1-1 (the weight itself, or a buffer the int4 weight is decoded into).
template <typename Panels>
void run_items(const Split& split, const uint16_t* x, int64_t ldx, int64_t m, int64_t kp, int64_t nb, int64_t n,
               at::BFloat16* y, int64_t ldy, const Panels& panels) {
    using Source = decltype(panels());
    std::vector<std::optional<Source>> sources(team::threads());  // each thread's, made on its first item
    auto cost = [&](int64_t item) {
        const int64_t c = item / split.slabs, s = item % split.slabs;
        return (std::min(nb, (c + 1) * split.chunk) - c * split.chunk) *
               (std::min(m, (s + 1) * split.slab) - s * split.slab);
    };
    balanced::balanced_for(split.chunks * split.slabs, cost, [&](int64_t item, int64_t) {
        auto& source = sources[at::get_thread_num()];
        if (!source) source.emplace(panels());
        const int64_t c = item / split.slabs, s = item % split.slabs;
        const int64_t b0 = c * split.chunk, b1 = std::min(nb, b0 + split.chunk);
        through_panels(x, ldx, s * split.slab, std::min(m, (s + 1) * split.slab), (*source)(c, b0, b1), kp, b0, b1, n,
                       y, ldy);
    });
}

// A thread's dequantized int4 chunk: chunk c decoded into its buffer when first asked for.
struct Q4Chunk {
    const uint8_t* nibbles;
    const float *scales, *mins;
    int64_t groups;
    std::unique_ptr<uint16_t, decltype(&std::free)> buf;
    int64_t held = -1;

    Q4Chunk(const uint8_t* nibbles, const float* scales, const float* mins, int64_t groups, int64_t panels)
        : nibbles(nibbles), scales(scales), mins(mins), groups(groups),
          buf(static_cast<uint16_t*>(std::aligned_alloc(64, panels * groups * 512 * 2)), &std::free) {}

    const uint16_t* operator()(int64_t c, int64_t b0, int64_t b1) {
        if (c != held) {
            for (int64_t b = b0; b < b1; ++b)
                for (int64_t g = 0; g < groups; ++g)
                    dequant_tile(nibbles + (b * groups + g) * 256, scales + (b * groups + g) * kCols,
                                 mins + (b * groups + g) * kCols, buf.get() + ((b - b0) * groups + g) * 512);
            held = c;
        }
        return buf.get();
    }
};
#endif

}  // namespace

void vec_gemm_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* panels, int64_t kp, int64_t nb, int64_t n,
                   at::BFloat16* y, int64_t ldy) {
#if DEEPFUSE_BF16_DOT
    const Split split(m, nb, kp);
    run_items(split, x, ldx, m, kp, nb, n, y, ldy, [&] {
        return [&](int64_t, int64_t b0, int64_t) { return panels + b0 * kp * kCols; };
    });
#else
    TORCH_CHECK(false, "vec_gemm_rows: this build has no AVX512-BF16");
#endif
}

void vec_q4_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* nibbles, const float* scales,
                 const float* mins, int64_t groups, int64_t nb, int64_t n, at::BFloat16* y, int64_t ldy) {
#if DEEPFUSE_BF16_DOT
    const int64_t kp = groups * 32;
    const Split split(m, nb, kp);
    run_items(split, x, ldx, m, kp, nb, n, y, ldy, [&] {
        return Q4Chunk(nibbles, scales, mins, groups, std::min(split.chunk, nb));
    });
#else
    TORCH_CHECK(false, "vec_q4_rows: this build has no AVX512-BF16");
#endif
}
