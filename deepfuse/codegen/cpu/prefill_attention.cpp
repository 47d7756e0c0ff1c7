// Causal prefill attention in bf16 on AMX tiles, or with AVX512-BF16 dot products where the CPU
// has no AMX (AMD Zen 4), keys and values read from the paged cache: every prompt chunk of a step
// in one call, flash-style (an online softmax over chunks of 64 keys).
//
//   q       [T, H*D] bf16      the step's query rows (roped)
//   cache   [2, NB, BS, Hkv, D] the layer's paged k/v cache, this step's rows already written: bf16,
//           or int8 rows [.., D + 4] that end in their f32 scale: packed as their integers (exact in
//           bf16), each key's scale applied to its scores and each value's to its softmax weights
//   tables  [S, B] int64       each chunk's sequence's block ids
//   rows    [S] int64          each chunk's first row in q and out
//   qlens   [S] int64          its number of query rows n; they sit at positions len-n .. len-1
//   lens    [S] int64          its sequence's length after this step (keys 0 .. len-1)
//   window  0, or each query sees only the `window` positions up to its own
//   out     [T, H*D] bf16      the chunks' rows written (others left alone)
//   amx     false: the vector path even where AMX tiles are available (tests run both)
//
// Per (chunk, kv head) the keys are packed once as VNNI B tiles of K^T (16 keys x 32 dims each,
// by gathers) and the values as B tiles of V (32 keys x 16 dims, key pairs interleaved); every
// query head of the group and every block of 16 query rows then reads them. Per (chunk, query
// head, 16-row block): for each 64-key chunk up to the block's last position, S = Q K^T into four
// f32 tiles, the softmax in AVX-512 (f32; P rounded to bf16 for the second product, as flash
// kernels do), O = O * alpha + P V with P V from four tiles per 64 output dims. Without AMX the
// two products run as vdpbf16ps over the same packed layouts (a tile row is one 16-lane vector:
// 16 keys x a dim pair for S, 16 dims x a key pair for P V), a few query rows at a time sharing
// each loaded vector; the softmax and the rounding of P are the same code.
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "balanced.h"

#if DEEPFUSE_BF16_DOT
#include "vec.h"
#endif

namespace {

#if DEEPFUSE_BF16_DOT
constexpr int64_t kChunk = 64;  // keys per softmax step: four 16-key tiles of S
constexpr int64_t kMaxD = 256;  // the largest head size (64, 128 or 256)

// The packed keys and values of one (chunk, kv head): padded to a multiple of kChunk keys (zeros).
struct Packed {
    const uint16_t* kt;  // [keys/16][D/32] tiles of 16 rows (dim pairs) x 16 keys x 2
    const uint16_t* vv;  // [keys/32][D/16] tiles of 16 rows (key pairs) x 16 dims x 2
    const float* ks;     // int8 rows: each key's scale [keys] (nullptr: bf16 rows, scale 1)
    const float* vs;     // int8 rows: each value's scale [keys]
};

// Position p's row of kv head `kv` in one half of the cache (k or v) as d bf16 values in dst: a
// copy of a bf16 row, or an int8 row's integers (exact in bf16) with its scale put in *scale.
template <typename C>
inline void stage_row(const C* half, const int64_t* table, int64_t p, int64_t bs, int64_t hkv, int64_t kv, int64_t d,
                      uint16_t* dst, float* scale) {
    constexpr bool int8 = std::is_same_v<C, int8_t>;
    const int64_t width = int8 ? d + 4 : d;
    const C* src = half + ((table[p / bs] * bs + p % bs) * hkv + kv) * width;
    if constexpr (int8) {
        std::memcpy(scale, src + d, sizeof(float));
        for (int64_t v = 0; v < d / 16; ++v) store16(reinterpret_cast<c10::BFloat16*>(dst) + 16 * v, load16(src + 16 * v));
    } else {
        std::memcpy(dst, src, d * 2);
    }
}

// Packs keys and values 0 .. len-1 of kv head `kv` (positions through the block table; k and v:
// the cache's two halves, bf16 rows (C uint16_t) or int8 rows (C int8_t), whose scales go to
// ks and vs [padded], 0 past len).
template <typename C>
void pack_kv(const C* k, const C* v, const int64_t* table, int64_t len, int64_t padded, int64_t bs,
             int64_t hkv, int64_t kv, int64_t d, uint16_t* kt, uint16_t* vv, float* ks, float* vs) {
    alignas(64) uint16_t stage[32 * kMaxD];
    // rows k0 .. k0+count-1 of one half into stage (zeros, and scale 0, past len)
    auto stage_rows = [&](const C* half, float* scales, int64_t k0, int64_t count) {
        float unused;
        for (int64_t i = 0; i < count; ++i) {
            if (k0 + i < len) {
                stage_row(half, table, k0 + i, bs, hkv, kv, d, stage + i * d, scales ? scales + k0 + i : &unused);
            } else {
                std::memset(stage + i * d, 0, d * 2);
                if (scales) scales[k0 + i] = 0.f;
            }
        }
    };
    const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(d / 2)));
    for (int64_t k0 = 0; k0 < padded; k0 += 16) {  // K^T: tile (block, piece) row r = dim pair 16*piece + r of 16 keys
        stage_rows(k, ks, k0, 16);
        for (int64_t t = 0; t < d / 32; ++t)
            for (int64_t r = 0; r < 16; ++r) {
                const __m512i dw = _mm512_i32gather_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(16 * t + r)),
                                                          stage, 4);
                _mm512_store_si512(kt + ((k0 / 16 * (d / 32) + t) * 16 + r) * 32, dw);
            }
    }
    for (int64_t k0 = 0; k0 < padded; k0 += 32) {  // V: tile (pair block, column block) row r = keys 2r, 2r+1
        stage_rows(v, vs, k0, 32);
        for (int64_t c = 0; c < d / 16; ++c)
            for (int64_t r = 0; r < 16; ++r) {
                const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(stage + 2 * r * d + 16 * c));
                const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(stage + (2 * r + 1) * d + 16 * c));
                const __m512i dw = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                                   _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
                _mm512_store_si512(vv + ((k0 / 32 * (d / 16) + c) * 16 + r) * 32, dw);
            }
    }
}

#if DEEPFUSE_AMX
// S tiles 0-3 = Q (tile rows of qbuf, d/32 pieces) times the four K^T tiles of a 64-key chunk.
void scores(const uint16_t* qbuf, const uint16_t* kt, int64_t d, float* s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t pieces = d / 32;
    for (int64_t t = 0; t < pieces; ++t) {
        _tile_loadd(4, qbuf + 32 * t, d * 2);
        _tile_loadd(6, kt + (0 * pieces + t) * 512, 64);
        _tile_loadd(7, kt + (1 * pieces + t) * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, kt + (2 * pieces + t) * 512, 64);
        _tile_loadd(7, kt + (3 * pieces + t) * 512, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, s, kChunk * 4);
    _tile_stored(1, s + 16, kChunk * 4);
    _tile_stored(2, s + 32, kChunk * 4);
    _tile_stored(3, s + 48, kChunk * 4);
}

// pv [16, 64] = P (bf16 [16, 64 keys]) times the values of the chunk, output dims 64*g .. 64*g+63.
void values(const uint16_t* p, const uint16_t* vv, int64_t d, int64_t g, float* pv) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t cols = d / 16;
    for (int64_t h = 0; h < 2; ++h) {  // keys 32h .. 32h+31
        _tile_loadd(4, p + 32 * h, kChunk * 2);
        const uint16_t* base = vv + (h * cols + 4 * g) * 512;
        _tile_loadd(6, base, 64);
        _tile_loadd(7, base + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, base + 1024, 64);
        _tile_loadd(7, base + 1536, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, pv, 64 * 4);
    _tile_stored(1, pv + 16, 64 * 4);
    _tile_stored(2, pv + 32, 64 * 4);
    _tile_stored(3, pv + 48, 64 * 4);
}

#endif

// The vector products: R query rows at a time (R * 4 accumulators; each loaded key or value
// vector serves R rows). A query's or P's dim or key pair is one 32-bit broadcast.
template <int R>
void scores_rows(const uint16_t* q, int64_t d, const uint16_t* kt, float* s) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    const int64_t pieces = d / 32;
    for (int64_t j = 0; j < d / 2; ++j) {  // dim pair j: row j % 16 of piece j / 16 of each key tile
        const uint16_t* base = kt + ((j / 16) * 16 + j % 16) * 32;
        __m512bh k[4];
        for (int v = 0; v < 4; ++v) k[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(base + v * pieces * 512));
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, q + r * d + 2 * j, 4);
            const __m512bh qb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
            for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qb, k[v]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) _mm512_store_ps(s + r * kChunk + 16 * v, acc[r][v]);
}

template <int R>
void values_rows(const uint16_t* p, const uint16_t* vv, int64_t d, int64_t g, float* pv) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t cols = d / 16;
    for (int64_t j = 0; j < kChunk / 2; ++j) {  // key pair j: row j % 16 of key half j / 16
        const uint16_t* base = vv + ((j / 16) * cols + 4 * g) * 512 + (j % 16) * 32;
        __m512bh v[4];
        for (int c = 0; c < 4; ++c) v[c] = reinterpret_cast<__m512bh>(_mm512_load_si512(base + c * 512));
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, p + r * kChunk + 2 * j, 4);
            const __m512bh pb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, v[c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(pv + r * 64 + 16 * c, acc[r][c]);
}

constexpr int kVecRows = 6;  // 24 accumulators and 4 loaded vectors of the 32 registers

// scores() and values() for the first nq rows of the block, kVecRows rows at a time (the last
// run through the instance for the rows left).
using ScoresFn = void (*)(const uint16_t*, int64_t, const uint16_t*, float*);
using ValuesFn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, float*);
constexpr ScoresFn kScores[kVecRows] = {scores_rows<1>, scores_rows<2>, scores_rows<3>,
                                        scores_rows<4>, scores_rows<5>, scores_rows<6>};
constexpr ValuesFn kValues[kVecRows] = {values_rows<1>, values_rows<2>, values_rows<3>,
                                        values_rows<4>, values_rows<5>, values_rows<6>};

void scores_vec(int64_t nq, const uint16_t* qbuf, const uint16_t* kt, int64_t d, float* s) {
    for (int64_t r = 0; r < nq; r += kVecRows)
        kScores[std::min<int64_t>(kVecRows, nq - r) - 1](qbuf + r * d, d, kt, s + r * kChunk);
}

void values_vec(int64_t nq, const uint16_t* p, const uint16_t* vv, int64_t d, int64_t g, float* pv) {
    for (int64_t r = 0; r < nq; r += kVecRows)
        kValues[std::min<int64_t>(kVecRows, nq - r) - 1](p + r * kChunk, vv, d, g, pv + r * 64);
}

// One block of up to 16 query rows of one head: rows q0 .. q0+nq-1 of q (positions pos0 ..),
// against the packed keys and values of its kv head; writes its rows of out. Tiles: the products
// on AMX tiles (this thread's tiles configured), else in vector registers.
template <bool Tiles>
void attend_block(const at::BFloat16* q, at::BFloat16* out, int64_t ld, int64_t head, int64_t q0, int64_t nq,
                  int64_t pos0, const Packed& kv, int64_t d, int64_t window, float scale) {
    alignas(64) uint16_t qbuf[16 * kMaxD];
    alignas(64) uint16_t p[16 * kChunk];
    alignas(64) float s[16 * kChunk];
    alignas(64) float pv[16 * 64];
    alignas(64) float o[16 * kMaxD];
    float m[16], l[16], alpha[16];
    for (int64_t i = 0; i < 16; ++i) {
        if (i < nq)
            std::memcpy(qbuf + i * d, q + (q0 + i) * ld + head * d, d * 2);
        else
            std::memset(qbuf + i * d, 0, d * 2);
        m[i] = -std::numeric_limits<float>::infinity();
        l[i] = 0.f;
    }
    std::memset(o, 0, sizeof(float) * 16 * d);
    const int64_t last = pos0 + nq - 1;  // the block's last position: no key after it is seen
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t k0 = lo / kChunk * kChunk; k0 <= last; k0 += kChunk) {
#if DEEPFUSE_AMX
        if constexpr (Tiles) scores(qbuf, kv.kt + k0 / 16 * (d / 32) * 512, d, s); else
#endif
        scores_vec(nq, qbuf, kv.kt + k0 / 16 * (d / 32) * 512, d, s);
        for (int64_t i = 0; i < 16; ++i) {
            if (i >= nq) {
                std::memset(p + i * kChunk, 0, kChunk * 2);
                alpha[i] = 1.f;
                continue;
            }
            const int64_t pos = pos0 + i, first = window > 0 ? pos - window + 1 : 0;
            __m512 sv[4];
            __mmask16 live[4];
            __m512 top = _mm512_set1_ps(m[i]);
            for (int v = 0; v < 4; ++v) {
                const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(k0 + 16 * v)));
                live[v] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos))) &
                          _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(first)));
                sv[v] = _mm512_mul_ps(_mm512_load_ps(s + i * kChunk + 16 * v), _mm512_set1_ps(scale));
                if (kv.ks) sv[v] = _mm512_mul_ps(sv[v], _mm512_loadu_ps(kv.ks + k0 + 16 * v));
                top = _mm512_mask_max_ps(top, live[v], top, sv[v]);
            }
            const float mx = _mm512_reduce_max_ps(top);
            if (mx == -std::numeric_limits<float>::infinity()) {  // nothing seen yet (a window's start)
                std::memset(p + i * kChunk, 0, kChunk * 2);
                alpha[i] = 1.f;
                continue;
            }
            __m512 sum = _mm512_setzero_ps(), w[4];
            for (int v = 0; v < 4; ++v) {
                w[v] = _mm512_maskz_mov_ps(live[v], exp16(_mm512_sub_ps(sv[v], _mm512_set1_ps(mx))));
                sum = _mm512_add_ps(sum, w[v]);
            }
            alpha[i] = std::exp(m[i] - mx);  // 0 on the first chunk seen (m = -inf)
            l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(sum);
            m[i] = mx;
            if (kv.vs)  // int8 values: each weight times its value's scale, P V over the integers
                for (int v = 0; v < 4; ++v) w[v] = _mm512_mul_ps(w[v], _mm512_loadu_ps(kv.vs + k0 + 16 * v));
            _mm512_store_si512(p + i * kChunk, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[1], w[0])));
            _mm512_store_si512(p + i * kChunk + 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[3], w[2])));
        }
        for (int64_t g = 0; g < d / 64; ++g) {
#if DEEPFUSE_AMX
            if constexpr (Tiles) values(p, kv.vv + k0 / 32 * (d / 16) * 512, d, g, pv); else
#endif
            values_vec(nq, p, kv.vv + k0 / 32 * (d / 16) * 512, d, g, pv);
            for (int64_t i = 0; i < nq; ++i) {
                const __m512 a = _mm512_set1_ps(alpha[i]);
                float* oi = o + i * d + 64 * g;
                for (int v = 0; v < 4; ++v)
                    _mm512_store_ps(oi + 16 * v, _mm512_fmadd_ps(_mm512_load_ps(oi + 16 * v), a,
                                                                 _mm512_load_ps(pv + i * 64 + 16 * v)));
            }
        }
    }
    for (int64_t i = 0; i < nq; ++i) {
        const __m512 inv = _mm512_set1_ps(l[i] > 0.f ? 1.f / l[i] : 0.f);
        at::BFloat16* dst = out + (q0 + i) * ld + head * d;
        for (int64_t v = 0; v < d / 16; ++v) store16(dst + 16 * v, _mm512_mul_ps(_mm512_load_ps(o + i * d + 16 * v), inv));
    }
}
#endif

}  // namespace

bool paged_prefill_available() { return kBf16DotBuilt; }

void paged_prefill(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
                   const torch::Tensor& rows, const torch::Tensor& qlens, const torch::Tensor& lens, int64_t num_heads,
                   int64_t window, double scale, torch::Tensor out, bool amx) {
    TORCH_CHECK(paged_prefill_available(), "paged_prefill: this build has no AVX512-BF16 (nor AMX)");
    const bool int8 = cache.scalar_type() == torch::kInt8;
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && (int8 || cache.scalar_type() == torch::kBFloat16) &&
                    out.scalar_type() == torch::kBFloat16, "paged_prefill: q and out must be bfloat16, the cache bf16 or int8");
    TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && out.is_contiguous() && tables.dim() == 2 &&
                    tables.stride(1) == 1, "paged_prefill: operands must be contiguous (tables: along a row)");
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2, "paged_prefill: cache must be [2, NB, BS, Hkv, D]");
    const int64_t nb = cache.size(1), bs = cache.size(2), hkv = cache.size(3), d = int8 ? cache.size(4) - 4 : cache.size(4);
    TORCH_CHECK(d == 64 || d == 128 || d == 256, "paged_prefill: head size 64, 128 or 256");
    TORCH_CHECK(q.dim() == 2 && q.size(1) == num_heads * d && num_heads % hkv == 0 && out.sizes() == q.sizes(),
                "paged_prefill: q and out must be [T, H*D]");
    TORCH_CHECK(tables.scalar_type() == torch::kInt64, "paged_prefill: tables must be int64");
    for (const auto* t : {&rows, &qlens, &lens})
        TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == tables.size(0),
                    "paged_prefill: rows, qlens and lens must be int64, one per table row");
    const int64_t chunks = tables.size(0), tb = tables.stride(0), group = num_heads / hkv;
    const int64_t* tab = tables.data_ptr<int64_t>();
    const int64_t* row0 = rows.data_ptr<int64_t>();
    const int64_t* nq = qlens.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    constexpr int64_t pad = 64;                  // keys are packed in whole 64-key chunks
    std::vector<int64_t> offset(chunks + 1, 0);  // each chunk's first packed key
    for (int64_t c = 0; c < chunks; ++c) {
        TORCH_CHECK(nq[c] >= 1 && nq[c] <= len[c] && len[c] <= tables.size(1) * bs && row0[c] >= 0 &&
                        row0[c] + nq[c] <= q.size(0), "paged_prefill: chunk rows or lengths out of range");
        for (int64_t b = 0; b * bs < len[c]; ++b)
            TORCH_CHECK(tab[c * tb + b] >= 0 && tab[c * tb + b] < nb, "paged_prefill: block id outside the cache");
        offset[c + 1] = offset[c] + (len[c] + pad - 1) / pad * pad;
    }
#if DEEPFUSE_BF16_DOT
    const int64_t total = offset[chunks];
    auto scratch = torch::empty({2, hkv, total * d}, torch::kBFloat16);  // packed K^T, then V
    auto* kt = reinterpret_cast<uint16_t*>(scratch.data_ptr());
    uint16_t* vv = kt + hkv * total * d;
    std::vector<float> scales(int8 ? 2 * hkv * total : 0);  // int8 rows: each key's, then each value's scale
    float* ks = int8 ? scales.data() : nullptr;
    float* vs = int8 ? ks + hkv * total : nullptr;
    auto pack = [&](const auto* kc) {  // the cache's k half; its v half follows
        const auto* vc = kc + nb * bs * hkv * cache.size(4);
        balanced::balanced_for(chunks * hkv, [&](int64_t item) { return len[item / hkv] + pad; }, [&](int64_t item, int64_t) {
            const int64_t c = item / hkv, kv = item % hkv, at = (kv * total + offset[c]) * d;
            const int64_t first = kv * total + offset[c];
            pack_kv(kc, vc, tab + c * tb, len[c], offset[c + 1] - offset[c], bs, hkv, kv, d, kt + at, vv + at,
                    ks ? ks + first : nullptr, vs ? vs + first : nullptr);
        });
    };
    if (int8)
        pack(cache.data_ptr<int8_t>());
    else
        pack(reinterpret_cast<const uint16_t*>(cache.data_ptr()));
    struct Item {
        int64_t chunk, head, first, count;
    };
    std::vector<Item> items;  // blocks of 16 query rows, later positions (more keys) first
    for (int64_t c = 0; c < chunks; ++c)
        for (int64_t r = 0; r < nq[c]; r += 16)
            for (int64_t h = 0; h < num_heads; ++h) items.push_back({c, h, r, std::min<int64_t>(16, nq[c] - r)});
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
        return len[a.chunk] - nq[a.chunk] + a.first > len[b.chunk] - nq[b.chunk] + b.first;
    });
    const auto* qp = q.data_ptr<at::BFloat16>();
    auto* op = out.data_ptr<at::BFloat16>();
    const int64_t ld = q.size(1), n_items = static_cast<int64_t>(items.size());
    const bool tiles = amx && amx_available();
#pragma omp parallel num_threads(at::get_num_threads())
    {
#if DEEPFUSE_AMX
        if (tiles) configure_tiles({16, 16, 16, 16, 16, 16, 16, 16});  // every tile 16 rows x 64 bytes
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; ++i) {
            const Item& it = items[i];
            const int64_t kv = it.head / group, at = (kv * total + offset[it.chunk]) * d;
            (tiles ? attend_block<true> : attend_block<false>)(
                qp, op, ld, it.head, row0[it.chunk] + it.first, it.count, len[it.chunk] - nq[it.chunk] + it.first,
                Packed{kt + at, vv + at, ks ? ks + kv * total + offset[it.chunk] : nullptr,
                       vs ? vs + kv * total + offset[it.chunk] : nullptr}, d, window, static_cast<float>(scale));
        }
#if DEEPFUSE_AMX
        if (tiles) _tile_release();
#endif
    }
#endif
}
