// Paged decode attention on AMX tiles: paged_decode.cpp's contract for bf16 with a head size of
// 64 or 128 and a block size that is a multiple of 16 (paged_decode calls it where AMX runs).
//
// Work item: a span of query rows of one sequence (consecutive rows whose blocks agree: a
// decode row alone, or a verify chunk's rows) and one kv head. Its "lanes" are the span's rows
// times the kv head's query heads (at most 16). Per segment of 256 positions (aligned to
// multiples of 256, so a row's arithmetic never depends on what shares its span):
//   scores   S^T [16 keys x 16 lanes] = K Q^T per tile of 16 keys: the keys are the A tile, read
//            in place from the cache; the queries are one B tile per 32 dims, packed once
//   softmax  per lane over its own positions (masked), running max and sum in float; the
//            weights P rounded to bf16 (as flash attention does)
//   values   O [16 lanes x D] += P V per chunk of 32 positions: P is the A tile, V the B tiles
//            (pairs of positions interleaved), accumulated over the segment in C tiles, then
//            folded into each lane's float accumulator with the running-max correction.
// Positions outside a lane's keys have weight exactly 0, and every sum runs in an order fixed by
// the positions, so rows computed alone or in a span, in any batch, give the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "amx.h"

#if DEEPFUSE_AMX
#include "vec.h"

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kSeg = 256;  // positions per segment
constexpr int kLanes = 16;     // query vectors per work item
constexpr int64_t kAhead = 2;  // blocks of keys prefetched ahead

// tiles: 0 scores [16 keys x 16 lanes]; 1 A (keys or weights); 2, 7 B (queries or values, in
// turn); 3-6 outputs [16 lanes x 16 dims], one per 16 dims of the 64 in flight
void configure_decode() { configure_tiles({16, 16, 16, 16, 16, 16, 16, 16}); }

// in [16][16] (key-major) -> out[c * ldo + k] = in[k][c] * scale, for lanes c < lanes
inline void transpose16(const float* in, float* out, int64_t ldo, float scale, int lanes) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + 16 * i);
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i+3
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes: column 4L + j
        const __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 col[4] = {_mm512_shuffle_f32x4(u0, u2, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(u0, u2, _MM_SHUFFLE(3, 1, 3, 1)),
                               _mm512_shuffle_f32x4(u1, u3, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(u1, u3, _MM_SHUFFLE(3, 1, 3, 1))};
        for (int l = 0; l < 4; ++l)
            if (4 * l + j < lanes) _mm512_storeu_ps(out + (4 * l + j) * ldo, _mm512_mul_ps(col[l], s));
    }
}

// The scores of 16 keys (rows at `keys`, `stride` elements apart) against the packed queries
// in C tile `slot` (0: tile 0, 1-4: tiles 3-6), stored to dst [16 keys][16 lanes].
template <int64_t kParts>
inline void score_tile(int slot, const bf16* keys, int64_t stride, const uint16_t* qpack, float* dst) {
    // tile numbers must be immediates: one case per C tile
#define DEEPFUSE_SCORE(C)                                                           \
    _tile_zero(C);                                                                  \
    for (int64_t t = 0; t < kParts; ++t) {                                          \
        if (t % 2 == 0) {                                                           \
            _tile_loadd(1, keys + 32 * t, stride * 2);                              \
            _tile_loadd(2, qpack + t * 512, 64);                                    \
            _tile_dpbf16ps(C, 1, 2);                                                \
        } else {                                                                    \
            _tile_loadd(1, keys + 32 * t, stride * 2);                              \
            _tile_loadd(7, qpack + t * 512, 64);                                    \
            _tile_dpbf16ps(C, 1, 7);                                                \
        }                                                                           \
    }                                                                               \
    _tile_stored(C, dst, 64);
    switch (slot) {
        case 0: DEEPFUSE_SCORE(0) break;
        case 1: DEEPFUSE_SCORE(3) break;
        case 2: DEEPFUSE_SCORE(4) break;
        case 3: DEEPFUSE_SCORE(5) break;
        default: DEEPFUSE_SCORE(6) break;
    }
#undef DEEPFUSE_SCORE
}

// Values of the 32 positions from p (dims d0 .. d0+63) as four B tiles [16 pairs x 16 dims]
// (positions 2i and 2i+1 interleaved in row i): dst [4][16][32]. Positions outside [lo, hi)
// (that no lane reads) are zeros.
inline void pack_values(const bf16* vbase, const int64_t* table, int64_t stride, int64_t bs, int64_t p, int64_t lo,
                        int64_t hi, int64_t d0, uint16_t* dst) {
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < 16; ++i) {
        __m512i rows[2][2];
        for (int e = 0; e < 2; ++e) {
            const int64_t pe = p + 2 * i + e;
            if (pe >= lo && pe < hi) {
                const int64_t b = pe / bs;
                const bf16* src = vbase + (table[b] * bs + pe - b * bs) * stride + d0;
                rows[e][0] = _mm512_loadu_si512(src);
                rows[e][1] = _mm512_loadu_si512(src + 32);
            } else {
                rows[e][0] = rows[e][1] = _mm512_setzero_si512();
            }
        }
        for (int h = 0; h < 2; ++h) {  // dims 32h .. 32h+31 of the 64: tiles 2h and 2h+1
            _mm512_store_si512(dst + (2 * h) * 512 + 32 * i, _mm512_permutex2var_epi16(rows[0][h], lo_idx, rows[1][h]));
            _mm512_store_si512(dst + (2 * h + 1) * 512 + 32 * i,
                               _mm512_permutex2var_epi16(rows[0][h], hi_idx, rows[1][h]));
        }
    }
}

using Span = std::pair<int64_t, int64_t>;  // first query row, count

// Consecutive rows with nondecreasing lengths, each reading the blocks the next one reads at the
// same places (so all of them agree with the last, longest one), at most `most` rows per span.
std::vector<Span> make_spans(const int64_t* tables, const int64_t* lens, int64_t n, int64_t tb, int64_t bs,
                             int64_t most) {
    std::vector<Span> spans;
    for (int64_t r = 0; r < n;) {
        int64_t e = r + 1;
        while (e < n && e - r < most && lens[e] >= lens[e - 1] &&
               std::equal(tables + (e - 1) * tb, tables + (e - 1) * tb + (lens[e - 1] + bs - 1) / bs, tables + e * tb))
            ++e;
        spans.emplace_back(r, e - r);
        r = e;
    }
    return spans;
}

template <int D>
void decode_span(const bf16* q, const bf16* cache, const int64_t* tables, const int64_t* lens, bf16* out,
                 const Span& span, int64_t kv, int64_t g, int64_t hkv, int64_t bs, int64_t nb, int64_t tb,
                 int64_t window, float scale, uint16_t* qpack, float* ctmp, float* score, uint16_t* weights,
                 uint16_t* vpack, float* segout, float* acc) {
    constexpr int64_t kParts = D / 32;  // 32-dim parts of a head
    const int64_t h = g * hkv, stride = hkv * D, half = nb * bs * hkv * D;
    const int lanes = static_cast<int>(span.second * g);
    const int64_t* table = tables + (span.first + span.second - 1) * tb;  // the longest row's
    int64_t first[kLanes], len[kLanes];
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;  // positions any lane reads
    for (int c = 0; c < lanes; ++c) {
        len[c] = lens[span.first + c / g];
        first[c] = window > 0 ? std::max<int64_t>(0, len[c] - window) : 0;
        lo = std::min(lo, first[c]);
        hi = std::max(hi, len[c]);
    }
    // queries as B tiles: part t, row i, lane c -> dims 32t + 2i, 32t + 2i + 1 of lane c
    std::memset(qpack, 0, kParts * 512 * sizeof(uint16_t));
    for (int c = 0; c < lanes; ++c) {
        const auto* src = reinterpret_cast<const uint16_t*>(q + (span.first + c / g) * h * D + (kv * g + c % g) * D);
        for (int64_t e = 0; e < D; ++e) qpack[(e / 32) * 512 + ((e % 32) / 2) * 32 + c * 2 + e % 2] = src[e];
    }
    float m[kLanes], l[kLanes];
    for (int c = 0; c < kLanes; ++c) {
        m[c] = -std::numeric_limits<float>::infinity();
        l[c] = 0.f;
    }
    std::memset(acc, 0, kLanes * D * sizeof(float));
    std::memset(weights, 0, kLanes * kSeg * sizeof(uint16_t));  // lanes past `lanes` stay 0
    const bf16* kbase = cache + kv * D;
    const bf16* vbase = cache + half + kv * D;
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t seg = lo / kSeg * kSeg; seg < hi; seg += kSeg) {
        const int64_t p_lo = std::max(seg, lo), p_hi = std::min(seg + kSeg, hi);
        const int64_t t_lo = p_lo / 16 * 16, t_hi = (p_hi + 15) / 16 * 16;  // key tiles
        // scores, a tile of 16 keys at a time into C tiles 3-6 and 0 in turn (several in flight),
        // each stored to ctmp; then transposed to lane-major rows (the stores have landed by then)
        for (int64_t p0 = t_lo; p0 < t_hi; p0 += 16) {
            const int64_t b = p0 / bs, at = table[b] * bs + p0 - b * bs, j = (p0 - seg) / 16;
            if (p0 == std::max(t_lo, b * bs)) {  // entering block b: its values, and keys ahead
                if ((b + kAhead) * bs < p_hi) prefetch_rows(kbase + table[b + kAhead] * bs * stride, bs, stride * sizeof(bf16), D * sizeof(bf16));
                prefetch_rows(vbase + table[b] * bs * stride, bs, stride * sizeof(bf16), D * sizeof(bf16));
            }
            score_tile<kParts>(static_cast<int>(j % 5), kbase + at * stride, stride, qpack, ctmp + j * 256);
        }
        for (int64_t p0 = t_lo; p0 < t_hi; p0 += 16)
            transpose16(ctmp + (p0 - seg) / 16 * 256, score + (p0 - seg), kSeg + 32, scale, lanes);
        const int64_t c_lo = (p_lo - seg) / 32 * 32, c_hi = (p_hi - seg + 31) / 32 * 32;  // value chunks
        float rescale[kLanes];
        bool active[kLanes];
        for (int c = 0; c < lanes; ++c) {  // softmax of each lane over its own positions
            const int64_t a = std::max(first[c], seg), z = std::min(len[c], seg + kSeg);
            float* sc = score + c * (kSeg + 32);
            auto* w = reinterpret_cast<__m256i*>(weights + c * kSeg);
            active[c] = a < z;
            if (!active[c]) {
                for (int64_t i = c_lo; i < c_hi; i += 16) _mm256_storeu_si256(w + i / 16, _mm256_setzero_si256());
                continue;
            }
            const __m512i va = _mm512_set1_epi32(static_cast<int>(a - seg)), vz = _mm512_set1_epi32(static_cast<int>(z - seg));
            auto valid = [&](int64_t i) {
                const __m512i pos = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(i)));
                return static_cast<__mmask16>(_mm512_cmpge_epi32_mask(pos, va) & _mm512_cmplt_epi32_mask(pos, vz));
            };
            __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            for (int64_t i = (a - seg) / 16 * 16; i < z - seg; i += 16)
                top = _mm512_mask_max_ps(top, valid(i), top, _mm512_loadu_ps(sc + i));
            const float t = std::max(m[c], _mm512_reduce_max_ps(top));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t i = c_lo; i < c_hi; i += 16) {
                const __mmask16 ok = valid(i);
                const __m512 p = ok ? _mm512_maskz_mov_ps(ok, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + i),
                                                                                   _mm512_set1_ps(t))))
                                    : _mm512_setzero_ps();
                sum = _mm512_add_ps(sum, p);
                _mm256_storeu_si256(w + i / 16, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
            }
            rescale[c] = m[c] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[c] - t);
            l[c] = l[c] * rescale[c] + _mm512_reduce_add_ps(sum);
            m[c] = t;
        }
        for (int64_t d0 = 0; d0 < D; d0 += 64) {  // values, 64 dims at a time (four C tiles)
            for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32)  // every chunk packed first: its stores land
                pack_values(vbase, table, stride, bs, seg + c0, lo, hi, d0, vpack + c0 / 32 * 2048);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {
                const uint16_t* vp = vpack + c0 / 32 * 2048;
                _tile_loadd(1, weights + c0, kSeg * 2);
                _tile_loadd(2, vp, 64);
                _tile_dpbf16ps(3, 1, 2);
                _tile_loadd(7, vp + 512, 64);
                _tile_dpbf16ps(4, 1, 7);
                _tile_loadd(2, vp + 1024, 64);
                _tile_dpbf16ps(5, 1, 2);
                _tile_loadd(7, vp + 1536, 64);
                _tile_dpbf16ps(6, 1, 7);
            }
            _tile_stored(3, segout + d0, D * 4);
            _tile_stored(4, segout + d0 + 16, D * 4);
            _tile_stored(5, segout + d0 + 32, D * 4);
            _tile_stored(6, segout + d0 + 48, D * 4);
        }
        for (int c = 0; c < lanes; ++c) {  // fold the segment into each active lane's accumulator
            if (!active[c]) continue;
            const __m512 r = _mm512_set1_ps(rescale[c]);
            for (int64_t e = 0; e < D; e += 16)
                _mm512_storeu_ps(acc + c * D + e, _mm512_fmadd_ps(_mm512_loadu_ps(acc + c * D + e), r,
                                                                   _mm512_loadu_ps(segout + c * D + e)));
        }
    }
    for (int c = 0; c < lanes; ++c) {
        bf16* dst = out + (span.first + c / g) * h * D + (kv * g + c % g) * D;
        const __m512 inv = _mm512_set1_ps(l[c] > 0.f ? 1.f / l[c] : 0.f);
        for (int64_t e = 0; e < D; e += 16) store16(dst + e, _mm512_mul_ps(_mm512_loadu_ps(acc + c * D + e), inv));
    }
}

template <int D>
void decode_all(const bf16* q, const bf16* cache, const int64_t* tables, const int64_t* lens, bf16* out,
                const std::vector<Span>& spans, int64_t g, int64_t hkv, int64_t bs, int64_t nb, int64_t tb,
                int64_t window, float scale) {
    const int64_t items = static_cast<int64_t>(spans.size()) * hkv;
    team::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        configure_decode();
        alignas(64) uint16_t qpack[D / 32 * 512];
        alignas(64) float ctmp[kSeg * 16];
        alignas(64) float score[kLanes * (kSeg + 32)];
        alignas(64) uint16_t weights[kLanes * kSeg];
        alignas(64) uint16_t vpack[kSeg / 32 * 2048];
        alignas(64) float segout[kLanes * D];
        alignas(64) float acc[kLanes * D];
        for (int64_t item = begin; item < end; ++item)
            decode_span<D>(q, cache, tables, lens, out, spans[item / hkv], item % hkv, g, hkv, bs, nb, tb, window,
                           scale, qpack, ctmp, score, weights, vpack, segout, acc);
        _tile_release();
    });
}

}  // namespace
#endif

bool amx_decode_applies(int64_t d, int64_t bs, int64_t g) {
#if DEEPFUSE_AMX
    return amx_available() && (d == 64 || d == 128) && bs % 16 == 0 && g <= kLanes;
#else
    return false;
#endif
}

std::vector<std::pair<int64_t, int64_t>> decode_spans(const int64_t* tables, const int64_t* lens, int64_t n, int64_t tb,
                                                      int64_t bs, int64_t g) {
#if DEEPFUSE_AMX
    return make_spans(tables, lens, n, tb, bs, kLanes / g);
#else
    return {};
#endif
}

// paged_decode.cpp's contract for the rows of `spans` (amx_decode_applies must hold)
void paged_decode_amx(const c10::BFloat16* q, const c10::BFloat16* cache, const int64_t* tables, const int64_t* lens,
                      c10::BFloat16* out, const std::vector<std::pair<int64_t, int64_t>>& spans, int64_t h, int64_t hkv,
                      int64_t d, int64_t bs, int64_t nb, int64_t tb, int64_t window, float scale) {
#if DEEPFUSE_AMX
    if (d == 64) decode_all<64>(q, cache, tables, lens, out, spans, h / hkv, hkv, bs, nb, tb, window, scale);
    if (d == 128) decode_all<128>(q, cache, tables, lens, out, spans, h / hkv, hkv, bs, nb, tb, window, scale);
#endif
}
